//! Attention's weights composed from burn's ops: the defaults of
//! [`DecoderKernels::attention_softmax`](super::DecoderKernels::attention_softmax), of its form
//! with sinks ([`DecoderKernels::attention_softmax_sinks`](super::DecoderKernels::attention_softmax_sinks))
//! and of their backwards, and the twins the CubeCL kernels (`cubecl_softmax.rs`) are held to.
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
    scores_gradient(probs, grad, scale).0.into_primitive().tensor()
}

/// The scores' gradient `scale · probs · (grad − dot)` and each row's `dot = Σ_keys grad ·
/// probs` (`[batch, heads, seq, 1]`), which the sinks' gradient reads too.
fn scores_gradient<B: Backend>(
    probs: Tensor<B, 4>,
    grad: Tensor<B, 4>,
    scale: f64,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    let dot = (grad.clone() * probs.clone()).sum_dim(3);
    ((grad - dot.clone()) * probs * scale, dot)
}

/// Attention's weights with a sink logit per head (GPT-OSS), as its attention wrote them: the
/// scaled, masked scores and the head's sink (not scaled) as one more column, burn's softmax
/// over the keys and that column, the column dropped. Returns the weights and the column's
/// share of each row, `p_sink`.
///
/// # Shapes
/// - scores: `[batch, heads, seq, keys]`, hidden: `[1 or batch, seq, keys]`, sinks: `[heads]`
/// - returns `[batch, heads, seq, keys]` and `[batch, heads, seq]`
pub(crate) fn attention_softmax_sinks_composed<B: Backend>(
    scores: FloatTensor<B>,
    hidden: Option<BoolTensor<B>>,
    sinks: FloatTensor<B>,
    scale: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let scores = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(scores)) * scale;
    let [b, h, t, s] = scores.dims();
    let scores = match hidden {
        Some(hidden) => {
            let hidden = Tensor::<B, 3, Bool>::from_primitive(hidden);
            scores.mask_fill(
                hidden.unsqueeze_dim::<4>(1).expand([b, h, t, s]),
                f32::NEG_INFINITY,
            )
        }
        None => scores,
    };
    let sinks = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(sinks));
    let column = sinks.reshape([1, h, 1, 1]).expand([b, h, t, 1]);
    let all = activation::softmax(Tensor::cat(vec![scores, column], 3), 3);
    let probs = all.clone().slice([0..b, 0..h, 0..t, 0..s]);
    let sink_probs = all.slice([0..b, 0..h, 0..t, s..s + 1]).reshape([b, h, t]);
    (
        probs.into_primitive().tensor(),
        sink_probs.into_primitive().tensor(),
    )
}

/// The gradients of [`attention_softmax_sinks_composed`]: the scores' as without sinks (the
/// dropped column's gradient is 0, so each row's `Σ grad · probs` runs over the keys alone),
/// and sink `h`'s, `−Σ_{batch, seq} p_sink · Σ_keys grad · probs` (the softmax's backward at
/// the sink's column, where the gradient is 0).
///
/// # Shapes
/// - probs, grad: `[batch, heads, seq, keys]`, sink_probs: `[batch, heads, seq]`
/// - returns `[batch, heads, seq, keys]` and `[heads]`
pub(crate) fn attention_softmax_sinks_backward_composed<B: Backend>(
    probs: FloatTensor<B>,
    sink_probs: FloatTensor<B>,
    grad: FloatTensor<B>,
    scale: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let probs = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(probs));
    let grad = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(grad));
    let [b, h, t, _] = probs.dims();
    let (dscores, dot) = scores_gradient(probs, grad, scale);
    let sink_probs = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(sink_probs)).reshape([b, h, t, 1]);
    let dsinks = (sink_probs * dot).sum_dim(2).sum_dim(0).neg().reshape([h]);
    (
        dscores.into_primitive().tensor(),
        dsinks.into_primitive().tensor(),
    )
}
