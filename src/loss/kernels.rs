//! The token cross-entropy's per-row kernels on backend tensors, overridable per backend, and
//! their composed twins.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorPrimitive};

/// The per-row kernels behind [`cross_entropy`](super::cross_entropy), on the backend that
/// runs them (the inner backend of `Autodiff`, which records them as one node).
///
/// A row's negative log-likelihood is `lse(row) − row[target]`, with
/// `lse(row) = log Σ_j exp(row[j])`; a row whose target is negative is ignored (PyTorch's
/// `ignore_index`, for any negative id): its value and its gradient are 0.
///
/// The defaults are composed from burn's tensor ops ([`token_nll_forward_composed`],
/// [`token_nll_backward_composed`]): correct on every backend, and fused by burn's fusion on
/// the GPU backends. A backend whose element-wise ops each run on one thread into a fresh
/// tensor overrides them, as Flex does (`loss/flex_cross_entropy.rs`).
pub trait LossKernels: Backend {
    /// Each row's negative log-likelihood, with `Autodiff<B>` recording one node whose backward
    /// is [`token_nll_backward`](Self::token_nll_backward). Backends other than `Autodiff`
    /// keep the default.
    ///
    /// # Shapes
    /// - logits: `[n_tokens, vocab]`, targets: `[n_tokens]` → `[n_tokens]`
    ///
    /// # Panics
    /// If a target is `vocab` or more (the contract of burn's `gather`).
    fn token_nll(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self> {
        Self::token_nll_forward(logits, targets).0
    }

    /// Each row's negative log-likelihood and its log-sum-exp, which the backward reuses.
    ///
    /// # Shapes
    /// - logits: `[n_tokens, vocab]`, targets: `[n_tokens]` → (`[n_tokens]`, `[n_tokens]`)
    ///
    /// # Panics
    /// If a target is `vocab` or more.
    fn token_nll_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        token_nll_forward_composed::<Self>(logits, targets)
    }

    /// The logits' gradient: `(softmax(row) − onehot(target)) · grad[row]`, zero on ignored
    /// rows, from the forward's log-sum-exp `lse`.
    ///
    /// # Shapes
    /// - logits: `[n_tokens, vocab]`, targets, lse, grad: `[n_tokens]` → `[n_tokens, vocab]`
    fn token_nll_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        token_nll_backward_composed::<Self>(logits, targets, lse, grad)
    }
}

/// Whether each row counts (target ≥ 0) as `1.0` or `0.0`, and the targets with the ignored
/// ones set to 0 so that they index a real column.
fn valid_and_indices<B: Backend>(targets: IntTensor<B>) -> (Tensor<B, 1>, Tensor<B, 1, Int>) {
    let targets = Tensor::<B, 1, Int>::from_primitive(targets);
    let valid = targets.clone().greater_equal_elem(0).float();
    (valid, targets.clamp_min(0))
}

/// [`LossKernels::token_nll_forward`] from tensor ops: the max-shifted log-sum-exp as burn's
/// `log_softmax` computes it, then `lse − row[target]` masked by the row's validity.
///
/// # Shapes
/// - logits: `[n_tokens, vocab]`, targets: `[n_tokens]` → (`[n_tokens]`, `[n_tokens]`)
pub fn token_nll_forward_composed<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let logits = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(logits));
    let [n_tokens, _] = logits.dims();
    let (valid, index) = valid_and_indices::<B>(targets);
    let max = logits.clone().max_dim(1);
    let lse = (logits.clone() - max.clone()).exp().sum_dim(1).log() + max;
    let picked = logits.gather(1, index.reshape([n_tokens, 1]));
    let lse = lse.reshape([n_tokens]);
    let nll = (lse.clone() - picked.reshape([n_tokens])) * valid;
    (nll.into_primitive().tensor(), lse.into_primitive().tensor())
}

/// [`LossKernels::token_nll_backward`] from tensor ops: `exp(logits − lse) · grad`, minus
/// `grad` at each row's target, times the row's validity.
///
/// # Shapes
/// - logits: `[n_tokens, vocab]`, targets, lse, grad: `[n_tokens]` → `[n_tokens, vocab]`
pub fn token_nll_backward_composed<B: Backend>(
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let logits = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(logits));
    let [n_tokens, _] = logits.dims();
    let column =
        |t: FloatTensor<B>| Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t)).reshape([n_tokens, 1]);
    let (valid, index) = valid_and_indices::<B>(targets);
    let grad = column(grad) * valid.reshape([n_tokens, 1]);
    let softmax = (logits - column(lse)).exp() * grad.clone();
    let out = softmax.scatter(
        1,
        index.reshape([n_tokens, 1]),
        grad.neg(),
        burn::tensor::IndexingUpdateOp::Add,
    );
    out.into_primitive().tensor()
}
