//! The token cross-entropy on Flex: the rows over the pool, one pass each way.
//!
//! Composed from burn's ops, a language model's loss over `[n_tokens, vocab]` logits runs
//! `log_softmax` (max, subtract, exp, sum, log, subtract), `gather`, and in backward as many
//! ops again plus a scatter onto zeros: each a pass over the whole logits into a fresh tensor,
//! on one thread while the pool waits. For the 163 M Qwen3-MoE of BENCHMARKS §13 (512 tokens,
//! vocabulary 8,192) that took about 150 ms of a 1.4 s fine-tuning step on this project's
//! 2-core VM. Here each row's max, log-sum-exp and target are one pass over the row, and
//! its gradient one more, rows split over the pool's threads; the exponential is
//! `gelu_math`'s polynomial (every argument is `≤ 0` after the shift), which the compiler
//! vectorises where `libm`'s `expf` is a call per element.

use std::mem::MaybeUninit;

use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::{DType, Shape, TensorData};
use rayon::prelude::*;

use super::kernels::{token_nll_backward_composed, token_nll_forward_composed};
use crate::experts::gelu_math::{exp_non_positive, has_avx2};

/// Logit values per rayon task: enough that the split costs nothing next to the work.
const VALUES_PER_TASK: usize = 1 << 15;

/// The logits as one contiguous `f32` slice with `(n_tokens, vocab)`, where they are one.
fn rows_of(logits: &FlexTensor) -> Option<(&[f32], usize, usize)> {
    let dims = logits.layout().shape().to_vec();
    if logits.dtype() != DType::F32 || dims.len() != 2 || dims[0] == 0 || dims[1] == 0 {
        return None;
    }
    let (start, end) = logits.layout().contiguous_offsets()?;
    Some((&logits.storage::<f32>()[start..end], dims[0], dims[1]))
}

/// The targets as `i64`, each checked to index a column of `vocab`; negative ones are kept
/// (ignored rows).
///
/// # Panics
/// If a target is `vocab` or more, as burn's `gather` does.
fn targets_of(targets: &FlexTensor, vocab: usize) -> Vec<i64> {
    let data = targets.clone().into_data();
    let targets: Vec<i64> = data.iter::<i64>().collect();
    if let Some(bad) = targets.iter().find(|&&t| t >= vocab as i64) {
        panic!("cross-entropy: target {bad} is outside the vocabulary of {vocab} columns");
    }
    targets
}

/// Rows per task for rows of `vocab` values.
fn rows_per_task(vocab: usize) -> usize {
    (VALUES_PER_TASK / vocab).max(1)
}

/// `log Σ exp(row)`, shifted by the row's max; a row whose max is infinite has that max as
/// its value (or NaN if it holds a NaN), as the limit of the sum is.
#[inline(always)]
fn row_lse(row: &[f32]) -> f32 {
    let greater = |a: f32, b: f32| if b > a { b } else { a };
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks.clone() {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = greater(*lane, x);
        }
    }
    // A NaN is never greater, so it does not become the max; the sum below turns NaN.
    let max = lanes
        .into_iter()
        .chain(tail.iter().copied())
        .fold(f32::NEG_INFINITY, greater);
    if !max.is_finite() {
        return if row.iter().any(|x| x.is_nan()) {
            f32::NAN
        } else {
            max
        };
    }
    let mut sums = [0f32; 8];
    for chunk in chunks {
        for (sum, &x) in sums.iter_mut().zip(chunk) {
            *sum += exp_non_positive(x - max);
        }
    }
    let tail: f32 = tail.iter().map(|&x| exp_non_positive(x - max)).sum();
    let total =
        ((sums[0] + sums[4]) + (sums[1] + sums[5])) + ((sums[2] + sums[6]) + (sums[3] + sums[7])) + tail;
    max + total.ln()
}

/// Forward over whole rows: each row's `nll` and `lse`.
#[inline(always)]
fn forward_rows_plain(rows: &[f32], vocab: usize, targets: &[i64], nll: &mut [f32], lse: &mut [f32]) {
    for (((row, &t), nll), lse) in rows.chunks_exact(vocab).zip(targets).zip(nll).zip(lse) {
        *lse = row_lse(row);
        *nll = match usize::try_from(t) {
            Ok(t) => *lse - row[t],
            Err(_) => 0.0,
        };
    }
}

