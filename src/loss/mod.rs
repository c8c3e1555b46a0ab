//! The training loss of a language model's tokens: mean cross-entropy over `[n_tokens, vocab]`
//! logits, one backend op each way.
//!
//! [`cross_entropy`] is what PyTorch's `F.cross_entropy(logits, targets, ignore_index=…)` with
//! its mean reduction computes (transformers' causal-LM loss), with every negative target
//! ignored. Each row's negative log-likelihood is one [`LossKernels::token_nll`], which
//! `Autodiff<B>` records as one node (`loss/autodiff.rs`); Flex runs it in one parallel pass
//! over the rows each way (`loss/flex_cross_entropy.rs`), the CubeCL backends in one kernel
//! each way (`loss/cubecl_cross_entropy.rs`; under fusion the inner backend's), and NdArray
//! composes it from burn's ops ([`token_nll_forward_composed`], [`token_nll_backward_composed`]),
//! which are also the reference twins its tests compare against.

mod autodiff;
#[cfg(feature = "cubecl")]
mod cubecl_cross_entropy;
#[cfg(all(test, feature = "wgpu"))]
mod cubecl_tests;
#[cfg(feature = "flex")]
mod flex_cross_entropy;
mod kernels;
#[cfg(all(test, feature = "flex", feature = "ndarray"))]
mod tests;

#[cfg(any(feature = "cubecl", feature = "fusion"))]
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorPrimitive};

pub use kernels::{token_nll_backward_composed, token_nll_forward_composed, LossKernels};

/// The mean cross-entropy of `logits` against `targets` over the rows whose target is not
/// negative; a row with a negative target (PyTorch's `ignore_index`) adds nothing and takes
/// no gradient. With no row counted the mean is NaN, as PyTorch's is.
///
/// # Shapes
/// - logits: `[n_tokens, vocab]`, targets: `[n_tokens]` → `[1]`
///
/// # Panics
/// If a target is `vocab` or more, or the two disagree on `n_tokens` (the contract of burn's
/// `gather`). On the CubeCL backends, whose kernels cannot panic, a target of `vocab` or more
/// makes the loss NaN instead.
pub fn cross_entropy<B: LossKernels>(logits: Tensor<B, 2>, targets: Tensor<B, 1, Int>) -> Tensor<B, 1> {
    let [n_logits, _] = logits.dims();
    let [n_targets] = targets.dims();
    assert_eq!(
        n_logits, n_targets,
        "cross-entropy: {n_logits} rows of logits, {n_targets} targets"
    );
    let counted = targets.clone().greater_equal_elem(0).float().sum();
    let nll = B::token_nll(logits.into_primitive().tensor(), targets.into_primitive());
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(nll)).sum() / counted
}

#[cfg(feature = "flex")]
impl LossKernels for burn::backend::Flex {
    /// One pass over the rows on the pool (`loss/flex_cross_entropy.rs`).
    fn token_nll_forward(
        logits: burn::tensor::ops::FloatTensor<Self>,
        targets: burn::tensor::ops::IntTensor<Self>,
    ) -> (
        burn::tensor::ops::FloatTensor<Self>,
        burn::tensor::ops::FloatTensor<Self>,
    ) {
        flex_cross_entropy::token_nll_forward(logits, targets)
    }

    /// One pass over the rows on the pool, writing the gradient once.
    fn token_nll_backward(
        logits: burn::tensor::ops::FloatTensor<Self>,
        targets: burn::tensor::ops::IntTensor<Self>,
        lse: burn::tensor::ops::FloatTensor<Self>,
        grad: burn::tensor::ops::FloatTensor<Self>,
    ) -> burn::tensor::ops::FloatTensor<Self> {
        flex_cross_entropy::token_nll_backward(logits, targets, lse, grad)
    }
}

// NdArray: the composed ops. `Autodiff<B>` records a node of its own (`autodiff.rs`).
default_kernel_impls!(@ndarray LossKernels);

#[cfg(feature = "cubecl")]
impl<R, F, I, BT> LossKernels for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    R::Server: burn_cubecl::cubecl::server::ComputeServer,
    R::Device: burn::tensor::backend::DeviceOps,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    /// One cube per row (`loss/cubecl_cross_entropy.rs`).
    fn token_nll_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        cubecl_cross_entropy::token_nll_forward(&logits, &targets)
            .unwrap_or_else(|| token_nll_forward_composed::<Self>(logits, targets))
    }

    /// One thread per logit, writing the gradient once.
    fn token_nll_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        cubecl_cross_entropy::token_nll_backward(&logits, &targets, &lse, &grad)
            .unwrap_or_else(|| token_nll_backward_composed::<Self>(logits, targets, lse, grad))
    }
}

/// Under burn's fusion, the inner backend's kernels: fusion fuses element-wise ops, but not
/// across the row maximum and sum, so the composed loss was six kernels over the logits.
#[cfg(feature = "fusion")]
impl<B: burn_fusion::FusionBackend + LossKernels> LossKernels for burn_fusion::Fusion<B> {
    fn token_nll_forward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        use crate::exchange::fusion::{register, resolve};
        let device = logits.client.device().clone();
        let targets = targets.client.clone().resolve_tensor_int::<B>(targets);
        let (nll, lse) = B::token_nll_forward(resolve::<B>(logits), targets);
        (register::<B>(nll, &device), register::<B>(lse, &device))
    }

    fn token_nll_backward(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        use crate::exchange::fusion::{register, resolve};
        let device = logits.client.device().clone();
        let targets = targets.client.clone().resolve_tensor_int::<B>(targets);
        let d = B::token_nll_backward(
            resolve::<B>(logits),
            targets,
            resolve::<B>(lse),
            resolve::<B>(grad),
        );
        register::<B>(d, &device)
    }
}
