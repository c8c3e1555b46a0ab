//! The router's nodes (`autodiff.rs`) against burn's autodiff through the composed forms:
//! scores and weights bit for bit, the logits' gradient within f32 rounding, on NdArray and
//! Flex, for both scorings, with and without normalisation and scaling.

use burn::backend::{Autodiff, Flex, NdArray};
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Distribution, Int, Tensor, TensorCreationOptions, TensorData, TensorPrimitive};

use super::{PickRule, RouterKernels, Scoring};

const N_TOKENS: usize = 13;
const N_EXPERTS: usize = 8;

/// Each token's `top_k` experts, distinct, in an order that is not the scores' (the pick must
/// follow the choice it is given, not re-sort it).
fn choice(top_k: usize) -> Vec<usize> {
    (0..N_TOKENS)
        .flat_map(|t| (0..top_k).map(move |j| (t * 5 + j * 3) % N_EXPERTS))
        .collect()
}

/// What the layer computed before the router had nodes of its own, op by op.
fn reference<B: AutodiffBackend>(
    logits: Tensor<B, 2>,
    indices: &[usize],
    top_k: usize,
    scoring: Scoring,
    rule: PickRule,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let scores = match scoring {
        Scoring::Softmax => softmax(logits, 1),
        Scoring::Sigmoid => sigmoid(logits),
    };
    let index = TensorData::new(
        indices.iter().map(|&i| i as i64).collect::<Vec<_>>(),
        [N_TOKENS, top_k],
    );
    let mut chosen = scores
        .clone()
        .gather(1, Tensor::<B, 2, Int>::from_data(index, &scores.device()));
    if rule.normalize {
        let sum = chosen.clone().sum_dim(1);
        chosen = if rule.eps == 0.0 {
            chosen / sum
        } else {
            chosen / sum.add_scalar(rule.eps)
        };
    }
    if rule.scaling != 1.0 {
        chosen = chosen * rule.scaling;
    }
    (scores, chosen)
}

fn through_nodes<B: AutodiffBackend + RouterKernels>(
    logits: Tensor<B, 2>,
    indices: &[usize],
    top_k: usize,
    scoring: Scoring,
    rule: PickRule,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let float = |t| Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t));
    let scores = float(B::router_scores(logits.into_primitive().tensor(), scoring));
    let weights = float(B::router_pick(
        scores.clone().into_primitive().tensor(),
        indices,
        top_k,
        rule,
    ));
    (scores, weights)
}

/// Both ways on backend `B`: scores and weights bit for bit, and the logits' gradient of a
/// loss that reads both (as the layer's combine and its load-balancing loss do) within `tol`.
fn agree<B: AutodiffBackend + RouterKernels>(tol: f32) {
    let device = Default::default();
    let logits = Tensor::<B, 2>::random([N_TOKENS, N_EXPERTS], Distribution::Normal(0.0, 2.0), &device);
    let on_scores = Tensor::<B, 2>::random([N_TOKENS, N_EXPERTS], Distribution::Default, &device);
    for scoring in [Scoring::Softmax, Scoring::Sigmoid] {
        for top_k in [1, 3] {
            for (normalize, scaling) in [(false, 1.0), (true, 1.0), (true, 2.5), (false, 0.75)] {
                let eps = if scoring == Scoring::Sigmoid { 1e-20 } else { 0.0 };
                let rule = PickRule {
                    normalize,
                    eps,
                    scaling,
                };
                let indices = choice(top_k);
                let on_weights = Tensor::<B, 2>::random([N_TOKENS, top_k], Distribution::Default, &device);
                let run = |nodes: bool| {
                    let x = logits.clone().require_grad();
                    let (scores, weights) = match nodes {
                        true => through_nodes(x.clone(), &indices, top_k, scoring, rule),
                        false => reference(x.clone(), &indices, top_k, scoring, rule),
                    };
                    let loss = (weights.clone() * on_weights.clone()).sum()
                        + (scores.clone() * on_scores.clone()).sum();
                    let grads = loss.backward();
                    let grad = x.grad(&grads).expect("the logits take a gradient");
                    (
                        scores.inner().into_data(),
                        weights.inner().into_data(),
                        grad.into_data(),
                    )
                };
                let (scores, weights, grad) = run(true);
                let (want_scores, want_weights, want_grad) = run(false);
                let what = format!("{scoring:?} top_k {top_k} {rule:?}");
                close(&what, "score", scores, want_scores, tol);
                close(&what, "weight", weights, want_weights, tol);
                close(&what, "logit gradient", grad, want_grad, tol);
            }
        }
    }
}