/// Backward over whole rows: `(exp(row − lse) − onehot) · grad`, zeros on ignored rows.
#[inline(always)]
fn backward_rows_plain(
    rows: &[f32],
    vocab: usize,
    targets: &[i64],
    lse: &[f32],
    grad: &[f32],
    out: &mut [MaybeUninit<f32>],
) {
    let per_row = rows.chunks_exact(vocab).zip(out.chunks_exact_mut(vocab));
    for ((((row, out), &t), &lse), &g) in per_row.zip(targets).zip(lse).zip(grad) {
        let Ok(t) = usize::try_from(t) else {
            for o in out.iter_mut() {
                o.write(0.0);
            }
            continue;
        };
        for (o, &x) in out.iter_mut().zip(row) {
            o.write(exp_non_positive(x - lse) * g);
        }
        // The target's column takes `−grad` on top, as the composed twin's scatter adds it.
        out[t].write(exp_non_positive(row[t] - lse) * g + -g);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn forward_rows_avx2(rows: &[f32], vocab: usize, targets: &[i64], nll: &mut [f32], lse: &mut [f32]) {
    forward_rows_plain(rows, vocab, targets, nll, lse)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn backward_rows_avx2(
    rows: &[f32],
    vocab: usize,
    targets: &[i64],
    lse: &[f32],
    grad: &[f32],
    out: &mut [MaybeUninit<f32>],
) {
    backward_rows_plain(rows, vocab, targets, lse, grad, out)
}

fn forward_rows(rows: &[f32], vocab: usize, targets: &[i64], nll: &mut [f32], lse: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { forward_rows_avx2(rows, vocab, targets, nll, lse) };
    }
    forward_rows_plain(rows, vocab, targets, nll, lse)
}

fn backward_rows(
    rows: &[f32],
    vocab: usize,
    targets: &[i64],
    lse: &[f32],
    grad: &[f32],
    out: &mut [MaybeUninit<f32>],
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { backward_rows_avx2(rows, vocab, targets, lse, grad, out) };
    }
    backward_rows_plain(rows, vocab, targets, lse, grad, out)
}

fn vector(values: Vec<f32>) -> FlexTensor {
    let n = values.len();
    FlexTensor::from_data(TensorData::new(values, Shape::new([n])))
}

/// [`LossKernels::token_nll_forward`](super::LossKernels::token_nll_forward) on Flex; other
/// dtypes and strided logits take the composed twin.
pub(super) fn token_nll_forward(logits: FlexTensor, targets: FlexTensor) -> (FlexTensor, FlexTensor) {
    let Some((values, n_tokens, vocab)) = rows_of(&logits) else {
        return token_nll_forward_composed::<Flex>(logits, targets);
    };
    let targets = targets_of(&targets, vocab);
    assert_eq!(
        targets.len(),
        n_tokens,
        "cross-entropy: {n_tokens} rows of logits, {} targets",
        targets.len()
    );
    let (mut nll, mut lse) = (vec![0f32; n_tokens], vec![0f32; n_tokens]);
    let rows = rows_per_task(vocab);
    values
        .par_chunks(rows * vocab)
        .zip(targets.par_chunks(rows))
        .zip(nll.par_chunks_mut(rows))
        .zip(lse.par_chunks_mut(rows))
        .for_each(|(((values, targets), nll), lse)| forward_rows(values, vocab, targets, nll, lse));
    (vector(nll), vector(lse))
}

/// [`LossKernels::token_nll_backward`](super::LossKernels::token_nll_backward) on Flex; other
/// dtypes and strided logits take the composed twin.
pub(super) fn token_nll_backward(
    logits: FlexTensor,
    targets: FlexTensor,
    lse: FlexTensor,
    grad: FlexTensor,
) -> FlexTensor {
    let plain = |t: &FlexTensor| t.dtype() == DType::F32;
    let Some((values, n_tokens, vocab)) = rows_of(&logits).filter(|_| plain(&lse) && plain(&grad)) else {
        return token_nll_backward_composed::<Flex>(logits, targets, lse, grad);
    };
    let targets = targets_of(&targets, vocab);
    let lse: Vec<f32> = lse.into_data().iter::<f32>().collect();
    let grad: Vec<f32> = grad.into_data().iter::<f32>().collect();
    assert!(
        targets.len() == n_tokens && lse.len() == n_tokens && grad.len() == n_tokens,
        "cross-entropy backward: {n_tokens} rows, {} targets, {} lse, {} grads",
        targets.len(),
        lse.len(),
        grad.len()
    );
    let len = n_tokens * vocab;
    let mut out: Vec<f32> = Vec::with_capacity(len);
    let rows = rows_per_task(vocab);
    out.spare_capacity_mut()[..len]
        .par_chunks_mut(rows * vocab)
        .zip(values.par_chunks(rows * vocab))
        .zip(targets.par_chunks(rows))
        .zip(lse.par_chunks(rows))
        .zip(grad.par_chunks(rows))
        .for_each(|((((out, values), targets), lse), grad)| {
            backward_rows(values, vocab, targets, lse, grad, out)
        });
    // SAFETY: `backward_rows` wrote each of the `len` values: every row is a target's or an
    // ignored one, and both write the row whole.
    unsafe { out.set_len(len) };
    FlexTensor::from_data(TensorData::new(out, Shape::new([n_tokens, vocab])))
}
