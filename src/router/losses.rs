//! Auxiliary losses of the router.
//!
//! With expert parallelism each rank holds a slice of the global batch. Both losses are
//! returned as this rank's *additive share* of the loss over the global batch: the shares sum
//! over ranks to the single-rank value, so training with N ranks (summing gradients of
//! replicated parameters) matches training on one.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::kernels::{float, RouterKernels};

/// Switch-Transformer load-balancing loss, `coef · E · Σ_e f_e · P_e`.
///
/// `f_e` is the fraction of (token, choice) assignments routed to expert `e` over the global
/// batch, before capacity drops (piecewise constant, no gradient); `P_e` is the mean router
/// probability of `e` over the global batch. This rank contributes its tokens' part of `P_e`,
/// given as `prob_sums`, the column sums of its tokens' probabilities (which the layer also
/// returns as `router_softmax_sum` for a softmax router, so they are summed once). The
/// constant factor `coef · E / n_tokens_global` is folded into `f` on the host: one product
/// and a sum on the device.
///
/// # Shapes
/// - prob_sums: `[n_experts]` (this rank's tokens, summed)
/// - returns `[1]`
pub fn load_balancing_loss<B: Backend>(
    prob_sums: Tensor<B, 1>,
    expert_fraction: &[f64],
    n_tokens_global: usize,
    coef: f64,
) -> Tensor<B, 1> {
    let device = prob_sums.device();
    let [n_experts] = prob_sums.dims();
    if coef == 0.0 || n_tokens_global == 0 {
        return Tensor::zeros([1], &device);
    }
    let scale = coef * n_experts as f64 / n_tokens_global as f64;
    let f: Vec<f64> = expert_fraction.iter().map(|f| f * scale).collect();
    let f = Tensor::<B, 1>::from_data(TensorData::new(f, [n_experts]).convert::<B::FloatElem>(), &device);
    (prob_sums * f).sum()
}

/// Router z-loss (ST-MoE), `coef · mean_t logsumexp(logits_t)²` over the global batch.
///
/// # Shapes
/// - logits: `[n_tokens, n_experts]` (this rank's tokens)
/// - returns `[1]`
pub fn z_loss<B: RouterKernels>(logits: Tensor<B, 2>, n_tokens_global: usize, coef: f64) -> Tensor<B, 1> {
    let device = logits.device();
    let [n_tokens, _] = logits.dims();
    if coef == 0.0 || n_tokens == 0 || n_tokens_global == 0 {
        return Tensor::zeros([1], &device);
    }
    // One op (a node under autodiff, a kernel and a sum on the CubeCL backends) where the
    // composed form is ten: `RouterKernels::router_z_loss`.
    let scale = coef / n_tokens_global as f64;
    float::<B, 1>(B::router_z_loss(logits.into_primitive().tensor(), scale))
}
