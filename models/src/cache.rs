//! The key/value cache of generation.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// One layer's cached keys and values (after the rotary embedding), with the column of each
/// entry (its position in an unpadded row; see [`Places`](crate::Places)).
///
/// A sliding-window layer keeps only the entries a later query can see (the last
/// `window - 1`), as transformers' sliding-window cache does; a full layer keeps everything.
#[derive(Debug, Clone)]
pub struct LayerCache<B: Backend> {
    /// `[batch, n_kv_heads, cached, head_dim]`
    pub keys: Tensor<B, 4>,
    /// `[batch, n_kv_heads, cached, head_dim]`
    pub values: Tensor<B, 4>,
    /// The column of each cached entry, in order.
    pub columns: Vec<usize>,
    /// DeepSeek-V3's `kv_b` laid out per head for attention on the latents (its key map
    /// `[heads, nope, kv_lora_rank]` and value map `[heads, kv_lora_rank, v]`), made once a
    /// generation at its first cached step rather than re-laid from the weight at every step.
    pub(crate) absorbed: Option<(Tensor<B, 3>, Tensor<B, 3>)>,
}

/// Every layer's cache, the next column, and the rows' left padding: what
/// [`MoeCausalLm::forward`](crate::MoeCausalLm::forward) reads and extends when generating one
/// token at a time.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    /// One entry per decoder layer; `None` before the first forward.
    pub layers: Vec<Option<LayerCache<B>>>,
    /// The column the next token gets (the tokens seen so far, pads included).
    pub next_position: usize,
    /// Each row's leading pad columns (a left-padded batch); empty for rows without padding.
    pub pads: Vec<usize>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        Self::left_padded(n_layers, &[])
    }

    /// An empty cache for `n_layers` layers and a batch whose row `r` starts with `pads[r]`
    /// pad columns (prompts of different lengths, left-padded to one length as transformers
    /// pads for generation): the forwards through it hide those columns from every query and
    /// count each row's positions from its first real token. The batch of every forward
    /// through it must have `pads.len()` rows.
    pub fn left_padded(n_layers: usize, pads: &[usize]) -> Self {
        Self {
            layers: vec![None; n_layers],
            next_position: 0,
            pads: pads.to_vec(),
        }
    }
}

impl<B: Backend> LayerCache<B> {
    /// Appends `keys`/`values` at `columns` to what is cached (if anything), returning the
    /// keys, values and columns attention reads.
    pub(crate) fn extend(
        cached: Option<&LayerCache<B>>,
        keys: Tensor<B, 4>,
        values: Tensor<B, 4>,
        columns: &[usize],
    ) -> Self {
        match cached {
            None => Self {
                keys,
                values,
                columns: columns.to_vec(),
                absorbed: None,
            },
            Some(c) => Self {
                keys: Tensor::cat(vec![c.keys.clone(), keys], 2),
                values: Tensor::cat(vec![c.values.clone(), values], 2),
                columns: c.columns.iter().chain(columns).copied().collect(),
                absorbed: c.absorbed.clone(),
            },
        }
    }

    /// Drops the entries no later query can see: through a window of `window`, a query at
    /// column `p` sees `p - window + 1 ..= p`, so after the last column `q` only the last
    /// `window - 1` are kept; in chunks of `chunk` (Llama 4), a query sees only its own
    /// chunk's keys, so only the entries in the chunk of `q + 1`, the next query's, are kept
    /// (a row's chunks counted from its first real token: with rows padded by `pads`, what
    /// the row whose next chunk starts earliest still sees). At least the last entry stays
    /// (hidden from the next query by the mask where its chunk has ended), so that no cache is
    /// ever empty: a zero-length tensor is a kernel launch of no elements on the GPU backends.
    pub(crate) fn trim(self, window: Option<usize>, chunk: Option<usize>, pads: &[usize]) -> Self {
        let n = self.columns.len();
        let Some(&last) = self.columns.last() else {
            return self;
        };
        // The first column any later query of any row can see, by each rule.
        let by_window = window.map_or(0, |w| (last + 2).saturating_sub(w));
        let chunk_start = |c: usize, pad: usize| match last + 1 < pad {
            true => 0,
            false => (last + 1 - pad) / c * c + pad,
        };
        let by_chunk = chunk.map_or(0, |c| match pads.is_empty() {
            true => chunk_start(c, 0),
            false => pads.iter().map(|&p| chunk_start(c, p)).min().unwrap_or(0),
        });
        let first_seen = by_window.max(by_chunk).min(last);
        let drop = self.columns.iter().take_while(|&&p| p < first_seen).count();
        if drop == 0 {
            return self;
        }
        let [b, h, _, d] = self.keys.dims();
        let [_, _, _, dv] = self.values.dims();
        Self {
            keys: self.keys.slice([0..b, 0..h, drop..n, 0..d]),
            values: self.values.slice([0..b, 0..h, drop..n, 0..dv]),
            columns: self.columns[drop..].to_vec(),
            absorbed: self.absorbed,
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::Tensor;

    use super::LayerCache;

    fn cache(columns: std::ops::Range<usize>) -> LayerCache<NdArray> {
        let n = columns.len();
        let device = Default::default();
        LayerCache {
            keys: Tensor::zeros([1, 2, n, 3], &device),
            values: Tensor::zeros([1, 2, n, 3], &device),
            columns: columns.collect(),
            absorbed: None,
        }
    }

    /// What each rule keeps after the last position: a window of 4 the last 3; chunks of 4 the
    /// next query's chunk (none of it yet when the last position closed a chunk: the last
    /// entry, masked, stays); both rules the later start; neither, everything.
    #[test]
    fn trimming_keeps_what_the_next_query_can_see() {
        let kept = |columns, window, chunk| {
            let c = cache(columns).trim(window, chunk, &[]);
            assert_eq!(c.keys.dims()[2], c.columns.len());
            c.columns
        };
        assert_eq!(kept(0..10, Some(4), None), vec![7, 8, 9]);
        assert_eq!(kept(0..10, None, Some(4)), vec![8, 9]);
        assert_eq!(kept(0..12, None, Some(4)), vec![11]);
        assert_eq!(kept(0..10, Some(2), Some(4)), vec![9]);
        assert_eq!(kept(0..10, Some(8), Some(4)), vec![8, 9]);
        assert_eq!(kept(5..7, None, Some(4)), vec![5, 6]);
        assert_eq!(kept(0..10, None, None), (0..10).collect::<Vec<_>>());
    }

    /// With padded rows, chunks start at each row's own offset, and the cache keeps what the
    /// row whose next chunk started first still sees: after column 9 with chunks of 4, an
    /// unpadded row's next chunk starts at column 8, a row padded by 3 at column 7.
    #[test]
    fn trimming_padded_rows_keeps_every_rows_chunk() {
        let kept = |pads: &[usize]| cache(0..10).trim(None, Some(4), pads).columns;
        assert_eq!(kept(&[0, 0]), vec![8, 9]);
        assert_eq!(kept(&[0, 3]), vec![7, 8, 9]);
        assert_eq!(kept(&[3, 1]), vec![7, 8, 9]);
    }
}
