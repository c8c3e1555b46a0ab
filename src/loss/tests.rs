//! The cross-entropy against its mathematics in `f64`, on the composed kernels (NdArray) and
//! Flex's, forward and gradient, and Flex's kernels against their composed twins.

use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex, NdArray};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};

use super::{cross_entropy, token_nll_backward_composed, token_nll_forward_composed, LossKernels};

/// Rows of logits over an odd vocabulary (the kernels' 8-wide tail), spread wide enough that
/// the max shift matters, with one row holding `−∞` entries.
fn logits(n_tokens: usize, vocab: usize) -> Vec<f32> {
    let mut values: Vec<f32> = (0..n_tokens * vocab)
        .map(|i| ((i * 7919 % 4001) as f32 / 4001.0 - 0.5) * 60.0 + (i / vocab) as f32)
        .collect();
    values[3 * vocab + 5] = f32::NEG_INFINITY;
    values[3 * vocab + 11] = f32::NEG_INFINITY;
    values
}

/// Targets cycling through the vocabulary, with two rows ignored (−1 and PyTorch's −100).
fn targets(n_tokens: usize, vocab: usize) -> Vec<i64> {
    (0..n_tokens)
        .map(|r| match r {
            2 => -1,
            9 => -100,
            _ => ((r * 577) % vocab) as i64,
        })
        .collect()
}

/// Each row's weight in the loss `Σ w_r · nll_r`: all different, so that a gradient scaled by
/// another row's weight shows.
fn weights(n_tokens: usize) -> Vec<f32> {
    (0..n_tokens).map(|r| 0.5 + r as f32 / n_tokens as f32).collect()
}

/// `Σ w_r · nll_r` and its gradient, in `f64` from the definition.
fn expected(logits: &[f32], targets: &[i64], weights: &[f32], vocab: usize) -> (f64, Vec<f64>) {
    let mut loss = 0.0;
    let mut grad = vec![0.0; logits.len()];
    for (r, row) in logits.chunks(vocab).enumerate() {
        let Ok(t) = usize::try_from(targets[r]) else {
            continue;
        };
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let sum: f64 = row.iter().map(|&x| (f64::from(x) - max).exp()).sum();
        let lse = max + sum.ln();
        let w = f64::from(weights[r]);
        loss += w * (lse - f64::from(row[t]));
        for (j, &x) in row.iter().enumerate() {
            grad[r * vocab + j] = w * ((f64::from(x) - lse).exp() - f64::from(u8::from(j == t)));
        }
    }
    (loss, grad)
}

/// `Σ w_r · nll_r` through [`LossKernels::token_nll`] and the logits' gradient, on `B`.
fn weighted<B: AutodiffBackend + LossKernels>(
    logits: &[f32],
    targets: &[i64],
    weights: &[f32],
    vocab: usize,
) -> (f64, Vec<f32>) {
    let device = Default::default();
    let n_tokens = targets.len();
    let x = Tensor::<B, 2>::from_data(TensorData::new(logits.to_vec(), [n_tokens, vocab]), &device)
        .require_grad();
    let t = Tensor::<B, 1, Int>::from_data(TensorData::new(targets.to_vec(), [n_tokens]), &device);
    let w = Tensor::<B, 1>::from_data(TensorData::new(weights.to_vec(), [n_tokens]), &device);
    let nll = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::token_nll(
        x.clone().into_primitive().tensor(),
        t.into_primitive(),
    )));
    let loss = (nll * w).sum();
    let grads = loss.backward();
    let grad = x.grad(&grads).expect("the logits take a gradient");
    let loss = loss.into_scalar();
    (num(loss), grad.into_data().iter::<f32>().collect())
}

fn num<E: burn::tensor::ElementConversion>(e: E) -> f64 {
    e.elem::<f64>()
}

