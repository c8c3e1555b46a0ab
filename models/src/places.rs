//! Where the tokens of one forward sit: their columns, which every row of the batch shares,
//! and each row's left padding, which turns a column into that row's position.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Tensor, TensorData};

use crate::config::AttnRules;

/// The columns of one forward's tokens and the rows' left padding.
///
/// A batch of prompts of different lengths is left-padded to one length, as transformers pads
/// for generation: row `r` starts with `pads[r]` pad columns, and its token in column `c` is
/// at position `c - pads[r]`. The attention mask hides the pad columns from every real query,
/// the rotary embedding rotates by the row's positions, and Llama 4's chunks are counted from
/// the row's first real token (transformers' `chunked_overlay` with `left_padding`); what
/// counts columns, not positions (the causal order, a sliding window's distance, Llama 4's
/// attention temperature, the cache), reads the columns. Without padding, columns and
/// positions are the same numbers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Places {
    columns: Range<usize>,
    /// One count per row; empty when no row is padded.
    pads: Vec<usize>,
}

impl Places {
    /// The tokens in `columns`, in rows with `pads` leading pad columns each (empty, or all
    /// zero, for a batch without padding).
    pub fn new(columns: Range<usize>, pads: &[usize]) -> Self {
        let pads = match pads.iter().any(|&p| p > 0) {
            true => pads.to_vec(),
            false => Vec::new(),
        };
        Self { columns, pads }
    }

    /// The columns of this forward's tokens.
    pub fn columns(&self) -> Vec<usize> {
        self.columns.clone().collect()
    }

    /// Each row's leading pad columns; empty when no row is padded.
    pub fn pads(&self) -> &[usize] {
        &self.pads
    }

    /// The positions of the tokens, one list per row where rows are padded (a pad column at
    /// position 0, as transformers' `position_ids` masks pads), else one list for every row.
    pub fn positions(&self) -> Vec<Vec<usize>> {
        if self.pads.is_empty() {
            return vec![self.columns()];
        }
        self.pads
            .iter()
            .map(|&pad| self.columns.clone().map(|c| c.saturating_sub(pad)).collect())
            .collect()
    }

    /// `true` where query column `queries[i]` of a row may not see key column `keys[j]`: a
    /// later column, one outside the window (transformers' causal mask with
    /// `sliding_window_overlay`: visible iff `key > query - window`), one in another chunk of
    /// the row's positions (`chunked_overlay`: visible iff `(key - pad) / chunk == (query -
    /// pad) / chunk`, floor division), or a pad column. A pad query sees its own column (and
    /// nothing else), so that no row of scores is hidden whole: its softmax stays finite, and
    /// its output, which no real token reads, stays a number the MoE layers accept.
    ///
    /// `None` where nothing is hidden (a decode step's one query of an unpadded batch sees every
    /// cached key, unless a window or a chunk says otherwise): no mask to build and fill.
    ///
    /// # Shapes
    /// - output: `[rows, queries, keys]`, `rows` one per batch row where rows are padded, else
    ///   one for every row
    pub(crate) fn mask<B: Backend>(
        &self,
        keys: &[usize],
        rules: &AttnRules,
        device: &B::Device,
    ) -> Option<Tensor<B, 3, Bool>> {
        let queries = self.columns();
        let pads = match self.pads.is_empty() {
            true => vec![0],
            false => self.pads.clone(),
        };
        let mut hidden = Vec::with_capacity(pads.len() * queries.len() * keys.len());
        for &pad in &pads {
            let chunk_of = |c: usize, size: usize| (c as i64 - pad as i64).div_euclid(size as i64);
            for &q in &queries {
                hidden.extend(keys.iter().map(|&k| {
                    let future = k > q;
                    let outside = rules.window.is_some_and(|w| k + w <= q);
                    let other_chunk = rules.chunk.is_some_and(|c| chunk_of(k, c) != chunk_of(q, c));
                    let pad_key = k < pad && !(q < pad && k == q);
                    future || outside || other_chunk || pad_key
                }));
            }
        }
        hidden.contains(&true).then(|| {
            Tensor::from_data(
                TensorData::new(hidden, [pads.len(), queries.len(), keys.len()]),
                device,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;

    use super::Places;
    use crate::config::AttnRules;

    fn mask(places: &Places, keys: std::ops::Range<usize>, rules: AttnRules) -> Vec<Vec<Vec<bool>>> {
        let keys: Vec<usize> = keys.collect();
        let (rows, q, k) = (places.pads().len().max(1), places.columns().len(), keys.len());
        let flat = match places.mask::<NdArray>(&keys, &rules, &Default::default()) {
            Some(m) => {
                assert_eq!(m.dims(), [rows, q, k]);
                let flat = m.into_data().to_vec::<bool>().unwrap();
                assert!(flat.contains(&true), "a mask that hides nothing");
                flat
            }
            None => vec![false; rows * q * k],
        };
        (0..rows)
            .map(|r| {
                (0..q)
                    .map(|i| flat[(r * q + i) * k..(r * q + i + 1) * k].to_vec())
                    .collect()
            })
            .collect()
    }

    /// A row padded by 2 of 5 columns: its real queries see no pad column and every earlier
    /// real one; each pad query sees itself alone; the unpadded row is plain causal.
    #[test]
    fn pad_columns_are_hidden_from_real_queries_and_pad_queries_see_themselves() {
        let places = Places::new(0..5, &[2, 0]);
        let m = mask(&places, 0..5, AttnRules::default());
        let (x, o) = (true, false);
        assert_eq!(
            m[0],
            vec![
                vec![o, x, x, x, x],
                vec![x, o, x, x, x],
                vec![x, x, o, x, x],
                vec![x, x, o, o, x],
                vec![x, x, o, o, o],
            ]
        );
        assert_eq!(m[1][4], vec![o, o, o, o, o]);
        assert_eq!(m[1][1], vec![o, o, x, x, x]);
        assert_eq!(places.positions(), vec![vec![0, 0, 0, 1, 2], vec![0, 1, 2, 3, 4]]);
    }

    /// Chunks count from a row's first real token: with chunks of 2 and one pad, columns 1–2
    /// form the row's first chunk and 3–4 its second.
    #[test]
    fn chunks_are_counted_from_the_rows_own_positions() {
        let rules = AttnRules {
            chunk: Some(2),
            ..AttnRules::default()
        };
        let m = mask(&Places::new(3..5, &[1]), 0..5, rules);
        let (x, o) = (true, false);
        assert_eq!(m[0], vec![vec![x, x, x, o, x], vec![x, x, x, o, o]]);
        // Without padding, columns 2–3 share a chunk.
        let m = mask(&Places::new(3..5, &[0]), 0..5, rules);
        assert_eq!(m[0], vec![vec![x, x, o, o, x], vec![x, x, x, x, o]]);
    }
}
