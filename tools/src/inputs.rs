//! Seeded benchmark inputs with balanced routing, so that every configuration a benchmark
//! compares times the same batch with the same per-expert load.

use burn::module::Param;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use mpipemoe::{seeded_uniform, MoeLayer};

/// The router weight `[n_experts, d_model]` that scores expert `e` by a token's coordinate `e`
/// (a one-hot row per expert), for [`balanced_tokens`].
///
/// # Panics
/// If `d_model < n_experts`.
pub fn balanced_router(n_experts: usize, d_model: usize) -> Vec<f32> {
    assert!(
        d_model >= n_experts,
        "balanced routing needs d_model >= n_experts"
    );
    let mut w = vec![0.0f32; n_experts * d_model];
    for e in 0..n_experts {
        w[e * d_model + e] = 1.0;
    }
    w
}

/// `tokens` seeded tokens `[tokens, d_model]` of rank `rank` whose `top_k` experts under
/// [`balanced_router`] are `(g · top_k + j) mod n_experts` for the token's global index `g`:
/// over a batch whose `tokens · top_k` is a multiple of `n_experts`, every expert receives the
/// same number of rows, on every rank. The other coordinates are uniform in [-1, 1).
pub fn balanced_tokens(
    seed: u64,
    rank: usize,
    tokens: usize,
    d_model: usize,
    n_experts: usize,
    top_k: usize,
) -> Vec<f32> {
    let mut x = seeded_uniform(
        seed ^ (rank as u64).wrapping_mul(0x9E37),
        "benchmark tokens",
        tokens * d_model,
        1.0,
    );
    for t in 0..tokens {
        let row = &mut x[t * d_model..(t + 1) * d_model];
        row[..n_experts].iter_mut().for_each(|v| *v = 0.0);
        let g = rank * tokens + t;
        for j in 0..top_k {
            row[(g * top_k + j) % n_experts] = (4 + top_k - j) as f32;
        }
    }
    x
}

/// Sets `layer`'s router to [`balanced_router`] (and drops its bias), so that
/// [`balanced_tokens`] route evenly.
pub fn balance_router<B: Backend>(layer: &mut MoeLayer<B>) {
    let [e, m] = layer.router.weight.dims();
    let device = layer.router.weight.device();
    let w = Tensor::<B, 2>::from_data(
        TensorData::new(balanced_router(e, m), [e, m]).convert::<B::FloatElem>(),
        &device,
    );
    layer.router.weight = Param::from_tensor(w);
    layer.router.bias = None;
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use mpipemoe::MoeLayerConfig;

    #[test]
    fn every_expert_gets_the_same_rows() {
        for (e, k, t) in [(4, 1, 64), (8, 2, 40), (4, 2, 6)] {
            let mut layer = MoeLayerConfig::new(16, 8, e, k).init::<NdArray>(&Default::default());
            balance_router(&mut layer);
            let x = Tensor::<NdArray, 2>::from_data(
                TensorData::new(balanced_tokens(1, 0, t, 16, e, k), [t, 16]),
                &Default::default(),
            );
            let out = layer.forward(x);
            let load = &out.stats.routing.tokens_per_expert;
            assert!(load.iter().all(|&l| l == t * k / e), "{load:?}");
        }
    }
}
