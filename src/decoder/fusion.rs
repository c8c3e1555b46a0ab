//! RMSNorm under burn's fusion (`Fusion<B>`): on the inner backend, as the router's ops are
//! (`router/fusion.rs`). Fusion fuses element-wise ops but not across the norm's row sum, so
//! each op resolves its inputs to the inner backend's tensors, runs the inner backend's kernel
//! and registers its output on the calling thread's stream. The rotary embedding stays
//! composed, which fusion fuses.

use burn::tensor::ops::FloatTensor;
use burn_fusion::{Fusion, FusionBackend};

use super::DecoderKernels;
use crate::exchange::fusion::{register, resolve};

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
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = x.client.device().clone();
        let (dx, dweight) =
            B::rms_norm_backward(resolve::<B>(x), resolve::<B>(weight), resolve::<B>(grad), eps);
        (register::<B>(dx, &device), register::<B>(dweight, &device))
    }
}
