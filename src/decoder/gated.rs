//! The dense blocks' SwiGLU, `silu(gate) · up` of `z = [gate | up]`: the MLP of a model's dense
//! layers and the MoE layer's shared expert, which run it on every token outside the exchange
//! (the routed experts run theirs inside it, on [`ActivationKernels`](crate::ActivationKernels)).
//!
//! Composed from burn's ops, `silu` is seven ops forward and its product one more; under
//! `Autodiff` the backward records about fifteen, with the slices and the concatenation of the
//! two halves' gradients: each a launch on a GPU backend that does not fuse, every step, every
//! dense block; on Flex each runs on one thread. The CubeCL backends and Flex run it as the
//! experts' SwiGLU kernel each way, and `Autodiff` over them records it as one node
//! ([`DecoderKernels::gated_silu_node`]); NdArray keeps the composed graph, op for op what the
//! blocks wrote before.

use burn::tensor::{Tensor, TensorPrimitive};

use super::DecoderKernels;

/// `silu(gate) · up` of `z = [gate | up]` split along its last dimension, as one op where the
/// backend has a kernel each way ([`DecoderKernels::gated_silu`]), burn's ops elsewhere.
///
/// # Shapes
/// - z: `[..., 2 · d_hidden]` → `[..., d_hidden]`
///
/// # Panics
/// If `z`'s last dimension is odd: it is no `[gate | up]` pair (a contract violation of the
/// caller, which built `z`).
pub fn gated_silu<B: DecoderKernels, const D: usize>(z: Tensor<B, D>) -> Tensor<B, D> {
    let dims = z.dims();
    let inner = dims[D - 1];
    assert!(
        inner.is_multiple_of(2),
        "gated_silu: the last dimension of z ({inner}) is not a [gate | up] pair"
    );
    let rows = dims[..D - 1].iter().product::<usize>();
    let flat = z.reshape([rows, inner]).into_primitive().tensor();
    let mut out_dims = dims;
    out_dims[D - 1] = inner / 2;
    Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::gated_silu(flat))).reshape(out_dims)
}

/// `silu(gate) · up` of two halves given apart: [`gated_silu`] of their concatenation where
/// the copy that joins them costs less than the ops it saves
/// ([`DecoderKernels::gated_silu_joins`]), burn's `silu(gate) · up` elsewhere (the graph the
/// dense blocks recorded before, unchanged on NdArray and under fusion).
///
/// # Shapes
/// - gate, up: `[..., d_hidden]` → `[..., d_hidden]`
pub fn gated_silu_of<B: DecoderKernels, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
) -> Tensor<B, D> {
    match B::gated_silu_joins() {
        true => gated_silu(Tensor::cat(vec![gate, up], D - 1)),
        false => burn::tensor::activation::silu(gate) * up,
    }
}