/// Every element of `got` within `tol` of `want`, relative to `want`'s largest magnitude.
fn close(what: &str, name: &str, got: TensorData, want: TensorData, tol: f32) {
    let (got, want) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(scale > 0.0, "{what}: every {name} is zero");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= tol * scale, "{what}: {name} {i} is {g}, not {w}");
    }
}

// Both backends' forms differ from burn's autodiff in the order of their f32 operations only:
// Flex's own softmax is not the one `Autodiff<Flex>` composes, and the backward forms sum in
// another order than the chain of burn's nodes. A wrong scale, expert or sign is off by far
// more than 1e-5.
#[test]
fn the_nodes_match_burns_autodiff_on_ndarray() {
    agree::<Autodiff<NdArray>>(1e-5);
}

#[test]
fn the_nodes_match_burns_autodiff_on_flex() {
    agree::<Autodiff<Flex>>(1e-5);
}

/// The pick's backward against central differences of its forward in float64, one score at a
/// time: an independent check of the formula, which the comparisons above make only through
/// burn's autodiff.
#[test]
fn the_picks_backward_matches_central_differences_in_float64() {
    type B = NdArray<f64>;
    let device = Default::default();
    let values = |n: usize, seed: usize| -> Vec<f64> {
        (0..n)
            .map(|i| ((i * 7919 + seed * 104_729) % 1000) as f64 / 250.0 - 2.0)
            .collect()
    };
    // The dtype named: a tensor created without one takes the device's default, which the
    // f32 tests in this process share.
    let f64s = |v: Vec<f64>, shape: [usize; 2]| {
        let options = TensorCreationOptions::new(device).with_dtype(DType::F64);
        Tensor::<B, 2>::from_data(TensorData::new(v, shape), options)
    };
    let logits = f64s(values(N_TOKENS * N_EXPERTS, 1), [N_TOKENS, N_EXPERTS]);
    let grad = f64s(values(N_TOKENS * 2, 2), [N_TOKENS, 2]);
    assert_eq!(logits.dtype(), DType::F64, "the check needs float64 tensors");
    let indices = choice(2);
    let rule = PickRule {
        normalize: true,
        eps: 0.0,
        scaling: 2.5,
    };
    // The weights' gradient by central differences on the scores, one score at a time.
    let scores = softmax(logits, 1);
    let pick = |s: Tensor<B, 2>| {
        let w = B::router_pick(s.into_primitive().tensor(), &indices, 2, rule);
        (Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(w)) * grad.clone())
            .sum()
            .into_scalar()
    };
    let analytic = B::router_pick_backward(
        scores.clone().into_primitive().tensor(),
        &indices,
        2,
        grad.clone().into_primitive().tensor(),
        rule,
    );
    let analytic = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(analytic))
        .into_data()
        .to_vec::<f64>()
        .unwrap();
    let base = scores.clone().into_data().to_vec::<f64>().unwrap();
    for i in 0..N_TOKENS * N_EXPERTS {
        let at = |delta: f64| {
            let mut v = base.clone();
            v[i] += delta;
            pick(f64s(v, [N_TOKENS, N_EXPERTS]))
        };
        let numeric = (at(1e-6) - at(-1e-6)) / 2e-6;
        assert!(
            (numeric - analytic[i]).abs() < 1e-7,
            "score {i}: {numeric} by differences, {} by the backward",
            analytic[i]
        );
    }
}
