//! `MoeBackend` for `Autodiff<B>`: one backward node for the whole exchange, and a
//! differentiable all-to-all for the reference twin.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};

use super::executor::StepExecutor;
use super::streams::WorkerStreams;
use super::{ExchangeGrads, ExchangeRun, MoeBackend};
use crate::comm::Communicator;
use crate::dispatch::{CombineMap, ExchangePlan, RowMap};
use crate::error::Result;
use crate::experts::{ExpertTensors, EXPERT_PARTS};

/// The exchange's backward node. Parents: `T_I`, then every [`ExpertPart`] in table order
/// (absent biases and adapters are stood in for by untracked placeholders, so they receive
/// nothing).
#[derive(Debug)]
struct ExchangeBackward;

#[derive(Debug, Clone)]
struct ExchangeState<S> {
    saved: S,
    plan: Arc<ExchangePlan>,
    run: ExchangeRun,
}

/// Parents of [`ExchangeBackward`]: `T_I` and the expert parts.
const PARENTS: usize = 1 + EXPERT_PARTS;

impl<B: MoeBackend> Backward<B, PARENTS> for ExchangeBackward {
    type State = ExchangeState<B::Saved>;

    fn backward(
        self,
        ops: Ops<Self::State, PARENTS>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad_out = grads.consume::<B>(&ops.node);
        let ExchangeState { saved, plan, run } = ops.state;
        // Burn's backward has no error channel: a failed collective is raised as a panic
        // carrying the MoeError, which LocalGroup::run turns back into an error.
        let g = B::exchange_backward(grad_out, saved, &plan, &run).unwrap_or_else(|e| e.raise());
        let grads_in_order = std::iter::once(Some(g.input)).chain(g.experts.parts);
        for (parent, grad) in ops.parents.into_iter().zip(grads_in_order) {
            if let (Some(parent), Some(grad)) = (parent, grad) {
                grads.register::<B>(parent.id, grad);
            }
        }
    }
}

/// The all-to-all's backward node: the reverse all-to-all of the gradient.
#[derive(Debug)]
struct AllToAllBackward;

#[derive(Debug, Clone)]
struct AllToAllState {
    send_per_rank: Vec<usize>,
    recv_per_rank: Vec<usize>,
    comm: Arc<dyn Communicator>,
}

impl<B: MoeBackend> Backward<B, 1> for AllToAllBackward {
    type State = AllToAllState;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let back =
            B::all_to_all(grad, &s.recv_per_rank, &s.send_per_rank, &s.comm).unwrap_or_else(|e| e.raise());
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, back);
        }
    }
}

/// The broadcast's backward node: the gradient summed over the ranks, kept by the root.
#[derive(Debug)]
struct BroadcastBackward;

#[derive(Debug, Clone)]
struct BroadcastState {
    root: usize,
    comm: Arc<dyn Communicator>,
    shape: Shape,
}

impl<B: MoeBackend> Backward<B, 1> for BroadcastBackward {
    type State = BroadcastState;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let s = ops.state;
        // Every rank sums, whatever it registers: the root waits for every rank's share.
        let device = B::float_device(&grad);
        let dtype = grad.dtype();
        let sum = B::all_reduce_sum(grad, s.comm.as_ref()).unwrap_or_else(|e| e.raise());
        let back = if s.comm.rank() == s.root {
            sum
        } else {
            B::float_zeros(s.shape, &device, dtype.into())
        };
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, back);
        }
    }
}

fn inner_experts<B: MoeBackend, C: CheckpointStrategy>(
    experts: &ExpertTensors<Autodiff<B, C>>,
) -> ExpertTensors<B> {
    experts.clone().map(|t| t.primitive)
}

impl<B: MoeBackend, C: CheckpointStrategy> MoeBackend for Autodiff<B, C> {
    type Saved = B::Saved;

    fn step_executor(device: &Self::Device) -> StepExecutor {
        B::step_executor(device)
    }

    fn worker_streams(device: &Self::Device) -> Box<dyn WorkerStreams> {
        B::worker_streams(device)
    }

    fn exchange_forward(
        input: FloatTensor<Self>,
        experts: ExpertTensors<Self>,
        plan: &ExchangePlan,
        run: &ExchangeRun,
    ) -> Result<(FloatTensor<Self>, Self::Saved)> {
        let (out, saved) = B::exchange_forward(input.primitive, inner_experts(&experts), plan, run)?;
        Ok((Self::from_inner(out), saved))
    }

    fn exchange_backward(
        grad_out: FloatTensor<Self>,
        saved: Self::Saved,
        plan: &ExchangePlan,
        run: &ExchangeRun,
    ) -> Result<ExchangeGrads<Self>> {
        let g = B::exchange_backward(grad_out.primitive, saved, plan, run)?;
        Ok(ExchangeGrads {
            input: Self::from_inner(g.input),
            experts: g.experts.map(Autodiff::<B, C>::from_inner),
        })
    }

