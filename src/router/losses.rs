//! Auxiliary losses of the router.
//!
//! With expert parallelism each rank holds a slice of the global batch. Both losses are
//! returned as this rank's *additive share* of the loss over the global batch: the shares sum
//! over ranks to the single-rank value, so training with N ranks (summing gradients of
//! replicated parameters) matches training on one.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// Switch-Transformer load-balancing loss, `coef · E · Σ_e f_e · P_e`.
///
/// `f_e` is the fraction of (token, choice) assignments routed to expert `e` over the global
/// batch, before capacity drops (piecewise constant, no gradient); `P_e` is the mean router
/// probability of `e` over the global batch. This rank contributes its tokens' part of `P_e`.
///
/// # Shapes
/// - probs: `[n_tokens, n_experts]` (this rank's tokens)
/// - returns `[1]`
pub fn load_balancing_loss<B: Backend>(
    probs: Tensor<B, 2>,
    expert_fraction: &[f64],
    n_tokens_global: usize,
    coef: f64,
) -> Tensor<B, 1> {
    let device = probs.device();
    let [n_tokens, n_experts] = probs.dims();
    if coef == 0.0 || n_tokens == 0 || n_tokens_global == 0 {
        return Tensor::zeros([1], &device);
    }
    let f = TensorData::new(expert_fraction.to_vec(), [1, n_experts]).convert::<B::FloatElem>();
    let f = Tensor::<B, 2>::from_data(f, &device);
    let scale = coef * n_experts as f64 / n_tokens_global as f64;
    (probs.sum_dim(0) * f).sum() * scale
}

/// Router z-loss (ST-MoE), `coef · mean_t logsumexp(logits_t)²` over the global batch.
///
/// # Shapes
/// - logits: `[n_tokens, n_experts]` (this rank's tokens)
/// - returns `[1]`
pub fn z_loss<B: Backend>(logits: Tensor<B, 2>, n_tokens_global: usize, coef: f64) -> Tensor<B, 1> {
    let device = logits.device();
    let [n_tokens, _] = logits.dims();
    if coef == 0.0 || n_tokens == 0 || n_tokens_global == 0 {
        return Tensor::zeros([1], &device);
    }
    // The shift by the (detached) row maximum only guards exp against overflow: it cancels
    // exactly in the value and in the gradient.
    let shift = logits.clone().max_dim(1).detach();
    let lse = (logits - shift.clone()).exp().sum_dim(1).log() + shift;
    lse.powi_scalar(2).sum() * (coef / n_tokens_global as f64)
}
