//! Step 6 with its combine weights as one op: `y[t] = Σ_r w[slot(r)] · T_O[r]` over token
//! `t`'s rows `r`, and its backward.
//!
//! Composed, the step is three ops: the weights gathered into row order (`select`), the rows
//! scaled (`mul`) and the combine; burn's autodiff walks back through each, and the weights'
//! gradient takes a gather of the output gradient, two products, a row sum and a scatter onto
//! the slots. On a GPU each of those is a launch, and at small shapes the step waits on the
//! host's launches (BENCHMARKS §14b): the composed step was 2 launches forward and 6 backward
//! besides the combine. The CubeCL backends run one kernel each way
//! (`exchange/cubecl_combine.rs`); every other backend runs the composed forms, which are
//! the public twins [`combine_weighted_composed`] and [`combine_weighted_backward_composed`]
//! and give the bits the layer gave before.
//!
//! Under `Autodiff<B>` the op is one node whose backward is the inner backend's
//! [`MoeBackend::combine_weighted_backward`].

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::Autodiff;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use super::MoeBackend;
use crate::dispatch::CombineMap;

fn float<B: MoeBackend>(x: FloatTensor<B>) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// Each row's weight, `[n_rows, 1]`: the weights' slots gathered into row order (also what
/// the layers that weight the experts' input, as Llama 4 does, scale `T_I` by).
pub(crate) fn row_weights<B: MoeBackend>(weights: FloatTensor<B>, map: &CombineMap) -> Tensor<B, 2> {
    let slots = float::<B>(weights).reshape([map.n_tokens() * map.top_k(), 1]);
    float::<B>(B::gather_rows(slots.into_primitive().tensor(), map.slots()))
}

/// [`MoeBackend::combine_weighted`] composed from the row moves and burn's ops: the weights
/// gathered into row order, the rows scaled by them, the combine.
///
/// # Shapes
/// - rows: `[n_rows, d_model]`, weights: `[n_tokens, top_k]` → `[n_tokens, d_model]`
pub fn combine_weighted_composed<B: MoeBackend>(
    rows: FloatTensor<B>,
    weights: FloatTensor<B>,
    map: &CombineMap,
) -> FloatTensor<B> {
    let scaled = float::<B>(rows) * row_weights::<B>(weights, map);
    B::combine_rows(scaled.into_primitive().tensor(), map.tokens())
}

/// [`MoeBackend::combine_weighted_backward`] composed from the row moves and burn's ops, the
/// ops burn's autodiff ran for the composed forward: the output gradient gathered into row
/// order, scaled by each row's weight (the rows' gradient) and multiplied with the rows and
/// summed per row (each slot's gradient, scattered onto the slots; zero for dropped ones).
///
/// # Shapes
/// - grad: `[n_tokens, d_model]`, rows: `[n_rows, d_model]`, weights: `[n_tokens, top_k]`
/// - returns the rows' gradient `[n_rows, d_model]` and the weights' `[n_tokens, top_k]`
pub fn combine_weighted_backward_composed<B: MoeBackend>(
    grad: FloatTensor<B>,
    rows: FloatTensor<B>,
    weights: FloatTensor<B>,
    map: &CombineMap,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let grad_rows = float::<B>(B::gather_rows(grad, map.tokens()));
    let d_rows = grad_rows.clone() * row_weights::<B>(weights, map);
    let d_row_weights = (grad_rows * float::<B>(rows)).sum_dim(1);
    let d_weights = float::<B>(B::combine_rows(
        d_row_weights.into_primitive().tensor(),
        map.slots(),
    ))
    .reshape([map.n_tokens(), map.top_k()]);
    (
        d_rows.into_primitive().tensor(),
        d_weights.into_primitive().tensor(),
    )
}

#[derive(Debug)]
struct WeightedCombineBackward;

/// What the backward reads: both inputs (each one's gradient is a product with the other)
/// and the map.
#[derive(Debug, Clone)]
struct WeightedCombineState<B: MoeBackend> {
    rows: FloatTensor<B>,
    weights: FloatTensor<B>,
    map: Arc<CombineMap>,
}

impl<B: MoeBackend> Backward<B, 2> for WeightedCombineBackward {
    type State = WeightedCombineState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let WeightedCombineState { rows, weights, map } = ops.state;
        let (d_rows, d_weights) = B::combine_weighted_backward(grad, rows, weights, &map);
        let [rows_parent, weights_parent] = ops.parents;
        if let Some(parent) = rows_parent {
            grads.register::<B>(parent.id, d_rows);
        }
        if let Some(parent) = weights_parent {
            grads.register::<B>(parent.id, d_weights);
        }
    }
}

