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

    /// Drops the entries no later query can see through a window of `window`: a query at
    /// position `p` sees `p - window + 1 ..= p`, so after the last position `q` only the
    /// last `window - 1` are kept.
    pub(crate) fn trim(self, window: Option<usize>) -> Self {
        let Some(window) = window else { return self };
        let keep = window.saturating_sub(1);
        let n = self.positions.len();
        if n <= keep {
            return self;
        }
        let [b, h, _, d] = self.keys.dims();
        Self {
            keys: self.keys.slice([0..b, 0..h, n - keep..n, 0..d]),
            values: self.values.slice([0..b, 0..h, n - keep..n, 0..d]),
            positions: self.positions[n - keep..].to_vec(),
        }
    }
}
