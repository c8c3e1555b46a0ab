//! Layout changes the models around the layer make on every step, as one backend op each.
//!
//! Attention moves its queries, keys and values from the sequence-major layout the
//! projections write (`[batch, seq, heads, head_dim]`) to the head-major one its products read
//! (`[batch, heads, seq, head_dim]`), and its output back. burn's `swap_dims` is a strided
//! view; on Flex the next `reshape` or product copies that view element by element
//! (`FlexTensor::to_contiguous` through `StridedIter`), on one thread, and so does the
//! backward's `reshape` of each gradient. In the 163 M Qwen3-MoE's fine-tuning step those
//! copies took about 57 ms of 1.3 s with the pool's other thread idle (design notes). Here
//! the swap is one op, [`swap_dims_contiguous`], that Flex writes contiguously in runs of the
//! last dimension over the pool (`flex_layout.rs`), the CubeCL backends in one copy kernel
//! (their matmul copies a swapped view once per product that reads it), `Autodiff<B>` records
//! as one node whose backward is the same op on the gradient, and NdArray and fusion keep as
//! burn's view.

#[cfg(feature = "flex")]
mod flex_layout;
#[cfg(all(test, any(feature = "flex", feature = "wgpu")))]
mod tests;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

/// The layout kernels, on the backend that runs them.
pub trait LayoutKernels: Backend {
    /// `x` with dimensions 1 and 2 swapped: burn's `swap_dims(1, 2)` by default (a view);
    /// a backend whose products copy strided operands element by element writes it
    /// contiguously instead (Flex). The values are the same either way.
    ///
    /// # Shapes
    /// - x: `[d0, d1, d2, d3]` → `[d0, d2, d1, d3]`
    fn swap_middle_dims(x: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_swap_dims(x, 1, 2)
    }
}

/// `x` with dimensions 1 and 2 swapped, in the layout the backend reads fastest: attention's
/// `[batch, seq, heads, head_dim] ↔ [batch, heads, seq, head_dim]`.
///
/// # Shapes
/// - x: `[d0, d1, d2, d3]` → `[d0, d2, d1, d3]`
pub fn swap_dims_contiguous<B: LayoutKernels>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::swap_middle_dims(
        x.into_primitive().tensor(),
    )))
}

#[cfg(feature = "flex")]
impl LayoutKernels for burn::backend::Flex {
    /// Contiguous, in runs of the last dimension over the pool (`layout/flex_layout.rs`).
    fn swap_middle_dims(x: FloatTensor<Self>) -> FloatTensor<Self> {
        flex_layout::swap_middle_dims(x)
    }
}

/// The node of a swap: its backward swaps the gradient back with the same op.
#[derive(Debug)]
struct SwapBackward;

impl<B: LayoutKernels> Backward<B, 1> for SwapBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, B::swap_middle_dims(grad));
        }
    }
}

impl<B: LayoutKernels, C: CheckpointStrategy> LayoutKernels for Autodiff<B, C> {
    /// The inner backend's swap, recorded as one node whose backward is the inner swap of the
    /// gradient (burn's `swap_dims` node would hand back a strided view for the next op to copy).
    fn swap_middle_dims(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let out = B::swap_middle_dims(x.primitive.clone());
        match SwapBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }
}

#[cfg(feature = "cubecl")]
impl<R, F, I, BT> LayoutKernels for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    R::Server: burn_cubecl::cubecl::server::ComputeServer,
    R::Device: burn::tensor::backend::DeviceOps,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    /// Contiguous, in one copy kernel. cubek's matmul reads a swapped view only after copying
    /// it, once per product that reads it: attention's values and the gradient of its output
    /// are each read by two products in the backward, so a view cost a copy more each
    /// (the test Qwen3-MoE's fine-tuning step: 406 → 397 launches on WGPU).
    fn swap_middle_dims(x: FloatTensor<Self>) -> FloatTensor<Self> {
        use burn::tensor::ops::FloatTensorOps;
        burn_cubecl::kernel::into_contiguous(Self::float_swap_dims(x, 1, 2))
    }
}

// NdArray and fusion: burn's view (fusion's own kernels read strides as they are). The CubeCL
// backends and `Autodiff<B>` have their own (above).
default_kernel_impls!(@plain LayoutKernels);
