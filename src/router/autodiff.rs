//! The router's scores, picked weights and z-loss under `Autodiff<B>`: one node each, whose backward is
//! the inner backend's [`RouterKernels`] backward, where the composed ops would record (and
//! keep the outputs of) a node per op.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;

use super::kernels::{ChoiceRead, PickRule, RouterKernels};
use super::{RoutingRule, Scoring};

#[derive(Debug)]
struct ScoresBackward;

/// What the scores' backward reads: the scores themselves (both derivatives are functions of
/// them) and how they were made.
#[derive(Debug, Clone)]
struct ScoresState<B: RouterKernels> {
    scores: FloatTensor<B>,
    scoring: Scoring,
}

impl<B: RouterKernels> Backward<B, 1> for ScoresBackward {
    type State = ScoresState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            let ScoresState { scores, scoring } = ops.state;
            grads.register::<B>(parent.id, B::router_scores_backward(scores, grad, scoring));
        }
    }
}

#[derive(Debug)]
struct PickBackward;

/// What the pick's backward reads: the scores it picked from and the choice.
#[derive(Debug, Clone)]
struct PickState<B: RouterKernels> {
    scores: FloatTensor<B>,
    indices: Arc<[usize]>,
    top_k: usize,
    rule: PickRule,
}

impl<B: RouterKernels> Backward<B, 1> for PickBackward {
    type State = PickState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            let PickState {
                scores,
                indices,
                top_k,
                rule,
            } = ops.state;
            grads.register::<B>(
                parent.id,
                B::router_pick_backward(scores, &indices, top_k, grad, rule),
            );
        }
    }
}

#[derive(Debug)]
struct ZLossBackward;

/// What the z-loss's backward reads: the logits (their logsumexp and softmax are recomputed
/// from them) and the scale.
#[derive(Debug, Clone)]
struct ZLossState<B: RouterKernels> {
    logits: FloatTensor<B>,
    scale: f64,
}

impl<B: RouterKernels> Backward<B, 1> for ZLossBackward {
    type State = ZLossState<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            let ZLossState { logits, scale } = ops.state;
            grads.register::<B>(parent.id, B::router_z_loss_backward(logits, grad, scale));
        }
    }
}

impl<B: RouterKernels, C: CheckpointStrategy> RouterKernels for Autodiff<B, C> {
    /// The inner backend's scores, recorded as one node that keeps them for its backward.
    fn router_scores(logits: FloatTensor<Self>, scoring: Scoring) -> FloatTensor<Self> {
        let scores = B::router_scores(logits.primitive, scoring);
        match ScoresBackward
            .prepare::<C>([logits.node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                ScoresState {
                    scores: scores.clone(),
                    scoring,
                },
                scores,
            ),
            OpsKind::UnTracked(prep) => prep.finish(scores),
        }
    }

    /// The inner backend's pick, recorded as one node whose backward is the inner backend's
    /// `router_pick_backward`.
    fn router_pick(
        scores: FloatTensor<Self>,
        indices: &[usize],
        top_k: usize,
        rule: PickRule,
    ) -> FloatTensor<Self> {
        let weights = B::router_pick(scores.primitive.clone(), indices, top_k, rule);
        match PickBackward
            .prepare::<C>([scores.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                PickState {
                    scores: scores.primitive,
                    indices: indices.into(),
                    top_k,
                    rule,
                },
                weights,
            ),
            OpsKind::UnTracked(prep) => prep.finish(weights),
        }
    }

    /// The inner backend's choice: an integer choice has no gradient, so nothing is recorded.
    fn router_choose(
        values: FloatTensor<Self>,
        logits: FloatTensor<Self>,
        rule: &RoutingRule,
    ) -> Option<ChoiceRead> {
        B::router_choose(values.primitive, logits.primitive, rule)
    }

    /// The inner backend's z-loss, recorded as one node that keeps the logits for its
    /// backward (`[n_tokens, n_experts]`: small beside the layer's activations).
    fn router_z_loss(logits: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        let loss = B::router_z_loss(logits.primitive.clone(), scale);
        match ZLossBackward
            .prepare::<C>([logits.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                ZLossState {
                    logits: logits.primitive,
                    scale,
                },
                loss,
            ),
            OpsKind::UnTracked(prep) => prep.finish(loss),
        }
    }
}
