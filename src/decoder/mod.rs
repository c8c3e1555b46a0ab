//! Kernels of the decoder blocks around the MoE layer: RMSNorm, the rotary embedding (the
//! `rotate_half` form and Llama 4's pairs, and latent attention's queries), latent attention's
//! keys and values (`latent.rs`), attention's weights (the scaled, masked softmax over the keys,
//! with or without GPT-OSS's sinks) and the dense blocks' SwiGLU (`gated.rs`), which a model
//! built on the layer runs at every position of every step.
//!
//! Composed from burn's ops, each is six to ten ops, each op an allocation and a pass, on a
//! few hundred values per token: in a decode step of the 163 M Qwen3-MoE the norms and the
//! rotations were 2.9% of the step, nearly all of it per-op overhead (BENCHMARKS §13m). The
//! defaults here are those compositions, exactly as the models wrote them (and what
//! `Autodiff` records, with their gradients); Flex runs the norm and the rotation as one pass
//! over their rows (`decoder/flex.rs`), with the same operations per value. The CubeCL
//! backends run all three in one kernel each way, and `Autodiff` over them records each as one
//! node (`autodiff.rs`): in training, each op of a composition is a launch on a GPU backend
//! that does not fuse, forward and backward.

mod autodiff;
#[cfg(feature = "cubecl")]
mod cubecl;
#[cfg(feature = "cubecl")]
mod cubecl_gated;
#[cfg(feature = "cubecl")]
mod cubecl_latent;
#[cfg(all(test, feature = "wgpu"))]
mod cubecl_latent_tests;
#[cfg(feature = "cubecl")]
mod cubecl_norm;
#[cfg(feature = "cubecl")]
mod cubecl_rotary;
#[cfg(feature = "cubecl")]
mod cubecl_softmax;
#[cfg(all(test, feature = "wgpu"))]
mod cubecl_tests;
#[cfg(feature = "flex")]
mod flex;
#[cfg(feature = "fusion")]
mod fusion;
mod gated;
mod latent;
mod rotary;
mod softmax;
#[cfg(all(test, feature = "flex"))]
mod tests;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};

pub use gated::{gated_silu, gated_silu_of};
#[cfg(any(feature = "cubecl", feature = "testkit"))]
pub(crate) use gated::{gated_silu_pair_backward_composed, gated_silu_pair_composed};
#[cfg(any(feature = "cubecl", feature = "testkit"))]
pub(crate) use latent::{latent_keys_backward_composed, latent_values_backward_composed};
pub(crate) use latent::{latent_keys_composed, latent_values_composed};
pub use rotary::{rotate_half_rows, TailRotation};
pub(crate) use rotary::{
    rotate_half_seq_major_backward_composed, rotate_half_seq_major_composed,
    rotate_pairs_seq_major_backward_composed, rotate_pairs_seq_major_composed,
    rotate_tail_to_heads_backward_composed, rotate_tail_to_heads_composed, rotate_to_heads_composed,
};
#[cfg(feature = "testkit")]
pub(crate) use softmax::{
    attention_softmax_backward_composed, attention_softmax_composed,
    attention_softmax_sinks_backward_composed, attention_softmax_sinks_composed,
};

