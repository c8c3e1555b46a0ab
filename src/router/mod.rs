//! The gate: which experts each token goes to, with what weight, and the auxiliary losses.

mod autodiff;
mod balance;
#[cfg(feature = "cubecl")]
mod cubecl_choice;
#[cfg(feature = "cubecl")]
mod cubecl_router;
#[cfg(all(test, feature = "wgpu"))]
mod cubecl_tests;
#[cfg(feature = "cubecl")]
mod cubecl_z_loss;
#[cfg(feature = "fusion")]
mod fusion;
mod kernels;
mod losses;
mod module;
mod rule;
#[cfg(all(test, feature = "flex", feature = "ndarray"))]
mod tests;
// The choice and its definition are re-exported for the benchmark by `harness`.
pub(crate) mod topk;

pub(crate) use balance::score_bias_step;
pub use kernels::{
    pick_backward_composed, pick_composed, scores_backward_composed, scores_composed,
    z_loss_backward_composed, z_loss_composed, ChoiceRead, DeviceChoice, PickRule, RouterKernels,
};
pub(crate) use losses::{load_balancing_loss, z_loss};
pub(crate) use module::buffer;
pub(crate) use module::PendingRoute;
pub use module::{Router, Routing};
pub use rule::{RoutingRule, Scoring};
pub(crate) use topk::group_limited_top_k;

#[cfg(feature = "cubecl")]
use burn::tensor::ops::FloatTensor;

// NdArray and Flex (a router row is a few experts: its single-threaded element-wise ops are
// not where a step's time goes): the composed forms. `Autodiff<B>` records one node each
// (`autodiff.rs`); `Fusion<B>` runs the inner backend's (`fusion.rs`).
default_kernel_impls!(@ndarray RouterKernels);

#[cfg(feature = "flex")]
impl RouterKernels for burn::backend::Flex {}

/// One kernel each way (`cubecl_router.rs`), the composed form for what the kernels do not
/// read (other dtypes, no element, a choice outside the scores).
#[cfg(feature = "cubecl")]
impl<R, F, I, BT> RouterKernels for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    R::Server: burn_cubecl::cubecl::server::ComputeServer,
    R::Device: burn::tensor::backend::DeviceOps,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    fn router_scores(logits: FloatTensor<Self>, scoring: Scoring) -> FloatTensor<Self> {
        cubecl_router::scores(&logits, scoring).unwrap_or_else(|| scores_composed::<Self>(logits, scoring))
    }

    fn router_scores_backward(
        scores: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scoring: Scoring,
    ) -> FloatTensor<Self> {
        cubecl_router::scores_backward(&scores, &grad, scoring)
            .unwrap_or_else(|| scores_backward_composed::<Self>(scores, grad, scoring))
    }

    fn router_pick(
        scores: FloatTensor<Self>,
        indices: &[usize],
        top_k: usize,
        rule: PickRule,
    ) -> FloatTensor<Self> {
        cubecl_router::pick(&scores, indices, top_k, rule)
            .unwrap_or_else(|| pick_composed::<Self>(scores, indices, top_k, rule))
    }

    fn router_pick_backward(
        scores: FloatTensor<Self>,
        indices: &[usize],
        top_k: usize,
        grad: FloatTensor<Self>,
        rule: PickRule,
    ) -> FloatTensor<Self> {
        cubecl_router::pick_backward(&scores, indices, top_k, &grad, rule)
            .unwrap_or_else(|| pick_backward_composed::<Self>(scores, indices, top_k, grad, rule))
    }

    fn router_choose(
        values: FloatTensor<Self>,
        logits: FloatTensor<Self>,
        rule: &RoutingRule,
    ) -> Option<ChoiceRead> {
        cubecl_choice::choose(&values, &logits, rule)
    }

    fn router_z_loss(logits: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        match cubecl_z_loss::row_terms(&logits, scale) {
            // Each token's term from the kernel, their sum from burn's reduction.
            Some(terms) => <Self as burn::tensor::ops::FloatTensorOps<Self>>::float_sum(terms),
            None => z_loss_composed::<Self>(logits, scale),
        }
    }

    fn router_z_loss_backward(
        logits: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        cubecl_z_loss::backward(&logits, &grad, scale)
            .unwrap_or_else(|| z_loss_backward_composed::<Self>(logits, grad, scale))
    }
}
