//! The router's ops under burn's fusion (`Fusion<B>`, burn's default WGPU and CUDA backends):
//! on the inner backend, as the combine is (`exchange/fusion.rs`).
//!
//! Fusion fuses element-wise ops, but not across a reduction, and it runs some ops unfused:
//! composed, a softmax router's step took 13 launches under fusion on WGPU where the inner
//! backend's kernels take 4 (`scripts/bench/wgpu_launches.sh --fusion`). So each op resolves
//! its inputs to the inner backend's tensors (fusion executes what is queued for them first),
//! runs the inner backend's op (one kernel each on the CubeCL backends) and registers its
//! output as a new fusion tensor on the calling thread's stream.

use burn::tensor::ops::FloatTensor;
use burn_fusion::{Fusion, FusionBackend};

use super::{ChoiceRead, PickRule, RouterKernels, RoutingRule, Scoring};
use crate::exchange::fusion::{register, resolve};

impl<B: FusionBackend + RouterKernels> RouterKernels for Fusion<B> {
    fn router_scores(logits: FloatTensor<Self>, scoring: Scoring) -> FloatTensor<Self> {
        let device = logits.client.device().clone();
        register::<B>(B::router_scores(resolve::<B>(logits), scoring), &device)
    }

    fn router_scores_backward(
        scores: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scoring: Scoring,
    ) -> FloatTensor<Self> {
        let device = scores.client.device().clone();
        let out = B::router_scores_backward(resolve::<B>(scores), resolve::<B>(grad), scoring);
        register::<B>(out, &device)
    }

    fn router_pick(
        scores: FloatTensor<Self>,
        indices: &[usize],
        top_k: usize,
        rule: PickRule,
    ) -> FloatTensor<Self> {
        let device = scores.client.device().clone();
        register::<B>(
            B::router_pick(resolve::<B>(scores), indices, top_k, rule),
            &device,
        )
    }

    fn router_pick_backward(
        scores: FloatTensor<Self>,
        indices: &[usize],
        top_k: usize,
        grad: FloatTensor<Self>,
        rule: PickRule,
    ) -> FloatTensor<Self> {
        let device = scores.client.device().clone();
        let out = B::router_pick_backward(resolve::<B>(scores), indices, top_k, resolve::<B>(grad), rule);
        register::<B>(out, &device)
    }

    /// The inner backend's choice, whose [`ChoiceRead::launch_issued`] executes on the inner
    /// backend what the caller registered with fusion after this call (the shared expert
    /// under `shared_expert_overlap`), so that the device runs it while the host waits.
    /// Without that step fusion would hold the open tail of it (an element-wise chain waits
    /// for more operations to fuse) until the next resolve, which comes after the wait:
    /// burn-fusion 0.21 executes a stream's queue only when a block closes or when a read or a
    /// resolve drains it (`server.rs` `read_float`, `client.rs` `resolve_tensor_float`).
    /// `sync` drains the calling thread's stream (`client.rs` line 128) and waits for no
    /// kernel: the inner backend launches what fusion hands it asynchronously. It is a
    /// blocking call to fusion's thread, which a caller with nothing issued does not make.
    fn router_choose(
        values: FloatTensor<Self>,
        logits: FloatTensor<Self>,
        rule: &RoutingRule,
    ) -> Option<ChoiceRead> {
        let client = values.client.clone();
        let read = B::router_choose(resolve::<B>(values), resolve::<B>(logits), rule)?;
        Some(read.with_launch(move || client.sync(|| ())))
    }

    fn router_z_loss(logits: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        let device = logits.client.device().clone();
        register::<B>(B::router_z_loss(resolve::<B>(logits), scale), &device)
    }

    fn router_z_loss_backward(
        logits: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        let device = logits.client.device().clone();
        let out = B::router_z_loss_backward(resolve::<B>(logits), resolve::<B>(grad), scale);
        register::<B>(out, &device)
    }
}