/// The decoder blocks' kernels, on the backend that runs them.
pub trait DecoderKernels: crate::experts::ActivationKernels {
    /// `weight · x / sqrt(mean(x²) + eps)` over each row (transformers' `*RMSNorm`), composed
    /// as `x · recip(sqrt(mean(x²) + eps)) · weight` from burn's ops by default.
    ///
    /// # Shapes
    /// - x: `[rows, width]`, weight: `[width]` → `[rows, width]`
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        rms_norm_composed::<Self>(x, weight, eps)
    }

    /// Whether `Autodiff` over this backend records [`rms_norm`](Self::rms_norm) as one node
    /// whose backward is [`rms_norm_backward`](Self::rms_norm_backward), rather than burn's
    /// ops one by one (seven forward, about a dozen backward, each a launch on a GPU backend
    /// that does not fuse). The backends with a kernel each way say yes; the others keep the
    /// composed graph, and their training is unchanged by this switch.
    fn rms_norm_node() -> bool {
        false
    }

    /// The gradients of [`rms_norm`](Self::rms_norm) from the output's, with
    /// `r = 1 / sqrt(mean(x²) + eps)` per row and `u = grad · weight`:
    /// `dx = r · u − r³ · x · mean(u · x)` per row, and `d weight = Σ_rows grad · x · r` where
    /// `weight_grad` asks for it (`None` otherwise: a frozen weight's, under adapters, or Llama
    /// 4's constant one, costs no pass over the rows).
    ///
    /// # Shapes
    /// - x, grad: `[rows, width]`, weight: `[width]` → (`[rows, width]`, `[width]`)
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
        weight_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        rms_norm_backward_composed::<Self>(x, weight, grad, eps, weight_grad)
    }

    /// The norm ([`rms_norm`](Self::rms_norm)) of each row's first `width` values of a wider
    /// `x`, `width` the weight's (DeepSeek's latent, the front of its compression). By default
    /// the backend's norm of a slice of them.
    ///
    /// # Shapes
    /// - x: `[rows, total]`, weight: `[width]`, `width ≤ total` → `[rows, width]`
    fn rms_norm_columns(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        rms_norm_columns_sliced::<Self>(x, weight, eps)
    }

    /// The gradients of [`rms_norm_columns`](Self::rms_norm_columns): `x`'s over its whole
    /// width, zero after the first `width` values of each row, and the weight's as
    /// [`rms_norm_backward`](Self::rms_norm_backward) makes it. By default that backward of
    /// the slice, joined with zeros.
    ///
    /// # Shapes
    /// - x: `[rows, total]`, weight: `[width]`, grad: `[rows, width]` → (`[rows, total]`,
    ///   `[width]`)
    fn rms_norm_columns_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
        weight_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        rms_norm_columns_backward_sliced::<Self>(x, weight, grad, eps, weight_grad)
    }

    /// `x · cos + rotate_half(x) · sin` for every head of every position, the heads
    /// consecutive (`rotate_half(v) = [−v[d/2..] | v[..d/2]]` per head of `head_dim` values),
    /// each position's tables shared by its heads, and by every batch row where the tables
    /// have one row. By default composed as the models wrote it: the tables repeated over the
    /// heads, `rotate_half` one product with the signed permutation `[[0, I], [−I, 0]]` (exact:
    /// each output one input times ±1), then the products and the sum.
    ///
    /// # Shapes
    /// - x: `[batch, seq, heads, head_dim]`
    /// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch` → `[batch, seq, heads, head_dim]`
    fn rotate_half_seq_major(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rotate_half_seq_major_composed::<Self>(x, cos, sin)
    }

    /// Whether `Autodiff` over this backend records
    /// [`rotate_half_seq_major`](Self::rotate_half_seq_major) as one node whose backward is
    /// [`rotate_half_seq_major_backward`](Self::rotate_half_seq_major_backward), the tables
    /// constants (as the rotary tables are: computed from positions), rather than burn's ops
    /// one by one. As [`rms_norm_node`](Self::rms_norm_node): the backends with a kernel each
    /// way say yes.
    fn rotary_node() -> bool {
        false
    }

    /// `x`'s gradient of [`rotate_half_seq_major`](Self::rotate_half_seq_major) from the
    /// output's: the transpose of the rotation, `grad · cos − rotate_half(grad · sin)` (the
    /// signed permutation's transpose is its negation), per head as the forward.
    ///
    /// # Shapes
    /// - grad: `[batch, seq, heads, head_dim]`
    /// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch` → `[batch, seq, heads, head_dim]`
    fn rotate_half_seq_major_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rotate_half_seq_major_backward_composed::<Self>(grad, cos, sin)
    }

    /// Llama 4's rotation, `x`'s values of each head taken as pairs `(re, im)` and each pair
    /// rotated by its position's angle in place: `(re · cos − im · sin, re · sin + im · cos)`,
    /// the angles the tables' first half (`cat(freqs, freqs)`). By default composed as the
    /// models wrote it (`decoder/rotary.rs`). Recorded as one node under `Autodiff` where
    /// [`rotary_node`](Self::rotary_node) says so, as the `rotate_half` form is.
    ///
    /// # Shapes
    /// - x: `[batch, seq, heads, head_dim]`
    /// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch` → `[batch, seq, heads, head_dim]`
    fn rotate_pairs_seq_major(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rotate_pairs_seq_major_composed::<Self>(x, cos, sin)
    }

    /// `x`'s gradient of [`rotate_pairs_seq_major`](Self::rotate_pairs_seq_major) from the
    /// output's: each pair rotated by the opposite angle.
    ///
    /// # Shapes
    /// - grad: `[batch, seq, heads, head_dim]`
    /// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch` → `[batch, seq, heads, head_dim]`
    fn rotate_pairs_seq_major_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rotate_pairs_seq_major_backward_composed::<Self>(grad, cos, sin)
    }

    /// SwiGLU of a dense block (a dense layer's MLP, the shared expert), `silu(gate) · up` of
    /// `z = [gate | up]` (`gated.rs`): the experts' op ([`ActivationKernels::swiglu`](crate::experts::ActivationKernels::swiglu):
    /// one kernel on CubeCL, one pass on every core on Flex, burn's ops elsewhere).
    ///
    /// # Shapes
    /// - z: `[rows, 2 · d_hidden]` → `[rows, d_hidden]`
    fn gated_silu(z: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::swiglu(z)
    }

    /// Whether `Autodiff` over this backend records [`gated_silu`](Self::gated_silu) as one
    /// node whose backward is [`gated_silu_backward`](Self::gated_silu_backward), rather than
    /// burn's ops one by one. As [`rms_norm_node`](Self::rms_norm_node): the backends with a
    /// kernel each way say yes.
    fn gated_silu_node() -> bool {
        false
    }

    /// Whether [`gated_silu_of`] should join two halves given apart (one copy) to run
    /// [`gated_silu`](Self::gated_silu) on them, rather than burn's `silu(gate) · up`: yes where
    /// the op is one kernel and burn's ops would be several launches (the raw CubeCL backends;
    /// Flex, whose element-wise ops run on one thread); no under fusion, which fuses burn's
    /// product of the halves into one kernel already, and on NdArray.
    fn gated_silu_joins() -> bool {
        false
    }

    /// `z`'s gradient of [`gated_silu`](Self::gated_silu) from the output's, `[d gate | d up]`:
    /// `d up = grad · silu(gate)`, `d gate = grad · up · σ(gate) · (1 + gate · (1 − σ(gate)))`.
    ///
    /// # Shapes
    /// - z: `[rows, 2 · d_hidden]`, grad: `[rows, d_hidden]` → `[rows, 2 · d_hidden]`
    fn gated_silu_backward(z: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::swiglu_backward(z, grad)
    }

    /// Whether [`gated_silu_of`] runs two halves given apart as one op,
    /// [`gated_silu_pair`](Self::gated_silu_pair), which `Autodiff` then records as one node
    /// over both: the backends with a kernel each way say yes (the raw CubeCL backends), where
    /// joining the halves would be a concatenation forward and two copies backward.
    fn gated_silu_pair_node() -> bool {
        false
    }

    /// SwiGLU of two halves given apart, `silu(gate) · up` (a dense block's two projections).
    /// By default burn's ops.
    ///
    /// # Shapes
    /// - gate, up: `[.., d_hidden]` → the same
    fn gated_silu_pair(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        gated::gated_silu_pair_composed::<Self>(gate, up)
    }

    /// Both halves' gradients of [`gated_silu_pair`](Self::gated_silu_pair) from the
    /// output's: `(d gate, d up)`, as [`gated_silu_backward`](Self::gated_silu_backward)
    /// makes them.
    ///
    /// # Shapes
    /// - gate, up, grad: `[.., d_hidden]` → two of the same
    fn gated_silu_pair_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        gated::gated_silu_pair_backward_composed::<Self>(gate, up, grad)
    }

    /// The rotation, [`rotate_half_seq_major`](Self::rotate_half_seq_major)'s or (`pairs`)
    /// [`rotate_pairs_seq_major`](Self::rotate_pairs_seq_major)'s, with its output head-major,
    /// as attention's products read the queries and the keys. By default the rotation and
    /// burn's `swap_dims` (a view, which a product then copies where it needs to). Recorded as
    /// one node under `Autodiff` where [`rotary_node`](Self::rotary_node) says so, whose
    /// backward is the rotation's transpose of the gradient seen sequence-major (a view): the
    /// CubeCL kernel writes the head-major output and reads that view where they lie, so the
    /// swap's copy each way is gone.
    ///
    /// # Shapes
    /// - x: `[batch, seq, heads, head_dim]`
    /// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch` → `[batch, heads, seq, head_dim]`
    fn rotate_seq_major_to_heads(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        pairs: bool,
    ) -> FloatTensor<Self> {
        let rotated = match pairs {
            true => Self::rotate_pairs_seq_major(x, cos, sin),
            false => Self::rotate_half_seq_major(x, cos, sin),
        };
        Self::float_swap_dims(rotated, 1, 2)
    }

    /// Latent attention's rotations (DeepSeek-V2 / V3): after the first `form.skip` values of
    /// each head (left out: the keys' rotary part read where it lies after the latent), the
    /// next `form.pass` (the query's part without rotary embedding) as they are and the rest
    /// rotated, in the `rotate_half` form or (`form.interleaved`) DeepSeek's, whose pairs
    /// `(x0, x1), (x2, x3), ...` are each rotated by one angle (the tables' first half) and
    /// written as `[first values | second values]` (transformers'
    /// `apply_rotary_pos_emb_interleave`), the output head-major as attention's products read
    /// it. By default composed from slices, the rotation, a concatenation and burn's swap
    /// (`decoder/rotary.rs`). Recorded as one node under `Autodiff` where
    /// [`rotary_node`](Self::rotary_node) says so, whose backward is
    /// [`rotate_tail_to_heads_backward`](Self::rotate_tail_to_heads_backward).
    ///
    /// # Shapes
    /// - x: `[batch, seq, heads, skip + pass + rotated]`
    /// - cos, sin: `[rows, seq, rotated]`, `rows` 1 or `batch` →
    ///   `[batch, heads, seq, pass + rotated]`
    fn rotate_tail_to_heads(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        form: TailRotation,
    ) -> FloatTensor<Self> {
        rotate_tail_to_heads_composed::<Self>(x, cos, sin, form)
    }

    /// `x`'s gradient of [`rotate_tail_to_heads`](Self::rotate_tail_to_heads) from the
    /// output's: zero in the `skip` values left out, the next `pass` as they are, the rest
    /// through the rotation's transpose, sequence-major.
    ///
    /// # Shapes
    /// - grad: `[batch, heads, seq, pass + rotated]`
    /// - cos, sin: `[rows, seq, rotated]`, `rows` 1 or `batch` →
    ///   `[batch, seq, heads, skip + pass + rotated]`
    fn rotate_tail_to_heads_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        form: TailRotation,
    ) -> FloatTensor<Self> {
        rotate_tail_to_heads_backward_composed::<Self>(grad, cos, sin, form)
    }

    /// Whether latent attention's keys and values are one op each way
    /// ([`latent_keys`](Self::latent_keys), [`latent_values`](Self::latent_values)), which
    /// `Autodiff` then records as one node each: the backends with a kernel each way say yes.
    /// Elsewhere the model keeps its composition (one swap of the expanded product and views
    /// of it), whose defaults here would move more.
    fn latent_node() -> bool {
        false
    }

    /// Latent attention's keys: each head's first `nope` values of the expanded product `kv`
    /// (each head's `[k_nope | v]`), then the rotary key every head shares, head-major. By
    /// default composed from a slice, burn's swap, a repeat and a concatenation
    /// (`decoder/latent.rs`).
    ///
    /// # Shapes
    /// - kv: `[batch, seq, heads, nope + v]`; k_rot: `[batch, 1, seq, rope]` →
    ///   `[batch, heads, seq, nope + rope]`
    fn latent_keys(kv: FloatTensor<Self>, k_rot: FloatTensor<Self>, nope: usize) -> FloatTensor<Self> {
        latent::latent_keys_composed::<Self>(kv, k_rot, nope)
    }

    /// The gradients of [`latent_keys`](Self::latent_keys)' inputs from the keys': `kv`'s
    /// (zero where the values are, `v` of them a head) and the rotary key's (summed over the
    /// heads).
    ///
    /// # Shapes
    /// - grad: `[batch, heads, seq, nope + rope]` → (`[batch, seq, heads, nope + v]`,
    ///   `[batch, 1, seq, rope]`)
    fn latent_keys_backward(
        grad: FloatTensor<Self>,
        nope: usize,
        v: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        latent::latent_keys_backward_composed::<Self>(grad, nope, v)
    }

    /// Latent attention's values: each head's values of the expanded product `kv`, after its
    /// first `nope`, head-major. By default a slice and burn's swap (a view).
    ///
    /// # Shapes
    /// - kv: `[batch, seq, heads, nope + v]` → `[batch, heads, seq, v]`
    fn latent_values(kv: FloatTensor<Self>, nope: usize) -> FloatTensor<Self> {
        latent::latent_values_composed::<Self>(kv, nope)
    }

    /// `kv`'s gradient of [`latent_values`](Self::latent_values) from the values': zero where
    /// `k_nope` is.
    ///
    /// # Shapes
    /// - grad: `[batch, heads, seq, v]` → `[batch, seq, heads, nope + v]`
    fn latent_values_backward(grad: FloatTensor<Self>, nope: usize) -> FloatTensor<Self> {
        latent::latent_values_backward_composed::<Self>(grad, nope)
    }

    /// Attention's weights: the softmax over the keys of `scores · scale`, the keys `hidden`
    /// marks at `-inf` (each batch row's mask shared by its heads, and by every batch row where
    /// the mask has one row). By default composed as attention wrote it before: the product by
    /// the scale, burn's `mask_fill` and burn's softmax (`decoder/softmax.rs`).
    ///
    /// # Shapes
    /// - scores: `[batch, heads, seq, keys]`
    /// - hidden: `[rows, seq, keys]`, `rows` 1 or `batch` → `[batch, heads, seq, keys]`
    fn attention_softmax(
        scores: FloatTensor<Self>,
        hidden: Option<BoolTensor<Self>>,
        scale: f64,
    ) -> FloatTensor<Self> {
        softmax::attention_softmax_composed::<Self>(scores, hidden, scale)
    }

    /// Whether `Autodiff` over this backend records
    /// [`attention_softmax`](Self::attention_softmax) as one node whose backward is
    /// [`attention_softmax_backward`](Self::attention_softmax_backward), rather than burn's
    /// ops one by one (seven forward and about fifteen backward a layer, each a launch on a
    /// GPU backend that does not fuse). As [`rms_norm_node`](Self::rms_norm_node): the
    /// backends with a kernel each way say yes.
    fn attention_softmax_node() -> bool {
        false
    }

    /// The scores' gradient from the weights `probs` and their gradient `grad`:
    /// `scale · probs · (grad − Σ_keys grad · probs)` over each row. A hidden key's weight is
    /// 0, so its gradient is too, as `mask_fill`'s backward gives it.
    ///
    /// # Shapes
    /// - probs, grad: `[batch, heads, seq, keys]` → `[batch, heads, seq, keys]`
    fn attention_softmax_backward(
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        softmax::attention_softmax_backward_composed::<Self>(probs, grad, scale)
    }

    /// Attention's weights with a learned sink logit per head (GPT-OSS): the softmax over the
    /// keys of `scores · scale` (the keys `hidden` marks left out, as in
    /// [`attention_softmax`](Self::attention_softmax)) and one more column, the head's sink
    /// (not scaled), whose share is then dropped, so each row sums to `1 − p_sink`. Returns
    /// the weights and each row's `p_sink`, which the backward needs for the sinks' gradient
    /// (under `Autodiff`'s node it carries no gradient of its own). By default composed as
    /// GPT-OSS's attention wrote it before (`decoder/softmax.rs`); recorded as one node under
    /// `Autodiff` where [`attention_softmax_node`](Self::attention_softmax_node) says so.
    ///
    /// # Shapes
    /// - scores: `[batch, heads, seq, keys]`; sinks: `[heads]`
    /// - hidden: `[rows, seq, keys]`, `rows` 1 or `batch`
    /// - returns `[batch, heads, seq, keys]` and `[batch, heads, seq]`
    fn attention_softmax_sinks(
        scores: FloatTensor<Self>,
        hidden: Option<BoolTensor<Self>>,
        sinks: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        softmax::attention_softmax_sinks_composed::<Self>(scores, hidden, sinks, scale)
    }

    /// The gradients of [`attention_softmax_sinks`](Self::attention_softmax_sinks) from the
    /// weights `probs`, the sinks' shares `sink_probs` and the weights' gradient `grad`: the
    /// scores' is [`attention_softmax_backward`](Self::attention_softmax_backward)'s (the
    /// dropped column's gradient is 0, so each row's `Σ grad · probs` runs over the keys
    /// alone), sink `h`'s `−Σ_{batch, seq} p_sink · Σ_keys grad · probs`.
    ///
    /// # Shapes
    /// - probs, grad: `[batch, heads, seq, keys]`; sink_probs: `[batch, heads, seq]`
    /// - returns `[batch, heads, seq, keys]` and `[heads]`
    fn attention_softmax_sinks_backward(
        probs: FloatTensor<Self>,
        sink_probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        softmax::attention_softmax_sinks_backward_composed::<Self>(probs, sink_probs, grad, scale)
    }
}