/// [`MoeBackend::combine_weighted`] for `Autodiff<B>`: the inner backend's op, recorded as one
/// node that keeps both inputs.
pub(crate) fn combine_weighted_autodiff<B: MoeBackend, C: CheckpointStrategy>(
    rows: FloatTensor<Autodiff<B, C>>,
    weights: FloatTensor<Autodiff<B, C>>,
    map: &Arc<CombineMap>,
) -> FloatTensor<Autodiff<B, C>> {
    let out = B::combine_weighted(rows.primitive.clone(), weights.primitive.clone(), map);
    match WeightedCombineBackward
        .prepare::<C>([rows.node.clone(), weights.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            WeightedCombineState {
                rows: rows.primitive,
                weights: weights.primitive,
                map: map.clone(),
            },
            out,
        ),
        OpsKind::UnTracked(prep) => prep.finish(out),
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use super::*;
    use crate::dispatch::RowMap;
    use burn::backend::NdArray;
    use burn::tensor::{Int, TensorData};

    type B = Autodiff<NdArray>;

    /// Top-2 over five tokens, rows out of token order (as the plan orders them, by expert):
    /// token 1's second choice dropped, token 3 with no row at all.
    fn map() -> Arc<CombineMap> {
        let row_slot = vec![4, 0, 9, 2, 5, 8, 1];
        let tokens = Arc::new(RowMap::new(row_slot.iter().map(|s| s / 2).collect(), 5));
        Arc::new(CombineMap::new(tokens, row_slot, 2))
    }

    fn tensor(rows: usize, cols: usize, seed: f32) -> Tensor<B, 2> {
        let data: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37 + seed).sin()).collect();
        Tensor::from_data(TensorData::new(data, [rows, cols]), &Default::default())
    }

    fn bits<K: burn::tensor::backend::Backend>(t: Tensor<K, 2>) -> Vec<u32> {
        t.into_data()
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// The node gives what the layer composed from burn's differentiable ops before
    /// (`select` of the weights by slot, `mul`, `select_assign` onto zeros), values and both
    /// gradients bit for bit. A weight applied to another slot's row, a dropped slot given a
    /// gradient, or a row summed onto the wrong token fails it.
    #[test]
    fn the_node_is_burns_composition_bit_for_bit() {
        let map = map();
        let (n_rows, d_model) = (map.n_rows(), 3);
        let rows = tensor(n_rows, d_model, 0.5).require_grad();
        let weights = tensor(5, 2, 1.5).require_grad();
        let mix = tensor(5, d_model, 2.5);

        let ours = float::<B>(B::combine_weighted(
            rows.clone().into_primitive().tensor(),
            weights.clone().into_primitive().tensor(),
            &map,
        ));
        let index = |targets: &[usize]| {
            let ids: Vec<i64> = targets.iter().map(|&t| t as i64).collect();
            Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [targets.len()]), &Default::default())
        };
        let row_weights = weights
            .clone()
            .reshape([10, 1])
            .select(0, index(map.slots().targets()));
        let theirs = Tensor::<B, 2>::zeros([5, d_model], &Default::default()).select_assign(
            0,
            index(map.tokens().targets()),
            rows.clone() * row_weights,
            burn::tensor::IndexingUpdateOp::Add,
        );
        assert_eq!(bits(ours.clone()), bits(theirs.clone()));

        let g_ours = (ours * mix.clone()).sum().backward();
        let g_theirs = (theirs * mix).sum().backward();
        assert_eq!(
            bits(rows.grad(&g_ours).unwrap()),
            bits(rows.grad(&g_theirs).unwrap())
        );
        let d_weights = weights.grad(&g_ours).unwrap();
        assert_eq!(bits(d_weights.clone()), bits(weights.grad(&g_theirs).unwrap()));
        // The dropped slot (token 1's second) and token 3's slots get nothing; the others do.
        let d = d_weights.into_data().to_vec::<f32>().unwrap();
        for s in [3, 6, 7] {
            assert_eq!(d[s], 0.0, "slot {s}");
        }
        assert!(d.iter().filter(|v| **v != 0.0).count() == 7);
    }

    /// Against a hand-written sum in f64: y[t] = Σ w[slot(r)] · rows[r], and the weights'
    /// gradient is each slot row's dot product with its token's output gradient.
    #[test]
    fn the_composed_twin_is_the_weighted_sum() {
        type P = NdArray;
        let map = map();
        let d_model = 4;
        let to_plain = |t: Tensor<B, 2>| t.inner();
        let rows = to_plain(tensor(map.n_rows(), d_model, 0.25));
        let weights = to_plain(tensor(5, 2, 0.75));
        let grad = to_plain(tensor(5, d_model, 1.25));
        let values = |t: Tensor<P, 2>| t.into_data().to_vec::<f32>().unwrap();
        let (r, w, g) = (
            values(rows.clone()),
            values(weights.clone()),
            values(grad.clone()),
        );

        let y = values(Tensor::<P, 2>::from_primitive(TensorPrimitive::Float(
            combine_weighted_composed::<P>(
                rows.clone().into_primitive().tensor(),
                weights.clone().into_primitive().tensor(),
                &map,
            ),
        )));
        let (d_rows, d_weights) = combine_weighted_backward_composed::<P>(
            grad.into_primitive().tensor(),
            rows.into_primitive().tensor(),
            weights.into_primitive().tensor(),
            &map,
        );
        let d_rows = values(Tensor::from_primitive(TensorPrimitive::Float(d_rows)));
        let d_weights = values(Tensor::from_primitive(TensorPrimitive::Float(d_weights)));
        for t in 0..5 {
            for c in 0..d_model {
                let want: f64 = map
                    .tokens()
                    .rows_of(t)
                    .iter()
                    .map(|&row| w[map.slots().targets()[row]] as f64 * r[row * d_model + c] as f64)
                    .sum();
                assert!((y[t * d_model + c] as f64 - want).abs() < 1e-6, "y[{t}, {c}]");
            }
        }
        for s in 0..10 {
            let want: f64 = match map.row_of_slot(s) {
                None => 0.0,
                Some(row) => (0..d_model)
                    .map(|c| g[(s / 2) * d_model + c] as f64 * r[row * d_model + c] as f64)
                    .sum(),
            };
            assert!((d_weights[s] as f64 - want).abs() < 1e-6, "d_weights slot {s}");
        }
        for (row, &slot) in map.slots().targets().iter().enumerate() {
            for c in 0..d_model {
                let want = w[slot] as f64 * g[(slot / 2) * d_model + c] as f64;
                assert!(
                    (d_rows[row * d_model + c] as f64 - want).abs() < 1e-6,
                    "d_rows[{row}, {c}]"
                );
            }
        }
    }
}
