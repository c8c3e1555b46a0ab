//! The key/value cache of generation.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// One layer's cached keys and values (after the rotary embedding), with the position of each
/// entry.
///
/// A sliding-window layer keeps only the entries a later query can see (the last
/// `window - 1`), as transformers' sliding-window cache does; a full layer keeps everything.
#[derive(Debug, Clone)]
pub struct LayerCache<B: Backend> {
    /// `[batch, n_kv_heads, cached, head_dim]`
    pub keys: Tensor<B, 4>,
    /// `[batch, n_kv_heads, cached, head_dim]`
    pub values: Tensor<B, 4>,
    /// The position of each cached entry, in order.
    pub positions: Vec<usize>,
}

/// Every layer's cache, and the next position: what [`MoeCausalLm::forward`](crate::MoeCausalLm::forward)
/// reads and extends when generating one token at a time.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    /// One entry per decoder layer; `None` before the first forward.
    pub layers: Vec<Option<LayerCache<B>>>,
    /// The position the next token gets (the tokens seen so far).
    pub next_position: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        Self {
            layers: vec![None; n_layers],
            next_position: 0,
        }
    }
}

impl<B: Backend> LayerCache<B> {
    /// Appends `keys`/`values` at `positions` to what is cached (if anything), returning the
    /// keys, values and positions attention reads.
    pub(crate) fn extend(
        cached: Option<&LayerCache<B>>,
        keys: Tensor<B, 4>,
        values: Tensor<B, 4>,
        positions: &[usize],
    ) -> Self {
        match cached {
            None => Self {
                keys,
                values,
                positions: positions.to_vec(),
            },
            Some(c) => Self {
                keys: Tensor::cat(vec![c.keys.clone(), keys], 2),
                values: Tensor::cat(vec![c.values.clone(), values], 2),
                positions: c.positions.iter().chain(positions).copied().collect(),
            },
        }
    }

    /// Drops the entries no later query can see: through a window of `window`, a query at
    /// position `p` sees `p - window + 1 ..= p`, so after the last position `q` only the last
    /// `window - 1` are kept; in chunks of `chunk` (Llama 4), a query sees only its own
    /// chunk's keys, so only the entries in the chunk of `q + 1`, the next query's, are kept.
    /// At least the last entry stays (hidden from the next query by the mask where its chunk
    /// has ended), so that no cache is ever empty: a zero-length tensor is a kernel launch
    /// of no elements on the GPU backends.
    pub(crate) fn trim(self, window: Option<usize>, chunk: Option<usize>) -> Self {
        let n = self.positions.len();
        let Some(&last) = self.positions.last() else {
            return self;
        };
        // The first position any later query can see, by each rule.
        let by_window = window.map_or(0, |w| (last + 2).saturating_sub(w));
        let by_chunk = chunk.map_or(0, |c| (last + 1) / c * c);
        let first_seen = by_window.max(by_chunk).min(last);
        let drop = self.positions.iter().take_while(|&&p| p < first_seen).count();
        if drop == 0 {
            return self;
        }
        let [b, h, _, d] = self.keys.dims();
        let [_, _, _, dv] = self.values.dims();
        Self {
            keys: self.keys.slice([0..b, 0..h, drop..n, 0..d]),
            values: self.values.slice([0..b, 0..h, drop..n, 0..dv]),
            positions: self.positions[drop..].to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::Tensor;

    use super::LayerCache;

    fn cache(positions: std::ops::Range<usize>) -> LayerCache<NdArray> {
        let n = positions.len();
        let device = Default::default();
        LayerCache {
            keys: Tensor::zeros([1, 2, n, 3], &device),
            values: Tensor::zeros([1, 2, n, 3], &device),
            positions: positions.collect(),
        }
    }

    /// What each rule keeps after the last position: a window of 4 the last 3; chunks of 4 the
    /// next query's chunk (none of it yet when the last position closed a chunk: the last
    /// entry, masked, stays); both rules the later start; neither, everything.
    #[test]
    fn trimming_keeps_what_the_next_query_can_see() {
        let kept = |positions, window, chunk| {
            let c = cache(positions).trim(window, chunk);
            assert_eq!(c.keys.dims()[2], c.positions.len());
            c.positions
        };
        assert_eq!(kept(0..10, Some(4), None), vec![7, 8, 9]);
        assert_eq!(kept(0..10, None, Some(4)), vec![8, 9]);
        assert_eq!(kept(0..12, None, Some(4)), vec![11]);
        assert_eq!(kept(0..10, Some(2), Some(4)), vec![9]);
        assert_eq!(kept(0..10, Some(8), Some(4)), vec![8, 9]);
        assert_eq!(kept(5..7, None, Some(4)), vec![5, 6]);
        assert_eq!(kept(0..10, None, None), (0..10).collect::<Vec<_>>());
    }
}
