//! Steps 4 and 6 of the forward recipe as two ops on a [`RowMap`]: the gather of rows
//! (`T_I` from the tokens, the combine weights from their slots) and the combine (each
//! token's rows summed back onto it). Each is the other's backward.
//!
//! The defaults are burn's `select` and `select_assign` with `Add` onto zeros, which is what
//! the layer composed before. On the CubeCL backends burn-cubecl 0.21's `select_assign`
//! kernel runs one thread per element of a row and walks every row of the tensor in that
//! thread (`kernel/index/select_assign.rs`: `working_units = numel / shape[axis]`): 768
//! threads for a `[4096, 768]` combine. On one H200 three of them took 2.7 ms of a 5.7 ms layer
//! step at GPT3-S (BENCHMARKS §14b), so those backends sum each target's rows in a kernel of
//! their own (`exchange/cubecl_combine.rs`).
//!
//! Under `Autodiff<B>` each op is one node whose backward is the inner backend's other op,
//! so the combine's kernel serves the gather's backward too, and burn's `select` backward
//! (a `select_assign`) never runs.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;

use super::rows::{dims2, index, zeros_like_rows};
use super::MoeBackend;
use crate::dispatch::RowMap;

/// Row `i` of the result is row `map.targets()[i]` of `x`: burn's `select`.
///
/// # Shapes
/// - x: `[n_targets, width]` → `[n_rows, width]`
pub(crate) fn select_rows<B: MoeBackend>(x: FloatTensor<B>, map: &RowMap) -> FloatTensor<B> {
    if map.n_rows() == 0 {
        // No row (every assignment dropped, or no token): nothing to launch a kernel over.
        return zeros_like_rows::<B>(&x, 0, dims2::<B>(&x)[1]);
    }
    let idx = index::<B>(map.targets(), &B::float_device(&x));
    B::float_select(x, 0, idx)
}

/// Row `t` of the result is the sum of the rows of `rows` whose target is `t`, in ascending
/// row order, onto zero: burn's `select_assign` with `Add` onto zeros.
///
/// # Shapes
/// - rows: `[n_rows, width]` → `[n_targets, width]`
pub(crate) fn add_rows<B: MoeBackend>(rows: FloatTensor<B>, map: &RowMap) -> FloatTensor<B> {
    let zeros = zeros_like_rows::<B>(&rows, map.n_targets(), dims2::<B>(&rows)[1]);
    if map.n_rows() == 0 {
        // Nothing to add: the zeros are the sum.
        return zeros;
    }
    let idx = index::<B>(map.targets(), &B::float_device(&rows));
    B::float_select_add(zeros, 0, idx, rows)
}

/// Which op a node ran forward; its backward runs the other.
#[derive(Debug, Clone, Copy)]
enum Move {
    Gather,
    Combine,
}

#[derive(Debug)]
struct MoveBackward;

impl<B: MoeBackend> Backward<B, 1> for MoveBackward {
    type State = (Move, Arc<RowMap>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (forward, map) = ops.state;
        let back = match forward {
            Move::Gather => B::combine_rows(grad, &map),
            Move::Combine => B::gather_rows(grad, &map),
        };
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, back);
        }
    }
}

