//! Attention's weights composed from burn's ops: the defaults of
//! [`DecoderKernels::attention_softmax`](super::DecoderKernels::attention_softmax) and its
//! backward, and the twins the CubeCL kernels (`cubecl_softmax.rs`) are held to.
//!
//! The forward is what attention ran before the op existed, op for op (the product by the
//! scale, `mask_fill` with `-inf`, burn's max-shifted softmax), so the CPU backends, which keep
//! it, compute and record exactly what they did.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{activation, Bool, Tensor, TensorPrimitive};

/// `softmax(mask_fill(scores · scale, hidden, -inf))` over the keys.
///
/// # Shapes
/// - scores: `[batch, heads, seq, keys]`, hidden: `[1 or batch, seq, keys]` → as scores
pub(crate) fn attention_softmax_composed<B: Backend>(
    scores: FloatTensor<B>,
    hidden: Option<BoolTensor<B>>,
    scale: f64,
) -> FloatTensor<B> {
    let scores = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(scores)) * scale;
    let shape = scores.dims();
    let scores = match hidden {
        Some(hidden) => {
            let hidden = Tensor::<B, 3, Bool>::from_primitive(hidden);
            scores.mask_fill(hidden.unsqueeze_dim::<4>(1).expand(shape), f32::NEG_INFINITY)
        }
        None => scores,
    };
    activation::softmax(scores, 3).into_primitive().tensor()
}

/// `scale · probs · (grad − Σ_keys grad · probs)`: the softmax's backward times the scale's.
///
/// # Shapes
/// - probs, grad: `[batch, heads, seq, keys]` → as probs
pub(crate) fn attention_softmax_backward_composed<B: Backend>(
    probs: FloatTensor<B>,
    grad: FloatTensor<B>,
    scale: f64,
) -> FloatTensor<B> {
    let probs = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(probs));
    let grad = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(grad));
    let dot = (grad.clone() * probs.clone()).sum_dim(3);
    ((grad - dot) * probs * scale).into_primitive().tensor()
}