    fn exchange(
        input: FloatTensor<Self>,
        experts: ExpertTensors<Self>,
        plan: Arc<ExchangePlan>,
        run: &ExchangeRun,
    ) -> Result<FloatTensor<Self>> {
        // Only the placeholder's node is used (untracked, it receives nothing), so its tensor
        // is left unwritten: zeros cost a kernel launch per absent part and forward on the
        // CubeCL backends (six a step with neither biases nor adapters).
        let placeholder = || {
            let device = B::float_device(&input.primitive);
            Self::from_inner(B::float_empty(
                Shape::new([1]),
                &device,
                input.primitive.dtype().into(),
            ))
        };
        let parts = experts.clone().into_parts();
        // A part whose node is untracked (a base weight frozen under adapters) gets no
        // gradient: the inner backward is told not to compute it.
        let mut run = run.clone();
        for (frozen, part) in run.frozen.iter_mut().zip(&parts) {
            *frozen |= part.as_ref().is_some_and(|t| t.node.requirement.is_none());
        }
        let run = &run;
        let mut nodes = vec![input.node.clone()];
        nodes.extend(
            parts
                .iter()
                .map(|t| t.as_ref().map_or_else(|| placeholder().node, |t| t.node.clone())),
        );
        let nodes: [_; PARENTS] = nodes.try_into().expect("T_I and every expert part");
        let inner = inner_experts(&experts);
        match ExchangeBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let (out, saved) = B::exchange_forward(input.primitive, inner, &plan, run)?;
                let state = ExchangeState {
                    saved,
                    plan,
                    run: run.clone(),
                };
                Ok(prep.finish(state, out))
            }
            OpsKind::UnTracked(prep) => {
                let (out, _) = B::exchange_forward(input.primitive, inner, &plan, run)?;
                Ok(prep.finish(out))
            }
        }
    }

    fn dense_library(comm: &dyn Communicator) -> bool {
        B::dense_library(comm)
    }

    fn expert_route(
        comm: &dyn Communicator,
        own: bool,
        precision: crate::GemmPrecision,
    ) -> crate::memory::ExpertRoute {
        B::expert_route(comm, own, precision)
    }

    /// The inner backend's product as one node, its backward products the inner's too.
    fn expert_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        super::dense::rows_autodiff::<B, C>(lhs, rhs)
    }

    /// One backward node whose two products go through the inner backend's library too.
    fn dense_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        comm: &Arc<dyn Communicator>,
        precision: super::GemmPrecision,
    ) -> Result<FloatTensor<Self>> {
        super::dense::autodiff::<B, C>(lhs, rhs, comm, precision)
    }

    /// Every product in one call of the inner backend's library, each its own node.
    fn dense_matmuls(
        pairs: Vec<(FloatTensor<Self>, FloatTensor<Self>)>,
        comm: &Arc<dyn Communicator>,
        precision: super::GemmPrecision,
    ) -> Result<Vec<FloatTensor<Self>>> {
        super::dense::autodiff_many::<B, C>(pairs, comm, precision)
    }

    /// Through the inner backend's library, one node whose two backward products go the same
    /// way; `Autodiff`'s own per-head product without one.
    fn dense_heads_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        comm: &Arc<dyn Communicator>,
        precision: super::GemmPrecision,
    ) -> Result<FloatTensor<Self>> {
        super::dense_heads::autodiff::<B, C>(lhs, rhs, comm, precision)
    }

    /// One node whose backward is the inner backend's combine.
    fn gather_rows(x: FloatTensor<Self>, map: &Arc<RowMap>) -> FloatTensor<Self> {
        super::row_moves::gather_autodiff::<B, C>(x, map)
    }

    /// One node whose backward is the inner backend's gather.
    fn combine_rows(rows: FloatTensor<Self>, map: &Arc<RowMap>) -> FloatTensor<Self> {
        super::row_moves::combine_autodiff::<B, C>(rows, map)
    }

    /// One node whose backward is the inner backend's `combine_weighted_backward`.
    fn combine_weighted(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        map: &Arc<CombineMap>,
    ) -> FloatTensor<Self> {
        super::weighted_combine::combine_weighted_autodiff::<B, C>(rows, weights, map)
    }

    fn all_to_all(
        x: FloatTensor<Self>,
        send_per_rank: &[usize],
        recv_per_rank: &[usize],
        comm: &Arc<dyn Communicator>,
    ) -> Result<FloatTensor<Self>> {
        let out = B::all_to_all(x.primitive.clone(), send_per_rank, recv_per_rank, comm)?;
        Ok(
            match AllToAllBackward
                .prepare::<C>([x.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(
                    AllToAllState {
                        send_per_rank: send_per_rank.to_vec(),
                        recv_per_rank: recv_per_rank.to_vec(),
                        comm: comm.clone(),
                    },
                    out,
                ),
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
        )
    }

    /// The inner backend's: the broadcast and the backward's all-reduce run there.
    fn has_device_reduce(comm: &dyn Communicator) -> bool {
        B::has_device_reduce(comm)
    }

    fn broadcast(
        x: FloatTensor<Self>,
        root: usize,
        comm: &Arc<dyn Communicator>,
    ) -> Result<FloatTensor<Self>> {
        let shape = x.primitive.shape();
        let out = B::broadcast(x.primitive.clone(), root, comm)?;
        Ok(
            match BroadcastBackward
                .prepare::<C>([x.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(
                    BroadcastState {
                        root,
                        comm: comm.clone(),
                        shape,
                    },
                    out,
                ),
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
        )
    }
}
