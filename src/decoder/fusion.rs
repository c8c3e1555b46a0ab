//! RMSNorm under burn's fusion (`Fusion<B>`): on the inner backend, as the router's ops are
//! (`router/fusion.rs`). Fusion fuses element-wise ops but not across the norm's row sum, so
//! each op resolves its inputs to the inner backend's tensors, runs the inner backend's kernel
//! and registers its output on the calling thread's stream; attention's weights likewise (the
//! softmax's row maximum and sum stop fusion too), and the rotary embedding, whose partner
//! reads across each head fusion's element-wise kernels do not make. The dense blocks' SwiGLU
//! too: fusion would fuse its composed element-wise ops, but its derivative's concatenation of
//! the two halves' gradients stops that, and the inner kernel is one pass each way.

use burn::tensor::ops::{BoolTensor, FloatTensor};
use burn_fusion::{Fusion, FusionBackend};

use super::{DecoderKernels, TailRotation};
use crate::exchange::fusion::{register, resolve};

/// A norm's gradients (`x`'s, and the weight's where asked) registered with fusion, as
/// [`register`] registers one tensor.
fn register_norm_grads<B: FusionBackend>(
    (dx, dweight): (FloatTensor<B>, Option<FloatTensor<B>>),
    device: &B::Device,
) -> (FloatTensor<Fusion<B>>, Option<FloatTensor<Fusion<B>>>) {
    (
        register::<B>(dx, device),
        dweight.map(|d| register::<B>(d, device)),
    )
}

