//! The layer's dense products outside the exchange (the router's logits, the shared expert) at
//! the config's GEMM precision: through the communicator's device library for the backend where
//! it offers one ([`ExpertPath::matmul`](super::ExpertPath::matmul)), the backend's own matmul
//! otherwise. On CUDA, cubecl multiplies f32 in TF32 whatever is asked; routing a router's
//! logits through cuBLAS's IEEE f32 is what lets the layer reproduce the reference cases to
//! 1e-4 there.
//!
//! Under `Autodiff<B>` it is one backward node whose two products go the same way
//! ([`DenseBackward`]); burn's own matmul would differentiate in TF32 again.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use super::{GemmPrecision, MoeBackend};
use crate::comm::Communicator;
use crate::error::Result;

/// `lhs · rhs` as [`MoeBackend::dense_matmul`] does it by default: the communicator's path for
/// `B`, the backend's [`expert_matmul`](MoeBackend::expert_matmul) where there is none.
///
/// # Shapes
/// - lhs: `[m, k]`, rhs: `[k, n]` → `[m, n]`
pub(crate) fn through_path<B: MoeBackend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    comm: &Arc<dyn Communicator>,
    precision: GemmPrecision,
) -> Result<FloatTensor<B>> {
    match comm.row_paths().and_then(|p| p.experts::<B>()) {
        Some(path) => path.matmul(lhs, rhs, precision),
        None => Ok(B::expert_matmul(lhs, rhs)),
    }
}

/// The backward node of a dense product: `dlhs = g · rhsᵀ`, `drhs = lhsᵀ · g`, both through the
/// inner backend's [`MoeBackend::dense_matmul`].
#[derive(Debug)]
struct DenseBackward;

#[derive(Debug, Clone)]
struct DenseState<B: MoeBackend> {
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    comm: Arc<dyn Communicator>,
    precision: GemmPrecision,
}

impl<B: MoeBackend> Backward<B, 2> for DenseBackward {
    type State = DenseState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let DenseState {
            lhs,
            rhs,
            comm,
            precision,
        } = ops.state;
        let [lhs_parent, rhs_parent] = ops.parents;
        // Burn's backward has no error channel: a failed device library is raised as a panic
        // carrying the MoeError (as the exchange's node does).
        if let Some(parent) = lhs_parent {
            let g = B::dense_matmul(grad.clone(), B::float_transpose(rhs), &comm, precision)
                .unwrap_or_else(|e| e.raise());
            grads.register::<B>(parent.id, g);
        }
        if let Some(parent) = rhs_parent {
            let g = B::dense_matmul(B::float_transpose(lhs), grad, &comm, precision)
                .unwrap_or_else(|e| e.raise());
            grads.register::<B>(parent.id, g);
        }
    }
}

/// [`MoeBackend::dense_matmul`] of `Autodiff<B>`: the inner product, recorded as one node.
pub(crate) fn autodiff<B: MoeBackend, C: CheckpointStrategy>(
    lhs: FloatTensor<Autodiff<B, C>>,
    rhs: FloatTensor<Autodiff<B, C>>,
    comm: &Arc<dyn Communicator>,
    precision: GemmPrecision,
) -> Result<FloatTensor<Autodiff<B, C>>> {
    if !B::dense_library(comm.as_ref()) {
        // No library: the backend's product and its node (`rows_autodiff`).
        return Ok(rows_autodiff::<B, C>(lhs, rhs));
    }
    let out = B::dense_matmul(lhs.primitive.clone(), rhs.primitive.clone(), comm, precision)?;
    Ok(
        match DenseBackward
            .prepare::<C>([lhs.node.clone(), rhs.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                DenseState {
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

/// The backward node of [`MoeBackend::expert_matmul`] under `Autodiff<B>`: `dlhs = g · rhsᵀ`,
/// `drhs = lhsᵀ · g`, both through the inner backend's `expert_matmul` on transposed views.
#[derive(Debug)]
struct RowsBackward;

impl<B: MoeBackend> Backward<B, 2> for RowsBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (lhs, rhs) = ops.state;
        let [lhs_parent, rhs_parent] = ops.parents;
        if let Some(parent) = lhs_parent {
            grads.register::<B>(parent.id, B::expert_matmul(grad.clone(), B::float_transpose(rhs)));
        }
        if let Some(parent) = rhs_parent {
            grads.register::<B>(parent.id, B::expert_matmul(B::float_transpose(lhs), grad));
        }
    }
}

/// [`MoeBackend::expert_matmul`] of `Autodiff<B>`: the inner backend's product, recorded as one
/// node whose backward products go the same way. Flex's then write into outputs allocated once
/// and read transposed operands in place, where burn's matmul node would differentiate through
/// Flex's matmul (which copies a transposed operand whole before multiplying, burn-flex 0.21
/// `ops/matmul.rs`, and zero-fills then re-aligns every output, `exchange/flex_gemm.rs`). What
/// the product holds for backward is what burn's own node holds: both operands.
pub(crate) fn rows_autodiff<B: MoeBackend, C: CheckpointStrategy>(
    lhs: FloatTensor<Autodiff<B, C>>,
    rhs: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let out = B::expert_matmul(lhs.primitive.clone(), rhs.primitive.clone());
    match RowsBackward
        .prepare::<C>([lhs.node.clone(), rhs.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((lhs.primitive, rhs.primitive), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// `lhs · rhs` on tensors through [`MoeBackend::dense_matmul`].
///
/// # Shapes
/// - lhs: `[m, k]`, rhs: `[k, n]` → `[m, n]`
pub(crate) fn dense<B: MoeBackend>(
    lhs: Tensor<B, 2>,
    rhs: Tensor<B, 2>,
    comm: &Arc<dyn Communicator>,
    precision: GemmPrecision,
) -> Result<Tensor<B, 2>> {
    let out = B::dense_matmul(
        lhs.into_primitive().tensor(),
        rhs.into_primitive().tensor(),
        comm,
        precision,
    )?;
    Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
}
