//! The dense blocks' SwiGLU, `silu(gate) · up` of `z = [gate | up]`: the MLP of a model's dense
//! layers and the MoE layer's shared expert, which run it on every token outside the exchange
//! (the routed experts run theirs inside it, on [`ActivationKernels`](crate::experts::ActivationKernels)).
//!
//! Composed from burn's ops, `silu` is seven ops forward and its product one more; under
//! `Autodiff` the backward records about fifteen, with the slices and the concatenation of the
//! two halves' gradients: each a launch on a GPU backend that does not fuse, every step, every
//! dense block; on Flex each runs on one thread. The CubeCL backends and Flex run it as the
//! experts' SwiGLU kernel each way, and `Autodiff` over them records it as one node
//! ([`DecoderKernels::gated_silu_node`]); given the two halves apart (a dense MLP's two
//! projections), the CubeCL backends run a kernel of the pair each way instead of joining them
//! (`cubecl_gated.rs`). NdArray keeps the composed graph, op for op what the blocks wrote
//! before.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
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

/// `silu(gate) · up` of two halves given apart: one op of the two where the backend has it
/// ([`DecoderKernels::gated_silu_pair_node`]: the CubeCL backends, a kernel each way),
/// [`gated_silu`] of their concatenation where the copy that joins them costs less than the
/// ops it saves ([`DecoderKernels::gated_silu_joins`]: Flex), burn's `silu(gate) · up`
/// elsewhere (the graph the dense blocks recorded before, unchanged on NdArray and under
/// fusion).
///
/// # Shapes
/// - gate, up: `[..., d_hidden]` → `[..., d_hidden]`
pub fn gated_silu_of<B: DecoderKernels, const D: usize>(
    gate: Tensor<B, D>,
    up: Tensor<B, D>,
) -> Tensor<B, D> {
    if B::gated_silu_pair_node() {
        let out = B::gated_silu_pair(gate.into_primitive().tensor(), up.into_primitive().tensor());
        return Tensor::from_primitive(TensorPrimitive::Float(out));
    }
    match B::gated_silu_joins() {
        true => gated_silu(Tensor::cat(vec![gate, up], D - 1)),
        false => burn::tensor::activation::silu(gate) * up,
    }
}

/// [`DecoderKernels::gated_silu_pair`]'s default: burn's `silu(gate) · up`.
pub(crate) fn gated_silu_pair_composed<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
) -> FloatTensor<B> {
    B::float_mul(B::float_mul(gate.clone(), B::sigmoid(gate)), up)
}

/// [`DecoderKernels::gated_silu_pair_backward`]'s default: `d up = grad · silu(gate)` and
/// `d gate = grad · up · σ(gate) · (1 + gate · (1 − σ(gate)))` from burn's ops, as the
/// experts' composed SwiGLU derivative makes them.
pub(crate) fn gated_silu_pair_backward_composed<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let sig = B::sigmoid(gate.clone());
    let d_up = B::float_mul(grad.clone(), B::float_mul(gate.clone(), sig.clone()));
    let one_minus = B::float_add_scalar(B::float_neg(sig.clone()), 1.0.into());
    let slope = B::float_add_scalar(B::float_mul(gate, one_minus), 1.0.into());
    let d_gate = B::float_mul(B::float_mul(grad, up), B::float_mul(sig, slope));
    (d_gate, d_up)
}

/// The node tests' comparison (`cubecl_tests.rs` on WGPU, `tests.rs` on Flex): `gated_silu_of`
/// on the halves apart and `gated_silu` on `[gate | up]` whole against burn's `silu(gate) · up`
/// recorded one by one under `A`, the output and both halves' gradients within `tolerance` of
/// the largest value of burn's, for a loss that weighs every output by `weights`.
#[cfg(all(test, any(feature = "flex", feature = "wgpu")))]
pub(super) fn assert_forms_agree<A>(
    gate: &Tensor<A, 3>,
    up: &Tensor<A, 3>,
    weights: &Tensor<A, 3>,
    tolerance: f32,
) where
    A: burn::tensor::backend::AutodiffBackend + DecoderKernels,
{
    use burn::tensor::activation::silu;
    // 0: burn's ops; 1: the halves apart; 2: `[gate | up]` whole.
    let run = |form: usize| {
        let (gate, up) = (gate.clone().require_grad(), up.clone().require_grad());
        let y = match form {
            0 => silu(gate.clone()) * up.clone(),
            1 => gated_silu_of(gate.clone(), up.clone()),
            _ => gated_silu(Tensor::cat(vec![gate.clone(), up.clone()], 2)),
        };
        let grads = (y.clone() * weights.clone()).sum().backward();
        let dgate = gate.grad(&grads).expect("the gate's gradient");
        let dup = up.grad(&grads).expect("the up half's gradient");
        [y.inner(), dgate, dup].map(|t| t.into_data().convert::<f32>().to_vec::<f32>().unwrap())
    };
    let want = run(0);
    for form in [1, 2] {
        for ((what, got), want) in ["output", "gate's gradient", "up's gradient"]
            .into_iter()
            .zip(run(form))
            .zip(&want)
        {
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(scale > 0.0, "{what}: burn's is all zeros");
            let worst = got
                .iter()
                .zip(want)
                .map(|(g, w)| (g - w).abs())
                .fold(0f32, f32::max);
            assert!(
                worst <= tolerance * scale,
                "{:?}, form {form}, {what}: off by {worst:e} of {scale:e}",
                gate.dims()
            );
        }
    }
}
