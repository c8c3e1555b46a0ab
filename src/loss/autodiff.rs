//! The token cross-entropy under `Autodiff<B>`: one node, whose backward is the inner
//! backend's [`LossKernels::token_nll_backward`] from the forward's log-sum-exp, where the
//! composed ops would record (and keep the outputs of) about ten nodes over the whole logits.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::{FloatTensor, IntTensor};

use super::LossKernels;

#[derive(Debug)]
struct TokenNllBackward;

/// What the backward reads: the logits, the targets and each row's log-sum-exp.
#[derive(Debug, Clone)]
struct TokenNllState<B: LossKernels> {
    logits: FloatTensor<B>,
    targets: IntTensor<B>,
    lse: FloatTensor<B>,
}

impl<B: LossKernels> Backward<B, 1> for TokenNllBackward {
    type State = TokenNllState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            let TokenNllState { logits, targets, lse } = ops.state;
            grads.register::<B>(parent.id, B::token_nll_backward(logits, targets, lse, grad));
        }
    }
}

impl<B: LossKernels, C: CheckpointStrategy> LossKernels for Autodiff<B, C> {
    /// The inner backend's forward, recorded as one node whose backward is the inner
    /// backend's `token_nll_backward`.
    fn token_nll(logits: FloatTensor<Self>, targets: IntTensor<Self>) -> FloatTensor<Self> {
        let (nll, lse) = B::token_nll_forward(logits.primitive.clone(), targets.clone());
        match TokenNllBackward
            .prepare::<C>([logits.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                TokenNllState {
                    logits: logits.primitive,
                    targets,
                    lse,
                },
                nll,
            ),
            OpsKind::UnTracked(prep) => prep.finish(nll),
        }
    }
}