fn assert_close(got: &[f32], want: &[f64], tolerance: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(
            err <= tolerance * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

#[test]
fn token_nll_and_its_gradient_equal_the_f64_formula_on_the_composed_and_flex_kernels() {
    // 37 rows of 1,003: more than one rayon task of Flex's (32 rows each at this width).
    let (n_tokens, vocab) = (37, 1003);
    let (x, t, w) = (
        logits(n_tokens, vocab),
        targets(n_tokens, vocab),
        weights(n_tokens),
    );
    let (want_loss, want_grad) = expected(&x, &t, &w, vocab);
    for (name, (loss, grad)) in [
        (
            "composed (NdArray)",
            weighted::<Autodiff<NdArray>>(&x, &t, &w, vocab),
        ),
        ("Flex", weighted::<Autodiff<Flex>>(&x, &t, &w, vocab)),
    ] {
        assert!(
            (loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
            "{name}: loss {loss}, want {want_loss}"
        );
        assert_close(&grad, &want_grad, 1e-6, name);
        // Ignored rows take no gradient at all.
        for r in [2, 9] {
            assert!(
                grad[r * vocab..(r + 1) * vocab].iter().all(|&g| g == 0.0),
                "{name}: row {r}"
            );
        }
    }
}

#[test]
fn cross_entropy_is_the_mean_over_the_counted_rows() {
    let (n_tokens, vocab) = (11, 37);
    let (x, t) = (logits(n_tokens, vocab), targets(n_tokens, vocab));
    let counted = t.iter().filter(|&&t| t >= 0).count();
    let ones = vec![1.0 / counted as f32; n_tokens];
    let (want_loss, want_grad) = expected(&x, &t, &ones, vocab);
    let device = Default::default();
    type B = Autodiff<Flex>;
    let logits = Tensor::<B, 2>::from_data(TensorData::new(x, [n_tokens, vocab]), &device).require_grad();
    let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(t, [n_tokens]), &device);
    let loss = cross_entropy(logits.clone(), targets);
    let grads = loss.backward();
    let grad: Vec<f32> = logits
        .grad(&grads)
        .expect("a gradient")
        .into_data()
        .iter::<f32>()
        .collect();
    let loss = num(loss.into_scalar());
    assert!(
        (loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
        "loss {loss}, want {want_loss}"
    );
    assert_close(&grad, &want_grad, 1e-6, "mean");
}

fn flex(values: Vec<f32>, shape: Vec<usize>) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

fn flex_ints(values: &[i64]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values.to_vec(), [values.len()]))
}

fn values_of(t: FlexTensor) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

/// Flex's kernels against their composed twins on Flex itself: the same rows, log-sum-exps
/// and gradient to float rounding.
#[test]
fn flex_kernels_equal_their_composed_twins() {
    let (n_tokens, vocab) = (40, 517);
    let (x, t, w) = (
        logits(n_tokens, vocab),
        targets(n_tokens, vocab),
        weights(n_tokens),
    );
    let shape = vec![n_tokens, vocab];
    let (nll, lse) = <Flex as LossKernels>::token_nll_forward(flex(x.clone(), shape.clone()), flex_ints(&t));
    let (nll_twin, lse_twin) =
        token_nll_forward_composed::<Flex>(flex(x.clone(), shape.clone()), flex_ints(&t));
    let (lse, lse_twin) = (values_of(lse), values_of(lse_twin));
    let as_f64 = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<f64>>();
    assert_close(&values_of(nll), &as_f64(&values_of(nll_twin)), 1e-6, "nll");
    assert_close(&lse, &as_f64(&lse_twin), 1e-6, "lse");
    let column = |v: &[f32]| flex(v.to_vec(), vec![n_tokens]);
    let grad = <Flex as LossKernels>::token_nll_backward(
        flex(x.clone(), shape.clone()),
        flex_ints(&t),
        column(&lse),
        column(&w),
    );
    let twin = token_nll_backward_composed::<Flex>(flex(x, shape), flex_ints(&t), column(&lse), column(&w));
    assert_close(&values_of(grad), &as_f64(&values_of(twin)), 1e-6, "gradient");
}

#[test]
fn a_row_with_a_nan_or_an_infinite_max_follows_the_limit() {
    let vocab = 19;
    let mut x = vec![0.5f32; 3 * vocab];
    x[4] = f32::NAN;
    x[vocab + 7] = f32::INFINITY;
    for v in &mut x[2 * vocab..] {
        *v = f32::NEG_INFINITY;
    }
    let (_, lse) = <Flex as LossKernels>::token_nll_forward(flex(x, vec![3, vocab]), flex_ints(&[0, 0, 0]));
    let lse = values_of(lse);
    assert!(
        lse[0].is_nan(),
        "a NaN logit makes the row's log-sum-exp NaN: {}",
        lse[0]
    );
    assert_eq!(lse[1], f32::INFINITY);
    assert_eq!(lse[2], f32::NEG_INFINITY);
}

#[test]
#[should_panic(expected = "outside the vocabulary of 5 columns")]
fn a_target_past_the_vocabulary_is_refused() {
    let _ = <Flex as LossKernels>::token_nll_forward(flex(vec![0.0; 10], vec![2, 5]), flex_ints(&[1, 5]));
}