/// [`DecoderKernels::rms_norm`]'s default: burn's ops.
pub(crate) fn rms_norm_composed<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    eps: f64,
) -> FloatTensor<B> {
    let x = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x));
    let weight = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(weight));
    let width = weight.dims()[0];
    let mean_square = x.clone().powi_scalar(2).mean_dim(1);
    let normalised = x * (mean_square + eps).sqrt().recip();
    (normalised * weight.reshape([1, width]))
        .into_primitive()
        .tensor()
}

/// [`DecoderKernels::rms_norm_backward`]'s default: burn's ops.
/// [`DecoderKernels::rms_norm_columns`]'s default: the backend's norm of a slice of `x`.
pub(crate) fn rms_norm_columns_sliced<B: DecoderKernels>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    eps: f64,
) -> FloatTensor<B> {
    let front = front_columns::<B>(x, &weight);
    B::rms_norm(front, weight, eps)
}

/// [`DecoderKernels::rms_norm_columns_backward`]'s default: the backend's norm backward of
/// the slice, joined with zeros.
pub(crate) fn rms_norm_columns_backward_sliced<B: DecoderKernels>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    eps: f64,
    weight_grad: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let total = x.shape()[1];
    let front = front_columns::<B>(x, &weight);
    let (dx, dweight) = B::rms_norm_backward(front, weight, grad, eps, weight_grad);
    (pad_columns::<B>(dx, total), dweight)
}

