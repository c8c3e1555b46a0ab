//! The decoder blocks' ops on the CubeCL backends (CUDA, ROCm, WGPU): one kernel each way for
//! the norm (`cubecl_norm.rs`), the rotations (`cubecl_rotary.rs`), latent attention's keys and
//! values (`cubecl_latent.rs`) and attention's weights with or without sinks
//! (`cubecl_softmax.rs`), and the dense blocks' SwiGLU (the experts' kernels, through
//! `ActivationKernels`); the composed defaults for what a kernel does not read (another layout
//! or dtype, nothing hidden), and `*_node` saying yes, so that `Autodiff` over these backends
//! records each op as one node.

use burn::tensor::ops::{BoolTensor, FloatTensor};

use super::{
    cubecl_gated, cubecl_latent, cubecl_norm, cubecl_rotary, cubecl_softmax, softmax, DecoderKernels,
    TailRotation,
};

impl<R, F, I, BT> DecoderKernels for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    R::Server: burn_cubecl::cubecl::server::ComputeServer,
    R::Device: burn::tensor::backend::DeviceOps,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        cubecl_norm::rms_norm(&x, &weight, eps)
            .unwrap_or_else(|| super::rms_norm_composed::<Self>(x, weight, eps))
    }

    fn rms_norm_node() -> bool {
        true
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
        weight_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        match cubecl_norm::rms_norm_backward(&x, &weight, &grad, eps, weight_grad) {
            // The weight's gradient is the column sums of the kernel's `grad · x · r`.
            Some((dx, scaled)) => (dx, scaled.map(cubecl_norm::column_sums::<Self>)),
            None => super::rms_norm_backward_composed::<Self>(x, weight, grad, eps, weight_grad),
        }
    }

    fn rms_norm_columns(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        cubecl_norm::rms_norm_columns(&x, &weight, eps)
            .unwrap_or_else(|| super::rms_norm_columns_sliced::<Self>(x, weight, eps))
    }

    fn rms_norm_columns_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
        weight_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        match cubecl_norm::rms_norm_columns_backward(&x, &weight, &grad, eps, weight_grad) {
            Some((dx, scaled)) => (dx, scaled.map(cubecl_norm::column_sums::<Self>)),
            None => super::rms_norm_columns_backward_sliced::<Self>(x, weight, grad, eps, weight_grad),
        }
    }

    fn rotate_half_seq_major(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        cubecl_rotary::rotate_half(&x, &cos, &sin, false)
            .unwrap_or_else(|| super::rotate_half_seq_major_composed::<Self>(x, cos, sin))
    }

    fn rotary_node() -> bool {
        true
    }

    fn rotate_half_seq_major_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        cubecl_rotary::rotate_half(&grad, &cos, &sin, true)
            .unwrap_or_else(|| super::rotate_half_seq_major_backward_composed::<Self>(grad, cos, sin))
    }

    fn rotate_seq_major_to_heads(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        pairs: bool,
    ) -> FloatTensor<Self> {
        cubecl_rotary::rotate_to_heads(&x, &cos, &sin, pairs)
            .unwrap_or_else(|| super::rotate_to_heads_composed::<Self>(x, cos, sin, pairs))
    }

    fn rotate_tail_to_heads(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        form: TailRotation,
    ) -> FloatTensor<Self> {
        cubecl_rotary::rotate_tail_to_heads(&x, &cos, &sin, form)
            .unwrap_or_else(|| super::rotate_tail_to_heads_composed::<Self>(x, cos, sin, form))
    }

    fn rotate_tail_to_heads_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        form: TailRotation,
    ) -> FloatTensor<Self> {
        cubecl_rotary::rotate_tail_to_heads_backward(&grad, &cos, &sin, form)
            .unwrap_or_else(|| super::rotate_tail_to_heads_backward_composed::<Self>(grad, cos, sin, form))
    }

    fn latent_node() -> bool {
        true
    }

    fn latent_keys(kv: FloatTensor<Self>, k_rot: FloatTensor<Self>, nope: usize) -> FloatTensor<Self> {
        cubecl_latent::keys(&kv, &k_rot, nope)
            .unwrap_or_else(|| super::latent_keys_composed::<Self>(kv, k_rot, nope))
    }

    fn latent_keys_backward(
        grad: FloatTensor<Self>,
        nope: usize,
        v: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        cubecl_latent::keys_backward(&grad, nope, v)
            .unwrap_or_else(|| super::latent_keys_backward_composed::<Self>(grad, nope, v))
    }

    fn latent_values(kv: FloatTensor<Self>, nope: usize) -> FloatTensor<Self> {
        cubecl_latent::values(&kv, nope).unwrap_or_else(|| super::latent_values_composed::<Self>(kv, nope))
    }

    fn latent_values_backward(grad: FloatTensor<Self>, nope: usize) -> FloatTensor<Self> {
        cubecl_latent::values_backward(&grad, nope)
            .unwrap_or_else(|| super::latent_values_backward_composed::<Self>(grad, nope))
    }

    fn rotate_pairs_seq_major(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        cubecl_rotary::rotate_pairs(&x, &cos, &sin, false)
            .unwrap_or_else(|| super::rotate_pairs_seq_major_composed::<Self>(x, cos, sin))
    }

    fn rotate_pairs_seq_major_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        cubecl_rotary::rotate_pairs(&grad, &cos, &sin, true)
            .unwrap_or_else(|| super::rotate_pairs_seq_major_backward_composed::<Self>(grad, cos, sin))
    }

    fn gated_silu_node() -> bool {
        true
    }

    fn gated_silu_joins() -> bool {
        true
    }

    fn gated_silu_pair_node() -> bool {
        true
    }

    fn gated_silu_pair(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        cubecl_gated::gated_silu_pair(&gate, &up)
            .unwrap_or_else(|| super::gated_silu_pair_composed::<Self>(gate, up))
    }

    fn gated_silu_pair_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        cubecl_gated::gated_silu_pair_backward(&gate, &up, &grad)
            .unwrap_or_else(|| super::gated_silu_pair_backward_composed::<Self>(gate, up, grad))
    }

    fn attention_softmax(
        scores: FloatTensor<Self>,
        hidden: Option<BoolTensor<Self>>,
        scale: f64,
    ) -> FloatTensor<Self> {
        match hidden {
            Some(mask) => match cubecl_softmax::attention_softmax(&scores, &mask, scale) {
                Some(probs) => probs,
                None => softmax::attention_softmax_composed::<Self>(scores, Some(mask), scale),
            },
            // Nothing hidden: a decode step's one query, no training step (whose causal mask
            // always hides something), so burn's softmax is left to it.
            None => softmax::attention_softmax_composed::<Self>(scores, None, scale),
        }
    }

    fn attention_softmax_node() -> bool {
        true
    }

    fn attention_softmax_backward(
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        cubecl_softmax::attention_softmax_backward(&probs, &grad, scale)
            .unwrap_or_else(|| softmax::attention_softmax_backward_composed::<Self>(probs, grad, scale))
    }

    fn attention_softmax_sinks(
        scores: FloatTensor<Self>,
        hidden: Option<BoolTensor<Self>>,
        sinks: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match hidden {
            Some(mask) => match cubecl_softmax::attention_softmax_sinks(&scores, &mask, &sinks, scale) {
                Some(both) => both,
                None => softmax::attention_softmax_sinks_composed::<Self>(scores, Some(mask), sinks, scale),
            },
            // As without sinks: nothing hidden is a decode step's one query.
            None => softmax::attention_softmax_sinks_composed::<Self>(scores, None, sinks, scale),
        }
    }

    fn attention_softmax_sinks_backward(
        probs: FloatTensor<Self>,
        sink_probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match cubecl_softmax::attention_softmax_sinks_backward(&probs, &sink_probs, &grad, scale) {
            // Sink h's gradient is the sum of the kernel's row terms over the batch and the
            // sequence.
            Some((dscores, rows)) => (dscores, cubecl_softmax::per_head_sums::<Self>(rows)),
            None => {
                softmax::attention_softmax_sinks_backward_composed::<Self>(probs, sink_probs, grad, scale)
            }
        }
    }
}
