//! RMSNorm under `Autodiff<B>`: one node over the inner backend's norm whose backward is the
//! inner backend's [`DecoderKernels::rms_norm_backward`], where the inner backend has a kernel
//! each way ([`DecoderKernels::rms_norm_node`]); burn's ops recorded one by one elsewhere, as
//! before. The rotary embedding is recorded as composed.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;

use super::{rms_norm_composed, DecoderKernels};

#[derive(Debug)]
struct RmsNormBackward;

/// What the backward reads: the norm's input and weight (both gradients need both; the inverse
/// root is recomputed from the input).
#[derive(Debug, Clone)]
struct RmsNormState<B: DecoderKernels> {
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    eps: f64,
}

impl<B: DecoderKernels> Backward<B, 2> for RmsNormBackward {
    type State = RmsNormState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let RmsNormState { x, weight, eps } = ops.state;
        let [x_parent, weight_parent] = ops.parents;
        if x_parent.is_none() && weight_parent.is_none() {
            return;
        }
        let (dx, dweight) = B::rms_norm_backward(x, weight, grad, eps);
        if let Some(parent) = x_parent {
            grads.register::<B>(parent.id, dx);
        }
        if let Some(parent) = weight_parent {
            grads.register::<B>(parent.id, dweight);
        }
    }
}

impl<B: DecoderKernels, C: CheckpointStrategy> DecoderKernels for Autodiff<B, C> {
    /// The inner backend's norm as one node where it has a kernel each way; burn's ops,
    /// recorded one by one, elsewhere.
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        if !B::rms_norm_node() {
            return rms_norm_composed::<Self>(x, weight, eps);
        }
        let out = B::rms_norm(x.primitive.clone(), weight.primitive.clone(), eps);
        match RmsNormBackward
            .prepare::<C>([x.node.clone(), weight.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                RmsNormState {
                    x: x.primitive,
                    weight: weight.primitive,
                    eps,
                },
                out,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn rms_norm_node() -> bool {
        B::rms_norm_node()
    }
}