impl<B: FusionBackend + DecoderKernels> DecoderKernels for Fusion<B> {
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        let device = x.client.device().clone();
        register::<B>(B::rms_norm(resolve::<B>(x), resolve::<B>(weight), eps), &device)
    }

    fn rms_norm_node() -> bool {
        B::rms_norm_node()
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
        weight_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let device = x.client.device().clone();
        let grads = B::rms_norm_backward(
            resolve::<B>(x),
            resolve::<B>(weight),
            resolve::<B>(grad),
            eps,
            weight_grad,
        );
        register_norm_grads::<B>(grads, &device)
    }

    fn rms_norm_columns(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        let device = x.client.device().clone();
        register::<B>(
            B::rms_norm_columns(resolve::<B>(x), resolve::<B>(weight), eps),
            &device,
        )
    }

    fn rms_norm_columns_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
        weight_grad: bool,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        let device = x.client.device().clone();
        let grads = B::rms_norm_columns_backward(
            resolve::<B>(x),
            resolve::<B>(weight),
            resolve::<B>(grad),
            eps,
            weight_grad,
        );
        register_norm_grads::<B>(grads, &device)
    }

    fn rotate_half_seq_major(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let device = x.client.device().clone();
        let out = B::rotate_half_seq_major(resolve::<B>(x), resolve::<B>(cos), resolve::<B>(sin));
        register::<B>(out, &device)
    }

    fn rotary_node() -> bool {
        B::rotary_node()
    }

    fn rotate_half_seq_major_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let device = grad.client.device().clone();
        let dx = B::rotate_half_seq_major_backward(resolve::<B>(grad), resolve::<B>(cos), resolve::<B>(sin));
        register::<B>(dx, &device)
    }

    fn rotate_seq_major_to_heads(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        pairs: bool,
    ) -> FloatTensor<Self> {
        let device = x.client.device().clone();
        let out = B::rotate_seq_major_to_heads(resolve::<B>(x), resolve::<B>(cos), resolve::<B>(sin), pairs);
        register::<B>(out, &device)
    }

    fn rotate_tail_to_heads(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        form: TailRotation,
    ) -> FloatTensor<Self> {
        let device = x.client.device().clone();
        let out = B::rotate_tail_to_heads(resolve::<B>(x), resolve::<B>(cos), resolve::<B>(sin), form);
        register::<B>(out, &device)
    }

    fn rotate_tail_to_heads_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        form: TailRotation,
    ) -> FloatTensor<Self> {
        let device = grad.client.device().clone();
        let dx =
            B::rotate_tail_to_heads_backward(resolve::<B>(grad), resolve::<B>(cos), resolve::<B>(sin), form);
        register::<B>(dx, &device)
    }

    fn latent_node() -> bool {
        B::latent_node()
    }

    fn latent_keys(kv: FloatTensor<Self>, k_rot: FloatTensor<Self>, nope: usize) -> FloatTensor<Self> {
        let device = kv.client.device().clone();
        register::<B>(
            B::latent_keys(resolve::<B>(kv), resolve::<B>(k_rot), nope),
            &device,
        )
    }

    fn latent_keys_backward(
        grad: FloatTensor<Self>,
        nope: usize,
        v: usize,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = grad.client.device().clone();
        let (dkv, dk_rot) = B::latent_keys_backward(resolve::<B>(grad), nope, v);
        (register::<B>(dkv, &device), register::<B>(dk_rot, &device))
    }

    fn latent_values(kv: FloatTensor<Self>, nope: usize) -> FloatTensor<Self> {
        let device = kv.client.device().clone();
        register::<B>(B::latent_values(resolve::<B>(kv), nope), &device)
    }

    fn latent_values_backward(grad: FloatTensor<Self>, nope: usize) -> FloatTensor<Self> {
        let device = grad.client.device().clone();
        register::<B>(B::latent_values_backward(resolve::<B>(grad), nope), &device)
    }

    fn rotate_pairs_seq_major(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let device = x.client.device().clone();
        let out = B::rotate_pairs_seq_major(resolve::<B>(x), resolve::<B>(cos), resolve::<B>(sin));
        register::<B>(out, &device)
    }

    fn rotate_pairs_seq_major_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let device = grad.client.device().clone();
        let dx = B::rotate_pairs_seq_major_backward(resolve::<B>(grad), resolve::<B>(cos), resolve::<B>(sin));
        register::<B>(dx, &device)
    }

    fn gated_silu(z: FloatTensor<Self>) -> FloatTensor<Self> {
        let device = z.client.device().clone();
        register::<B>(B::gated_silu(resolve::<B>(z)), &device)
    }

    fn gated_silu_node() -> bool {
        B::gated_silu_node()
    }

    // `gated_silu_joins` keeps its default, no: fusion fuses `silu(gate) · up` of two halves
    // into one kernel, where joining them would add a copy of each.

    fn gated_silu_backward(z: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        let device = z.client.device().clone();
        register::<B>(
            B::gated_silu_backward(resolve::<B>(z), resolve::<B>(grad)),
            &device,
        )
    }

    fn attention_softmax(
        scores: FloatTensor<Self>,
        hidden: Option<BoolTensor<Self>>,
        scale: f64,
    ) -> FloatTensor<Self> {
        let device = scores.client.device().clone();
        let hidden = hidden.map(resolve_mask::<B>);
        register::<B>(B::attention_softmax(resolve::<B>(scores), hidden, scale), &device)
    }

    fn attention_softmax_node() -> bool {
        B::attention_softmax_node()
    }

    fn attention_softmax_backward(
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        let device = probs.client.device().clone();
        let dscores = B::attention_softmax_backward(resolve::<B>(probs), resolve::<B>(grad), scale);
        register::<B>(dscores, &device)
    }

    fn attention_softmax_sinks(
        scores: FloatTensor<Self>,
        hidden: Option<BoolTensor<Self>>,
        sinks: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = scores.client.device().clone();
        let hidden = hidden.map(resolve_mask::<B>);
        let (probs, shares) =
            B::attention_softmax_sinks(resolve::<B>(scores), hidden, resolve::<B>(sinks), scale);
        (register::<B>(probs, &device), register::<B>(shares, &device))
    }

    fn attention_softmax_sinks_backward(
        probs: FloatTensor<Self>,
        sink_probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = probs.client.device().clone();
        let (dscores, dsinks) = B::attention_softmax_sinks_backward(
            resolve::<B>(probs),
            resolve::<B>(sink_probs),
            resolve::<B>(grad),
            scale,
        );
        (register::<B>(dscores, &device), register::<B>(dsinks, &device))
    }
}

/// A mask's inner-backend tensor (burn-fusion 0.21 `client.rs` `resolve_tensor_bool`, which
/// drains the stream's queued operations up to it).
fn resolve_mask<B: FusionBackend>(mask: BoolTensor<Fusion<B>>) -> BoolTensor<B> {
    let client = mask.client.clone();
    client.resolve_tensor_bool::<B>(mask)
}