/// `x` `[rows, total]`'s first `weight`-width columns (burn's slice).
fn front_columns<B: Backend>(x: FloatTensor<B>, weight: &FloatTensor<B>) -> FloatTensor<B> {
    let (rows, width) = (x.shape()[0], weight.shape()[0]);
    B::float_slice(x, &[(0..rows).into(), (0..width).into()])
}

/// `dx` `[rows, width]` joined with zeros to `[rows, total]`.
fn pad_columns<B: Backend>(dx: FloatTensor<B>, total: usize) -> FloatTensor<B> {
    let [rows, width] = [dx.shape()[0], dx.shape()[1]];
    if width == total {
        return dx;
    }
    let zeros = B::float_zeros(
        [rows, total - width].into(),
        &B::float_device(&dx),
        dx.dtype().into(),
    );
    B::float_cat(vec![dx, zeros], 1)
}

pub(crate) fn rms_norm_backward_composed<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    eps: f64,
    weight_grad: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let x = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x));
    let grad = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(grad));
    let weight = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(weight));
    let width = weight.dims()[0];
    let r = (x.clone().powi_scalar(2).mean_dim(1) + eps).sqrt().recip();
    let u = grad.clone() * weight.reshape([1, width]);
    let mean_ux = (u.clone() * x.clone()).mean_dim(1);
    let dx = u * r.clone() - x.clone() * (r.clone().powi_scalar(3) * mean_ux);
    let dweight = weight_grad.then(|| {
        (grad * x * r)
            .sum_dim(0)
            .reshape([width])
            .into_primitive()
            .tensor()
    });
    (dx.into_primitive().tensor(), dweight)
}

#[cfg(feature = "flex")]
impl DecoderKernels for burn::backend::Flex {
    /// One pass over the rows (`decoder/flex.rs`).
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        flex::rms_norm(x, weight, eps)
    }

    /// Yes: Flex's element-wise ops run on one thread, and the composed derivative is about
    /// fifteen of them; the node's backward is the experts' one pass over every core.
    fn gated_silu_node() -> bool {
        true
    }

    fn gated_silu_joins() -> bool {
        true
    }

    /// One pass over the positions and heads (`decoder/flex.rs`).
    fn rotate_half_seq_major(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        flex::rotate_half_seq_major(x, cos, sin)
    }
}

// NdArray: the composed forms. The CubeCL backends run the norm, the rotation and attention's
// weights in one kernel each way (`cubecl_norm.rs`, `cubecl_rotary.rs`, `cubecl_softmax.rs`),
// fusion the inner backend's (`fusion.rs`), and autodiff records each as one node where the
// inner backend says so (`autodiff.rs`).
default_kernel_impls!(@ndarray DecoderKernels);
