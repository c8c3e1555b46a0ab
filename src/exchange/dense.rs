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
    match dense_path::<B>(comm.as_ref()) {
        Some(path) => path.matmul(lhs, rhs, precision),
        None => Ok(B::expert_matmul(lhs, rhs)),
    }
}

/// [`through_path`] for independent products, in one call of the path's
/// [`ExpertPath::matmuls`](super::ExpertPath::matmuls) where there is a path.
pub(crate) fn through_path_many<B: MoeBackend>(
    pairs: Vec<(FloatTensor<B>, FloatTensor<B>)>,
    comm: &Arc<dyn Communicator>,
    precision: GemmPrecision,
) -> Result<Vec<FloatTensor<B>>> {
    let path = dense_path::<B>(comm.as_ref());
    super::products::matmuls(path.as_deref(), pairs, precision)
}

/// The communicator's device library for `B` where it takes dense products
/// ([`ExpertPath::multiplies_dense`](super::ExpertPath::multiplies_dense)).
pub(crate) fn dense_path<B: MoeBackend>(comm: &dyn Communicator) -> Option<Arc<dyn super::ExpertPath<B>>> {
    comm.row_paths()
        .and_then(|p| p.experts::<B>())
        .filter(|p| p.multiplies_dense())
}

/// The backward node of a dense product: `dlhs = g · rhsᵀ`, `drhs = lhsᵀ · g`, each the same
/// product as the forward's: the inner backend's [`MoeBackend::dense_matmul`] through a
/// device library, or its [`MoeBackend::expert_matmul`] (on transposed views) without one.
#[derive(Debug)]
struct DenseBackward;

#[derive(Debug, Clone)]
struct DenseState<B: MoeBackend> {
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    /// The communicator whose library multiplies, and at what precision; `None` for the
    /// backend's own row product.
    library: Option<(Arc<dyn Communicator>, GemmPrecision)>,
}

impl<B: MoeBackend> DenseState<B> {
    /// Each `a · b` of `pairs` as the forward multiplied, in one call of the library where
    /// there is one. Burn's backward has no error channel: a failed device library is raised
    /// as a panic carrying the MoeError (as the exchange's node does).
    fn products(&self, pairs: Vec<(FloatTensor<B>, FloatTensor<B>)>) -> Vec<FloatTensor<B>> {
        match &self.library {
            Some((comm, precision)) => {
                B::dense_matmuls(pairs, comm, *precision).unwrap_or_else(|e| e.raise())
            }
            None => pairs.into_iter().map(|(a, b)| B::expert_matmul(a, b)).collect(),
        }
    }
}

impl<B: MoeBackend> Backward<B, 2> for DenseBackward {
    type State = DenseState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let state = ops.state;
        let [lhs_parent, rhs_parent] = ops.parents;
        // Both products in one call: through a device library, one section on CUDA.
        let mut pairs = Vec::with_capacity(2);
        if lhs_parent.is_some() {
            pairs.push((grad.clone(), B::float_transpose(state.rhs.clone())));
        }
        if rhs_parent.is_some() {
            pairs.push((B::float_transpose(state.lhs.clone()), grad));
        }
        let mut products = state.products(pairs).into_iter();
        for parent in [lhs_parent, rhs_parent].into_iter().flatten() {
            let g = products.next().expect("one product per parent");
            grads.register::<B>(parent.id, g);
        }
    }
}

/// `out = lhs · rhs`, already multiplied as `library` says, recorded as one [`DenseBackward`]
/// node holding both operands (what burn's own matmul node holds).
fn record<B: MoeBackend, C: CheckpointStrategy>(
    lhs: FloatTensor<Autodiff<B, C>>,
    rhs: FloatTensor<Autodiff<B, C>>,
    library: Option<(Arc<dyn Communicator>, GemmPrecision)>,
    out: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    match DenseBackward
        .prepare::<C>([lhs.node.clone(), rhs.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            DenseState {
                lhs: lhs.primitive,
                rhs: rhs.primitive,
                library,
            },
            out,
        ),
        OpsKind::UnTracked(prep) => prep.finish(out),
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
        // No library: the backend's row product and its node (`rows_autodiff`).
        return Ok(rows_autodiff::<B, C>(lhs, rhs));
    }
    let out = B::dense_matmul(lhs.primitive.clone(), rhs.primitive.clone(), comm, precision)?;
    Ok(record::<B, C>(lhs, rhs, Some((comm.clone(), precision)), out))
}

/// A product's two operands.
type Pair<B> = (FloatTensor<B>, FloatTensor<B>);

/// [`MoeBackend::dense_matmuls`] of `Autodiff<B>`: every product in one call of the inner
/// backend's library (on CUDA, one section where each product alone would take one), each
/// recorded as a node of its own, as [`autodiff`] records one. The backward of each node makes
/// its own two products: burn's autodiff hands each node its own output's gradient, so the
/// backwards of products that share an input (attention's q, k and v) cannot be one call.
pub(crate) fn autodiff_many<B: MoeBackend, C: CheckpointStrategy>(
    pairs: Vec<Pair<Autodiff<B, C>>>,
    comm: &Arc<dyn Communicator>,
    precision: GemmPrecision,
) -> Result<Vec<FloatTensor<Autodiff<B, C>>>> {
    if !B::dense_library(comm.as_ref()) {
        return Ok(pairs
            .into_iter()
            .map(|(lhs, rhs)| rows_autodiff::<B, C>(lhs, rhs))
            .collect());
    }
    let inner = pairs
        .iter()
        .map(|(lhs, rhs)| (lhs.primitive.clone(), rhs.primitive.clone()))
        .collect();
    let outs = B::dense_matmuls(inner, comm, precision)?;
    Ok(pairs
        .into_iter()
        .zip(outs)
        .map(|((lhs, rhs), out)| record::<B, C>(lhs, rhs, Some((comm.clone(), precision)), out))
        .collect())
}

/// [`MoeBackend::expert_matmul`] of `Autodiff<B>`: the inner backend's product, recorded as one
/// node whose backward products go the same way. Flex's then write into outputs allocated once
/// and read transposed operands in place, where burn's matmul node would differentiate through
/// Flex's matmul (which copies a transposed operand whole before multiplying, burn-flex 0.21
/// `ops/matmul.rs`, and zero-fills then re-aligns every output, `exchange/flex_gemm.rs`).
pub(crate) fn rows_autodiff<B: MoeBackend, C: CheckpointStrategy>(
    lhs: FloatTensor<Autodiff<B, C>>,
    rhs: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let out = B::expert_matmul(lhs.primitive.clone(), rhs.primitive.clone());
    record::<B, C>(lhs, rhs, None, out)
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