fn tracked<B: MoeBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    map: &Arc<RowMap>,
    forward: Move,
) -> FloatTensor<Autodiff<B, C>> {
    let out = match forward {
        Move::Gather => B::gather_rows(x.primitive, map),
        Move::Combine => B::combine_rows(x.primitive, map),
    };
    match MoveBackward.prepare::<C>([x.node]).compute_bound().stateful() {
        OpsKind::Tracked(prep) => prep.finish((forward, map.clone()), out),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

/// [`MoeBackend::gather_rows`] for `Autodiff<B>`: one node, its backward `B::combine_rows`.
pub(crate) fn gather_autodiff<B: MoeBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    map: &Arc<RowMap>,
) -> FloatTensor<Autodiff<B, C>> {
    tracked::<B, C>(x, map, Move::Gather)
}

/// [`MoeBackend::combine_rows`] for `Autodiff<B>`: one node, its backward `B::gather_rows`.
pub(crate) fn combine_autodiff<B: MoeBackend, C: CheckpointStrategy>(
    rows: FloatTensor<Autodiff<B, C>>,
    map: &Arc<RowMap>,
) -> FloatTensor<Autodiff<B, C>> {
    tracked::<B, C>(rows, map, Move::Combine)
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData, TensorPrimitive};

    type B = Autodiff<NdArray>;

    /// Under autodiff the two nodes give burn's `select` / `select_assign` values and
    /// gradients bit for bit (each op's backward is the other op): a token with three rows, a
    /// token with none, rows out of order. A wrong backward (the gather's gradient gathered
    /// instead of combined) fails on the shapes alone; a dropped row fails on the values.
    #[test]
    fn nodes_match_burns_select_ops() {
        let device = Default::default();
        let targets = vec![2usize, 0, 2, 4, 2, 0, 3];
        let (n_rows, n_targets, width) = (targets.len(), 5, 3);
        let map = Arc::new(RowMap::new(targets.clone(), n_targets));
        let idx = Tensor::<B, 1, Int>::from_data(
            TensorData::new(targets.iter().map(|&t| t as i64).collect::<Vec<_>>(), [n_rows]),
            &device,
        );
        let make = |rows: usize, seed: f32| {
            let data: Vec<f32> = (0..rows * width)
                .map(|i| (i as f32 * 0.37 + seed).sin())
                .collect();
            Tensor::<B, 2>::from_data(TensorData::new(data, [rows, width]), &device)
        };
        let wrap = |p| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(p));
        let values = |t: Tensor<B, 2>| t.into_data().to_vec::<f32>().unwrap();

        let rows = make(n_rows, 0.1).require_grad();
        let weight = make(n_targets, 0.7);
        let ours = wrap(B::combine_rows(rows.clone().into_primitive().tensor(), &map));
        let theirs = Tensor::<B, 2>::zeros([n_targets, width], &device).select_assign(
            0,
            idx.clone(),
            rows.clone(),
            IndexingUpdateOp::Add,
        );
        assert_eq!(values(ours.clone()), values(theirs.clone()));
        assert_eq!(values(ours.clone().slice([1..2, 0..width])), vec![0.0; width]);
        let g_ours = rows.grad(&(ours * weight.clone()).sum().backward()).unwrap();
        let g_theirs = rows.grad(&(theirs * weight).sum().backward()).unwrap();
        assert_eq!(g_ours.into_data(), g_theirs.into_data());

        let x = make(n_targets, 0.3).require_grad();
        let weight = make(n_rows, 0.9);
        let ours = wrap(B::gather_rows(x.clone().into_primitive().tensor(), &map));
        let theirs = x.clone().select(0, idx);
        assert_eq!(values(ours.clone()), values(theirs.clone()));
        let g_ours = x.grad(&(ours * weight.clone()).sum().backward()).unwrap();
        let g_theirs = x.grad(&(theirs * weight).sum().backward()).unwrap();
        assert_eq!(g_ours.into_data(), g_theirs.into_data());
    }

    /// A map without rows (every assignment dropped): the combine is zeros of the target
    /// shape, the gather has no row, and both backward passes give zeros of their input's
    /// shape.
    #[test]
    fn a_map_without_rows_gives_zeros() {
        let device = Default::default();
        let map = Arc::new(RowMap::new(Vec::new(), 3));
        let x = Tensor::<B, 2>::ones([3, 2], &device).require_grad();
        let wrap = |p| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(p));
        let rows = wrap(B::gather_rows(x.clone().into_primitive().tensor(), &map));
        assert_eq!(rows.dims(), [0, 2]);
        let back = wrap(B::combine_rows(rows.into_primitive().tensor(), &map));
        assert_eq!(back.clone().into_data().to_vec::<f32>().unwrap(), vec![0.0; 6]);
        let grads = (back + x.clone()).sum().backward();
        assert_eq!(
            x.grad(&grads).unwrap().into_data().to_vec::<f32>().unwrap(),
            vec![1.0; 6]
        );
    }
}
