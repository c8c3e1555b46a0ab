//! Attention's per-head products at the MoE layers' GEMM precision
//! ([`MoeBackend::dense_heads_matmul`]): through the communicator's device library for the
//! backend where it takes dense products
//! ([`ExpertPath::heads_matmul`](super::ExpertPath::heads_matmul)), the backend's
//! [`heads_matmul`](MoeBackend::heads_matmul) otherwise.
//!
//! A model's projections already multiply there ([`MoeBackend::dense_matmul`]); its attention's
//! products did not, so on CUDA the scores and the weighted values (and their gradients) ran
//! on cubecl's kernels, which multiply f32 in TF32 whatever precision is asked: a model asked
//! for IEEE f32 was not, in attention. Under `Autodiff<B>` the product is one node whose two
//! backward products go the same way ([`HeadsBackward`]), as a dense product's do
//! (`exchange/dense.rs`); without a library, the backend's product recorded as before.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;

use super::dense::dense_path;
use super::{GemmPrecision, MoeBackend};
use crate::comm::Communicator;
use crate::error::Result;

/// `lhs · rhs` per head as [`MoeBackend::dense_heads_matmul`] does it by default: the
/// communicator's path for `B`, the backend's [`heads_matmul`](MoeBackend::heads_matmul) where
/// there is none.
///
/// # Shapes
/// - lhs: `[.., m, k]`, rhs: `[.., k, n]` → `[.., m, n]`
pub(crate) fn through_path<B: MoeBackend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    comm: &Arc<dyn Communicator>,
    precision: GemmPrecision,
) -> Result<FloatTensor<B>> {
    match dense_path::<B>(comm.as_ref()) {
        Some(path) => path.heads_matmul(lhs, rhs, precision),
        None => Ok(B::heads_matmul(lhs, rhs)),
    }
}

/// `t` with its last two dimensions swapped: a view, which the library reads in place.
fn transposed<B: MoeBackend>(t: FloatTensor<B>) -> FloatTensor<B> {
    let rank = t.shape().num_dims();
    B::float_swap_dims(t, rank - 2, rank - 1)
}

/// The backward node of a per-head product: `dlhs = g · rhsᵀ` and `drhs = lhsᵀ · g`, per head,
/// each through the inner backend's [`MoeBackend::dense_heads_matmul`] at the forward's
/// precision.
#[derive(Debug)]
struct HeadsBackward;

#[derive(Debug, Clone)]
struct HeadsState<B: MoeBackend> {
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    comm: Arc<dyn Communicator>,
    precision: GemmPrecision,
}

impl<B: MoeBackend> Backward<B, 2> for HeadsBackward {
    type State = HeadsState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let HeadsState {
            lhs,
            rhs,
            comm,
            precision,
        } = ops.state;
        let [lhs_parent, rhs_parent] = ops.parents;
        // Burn's backward has no error channel: a failed device library is raised as a panic
        // carrying the MoeError, as the dense product's node does.
        let product = |a, b| B::dense_heads_matmul(a, b, &comm, precision).unwrap_or_else(|e| e.raise());
        if let Some(parent) = lhs_parent {
            grads.register::<B>(parent.id, product(grad.clone(), transposed::<B>(rhs)));
        }
        if let Some(parent) = rhs_parent {
            grads.register::<B>(parent.id, product(transposed::<B>(lhs), grad));
        }
    }
}

/// [`MoeBackend::dense_heads_matmul`] of `Autodiff<B>`: the inner product through the library,
/// recorded as one [`HeadsBackward`] node holding both operands (what burn's matmul node
/// holds); without a library, `Autodiff`'s own [`heads_matmul`](MoeBackend::heads_matmul).
pub(crate) fn autodiff<B: MoeBackend, C: CheckpointStrategy>(
    lhs: FloatTensor<Autodiff<B, C>>,
    rhs: FloatTensor<Autodiff<B, C>>,
    comm: &Arc<dyn Communicator>,
    precision: GemmPrecision,
) -> Result<FloatTensor<Autodiff<B, C>>> {
    if !B::dense_library(comm.as_ref()) {
        return Ok(<Autodiff<B, C> as MoeBackend>::heads_matmul(lhs, rhs));
    }
    let out = B::dense_heads_matmul(lhs.primitive.clone(), rhs.primitive.clone(), comm, precision)?;
    Ok(
        match HeadsBackward
            .prepare::<C>([lhs.node.clone(), rhs.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                HeadsState {
                    lhs: lhs.primitive,
                    rhs: rhs.primitive,
                    comm: comm.clone(),
                    precision,
                },
                out,
            ),
            OpsKind::UnTracked(prep) => prep.finish(out),
        },
    )
}
