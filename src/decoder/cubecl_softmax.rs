//! Attention's weights on the CubeCL backends: the scaled, masked softmax over the keys in one
//! kernel forward and its backward in one, one cube per row of scores (a query of a head). The
//! same kernels take GPT-OSS's sinks in a second compile-time form: the head's sink joins the
//! row's maximum and sum, its share is written per row, and the backward writes each row's
//! term of the sink's gradient beside the scores'.
//!
//! Composed, the weights were seven kernels forward (the product by the scale, the mask fill,
//! the row maximum, the shift, `exp`, the row sum, the division), each a pass over the
//! `[batch, heads, seq, keys]` scores, and about fifteen backward under autodiff, in every
//! attention layer of every training step. Here a row's threads stride along its keys
//! (neighbouring threads read neighbouring keys) and meet in shared memory for the maximum and
//! the sum, as the norm's do (`cubecl_norm.rs`); the backward reads the weights the forward
//! wrote and the gradient once each for the row's dot product and once to write.
//!
//! Each thread computes in f32 whatever the tensors' float type; a hidden key is skipped in
//! the maximum and the sum and gets weight 0, which is what `-inf` through the composed
//! softmax gives it. The tests hold both kernels to the composed forms on WGPU
//! (`decoder/cubecl_tests.rs`).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use crate::cubecl_cube::{cube_max, cube_sum};
use crate::cubecl_launch::{cube_per_row, kernel_float, output};

/// Threads of a row's cube: one warp, as a row is a sequence's keys (tens to thousands).
const THREADS: usize = 32;

/// Where row `row` of `[batch, heads, seq, keys]` scores starts in `t`, read at its strides.
#[cube]
fn row_start<F: Float>(t: &Tensor<F>, row: usize, heads: usize, seq: usize) -> usize {
    let q = row % seq;
    let head = (row / seq) % heads;
    let batch = row / (seq * heads);
    batch * t.stride(0) + head * t.stride(1) + q * t.stride(2)
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn attention_softmax_kernel<F: Float, M: Int>(
    scores: &Tensor<F>,
    hidden: &Tensor<M>,
    sinks: &ComptimeOption<Tensor<F>>,
    out: &mut Tensor<F>,
    sink_out: &mut ComptimeOption<Tensor<F>>,
    n_rows: usize,
    heads: usize,
    seq: usize,
    keys: usize,
    mask_batch_stride: usize,
    scale: f32,
    #[comptime] threads: usize,
    #[define(F, M)] _dtypes: [StorageType; 2],
) {
    // A whole cube leaves together (one row per cube), so the barriers are reached by every
    // thread of every cube that stays.
    let row = CUBE_POS;
    if row >= n_rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let at = row_start(scores, row, heads, seq);
    let batch = row / (seq * heads);
    let mask_at = batch * mask_batch_stride + (row % seq) * hidden.stride(1);
    let (step, mask_step) = (scores.stride(3), hidden.stride(2));
    // Below any finite score: a thread whose keys are all hidden does not raise the maximum.
    let mut max = f32::new(-3.0e38);
    let mut k = unit;
    while k < keys {
        if u32::cast_from(hidden[mask_at + k * mask_step]) == 0u32 {
            max = f32::max(max, f32::cast_from(scores[at + k * step]) * scale);
        }
        k += threads;
    }
    let mut shared = SharedMemory::<f32>::new(threads);
    let mut max = cube_max(&mut shared, max, threads);
    // GPT-OSS's sink: one more logit per head, not scaled, in the maximum and the sum.
    let mut sink = 0.0f32;
    #[comptime]
    if let ComptimeOption::Some(sinks) = sinks {
        sink = f32::cast_from(sinks[((row / seq) % heads) * sinks.stride(0)]);
        max = f32::max(max, sink);
    }
    let mut sum = 0.0f32;
    let mut k = unit;
    while k < keys {
        if u32::cast_from(hidden[mask_at + k * mask_step]) == 0u32 {
            sum += f32::exp(f32::cast_from(scores[at + k * step]) * scale - max);
        }
        k += threads;
    }
    let mut sum = cube_sum(&mut shared, sum, threads);
    // The sinks and their shares come together (`softmax` passes both or neither).
    #[comptime]
    if let ComptimeOption::Some(sink_out) = sink_out {
        let share = f32::exp(sink - max);
        sum += share;
        if unit == 0 {
            sink_out[row] = F::cast_from(share / sum);
        }
    }
    let mut k = unit;
    while k < keys {
        let mut p = 0.0f32;
        if u32::cast_from(hidden[mask_at + k * mask_step]) == 0u32 {
            p = f32::exp(f32::cast_from(scores[at + k * step]) * scale - max) / sum;
        }
        out[row * keys + k] = F::cast_from(p);
        k += threads;
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn attention_softmax_backward_kernel<F: Float>(
    probs: &Tensor<F>,
    sink_probs: &ComptimeOption<Tensor<F>>,
    grad: &Tensor<F>,
    out: &mut Tensor<F>,
    sink_grad: &mut ComptimeOption<Tensor<F>>,
    n_rows: usize,
    heads: usize,
    seq: usize,
    keys: usize,
    scale: f32,
    #[comptime] threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= n_rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let (pa, ga) = (
        row_start(probs, row, heads, seq),
        row_start(grad, row, heads, seq),
    );
    let (ps, gs) = (probs.stride(3), grad.stride(3));
    let mut dot = 0.0f32;
    let mut k = unit;
    while k < keys {
        dot += f32::cast_from(grad[ga + k * gs]) * f32::cast_from(probs[pa + k * ps]);
        k += threads;
    }
    let mut shared = SharedMemory::<f32>::new(threads);
    let dot = cube_sum(&mut shared, dot, threads);
    // The sink's term of its head's gradient: the softmax's backward at the dropped column,
    // whose own gradient is 0.
    #[comptime]
    if let ComptimeOption::Some(sink_probs) = sink_probs {
        #[comptime]
        if let ComptimeOption::Some(sink_grad) = sink_grad {
            if unit == 0 {
                sink_grad[row] = F::cast_from(-(f32::cast_from(sink_probs[row]) * dot));
            }
        }
    }
    let mut k = unit;
    while k < keys {
        let p = f32::cast_from(probs[pa + k * ps]);
        let g = f32::cast_from(grad[ga + k * gs]);
        out[row * keys + k] = F::cast_from((g - dot) * p * scale);
        k += threads;
    }
}

/// `[batch, heads, seq, keys]` where `t` is a float tensor of the kernels' dtypes with four
/// dimensions and something in it.
fn dims4<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<[usize; 4]> {
    let dims = <[usize; 4]>::try_from(t.meta.shape().to_vec()).ok()?;
    (kernel_float(t) && dims.iter().product::<usize>() > 0).then_some(dims)
}

/// The weights in one kernel; `None` where the kernel does not read the tensors (the caller
/// composes them then): scores not a float tensor of four dimensions, or a mask that is not a
/// `[1 or batch, seq, keys]` bool tensor.
///
/// # Shapes
/// - scores: `[batch, heads, seq, keys]`, hidden: `[1 or batch, seq, keys]` → as scores
pub(crate) fn attention_softmax<R: CubeRuntime>(
    scores: &CubeTensor<R>,
    hidden: &CubeTensor<R>,
    scale: f64,
) -> Option<CubeTensor<R>> {
    softmax(scores, hidden, None, scale).map(|(probs, _)| probs)
}

/// The weights with a sink logit per head, and each row's sink share, in one kernel; `None`
/// where the kernel does not read the tensors (as [`attention_softmax`], or sinks that are not
/// `[heads]` of the scores' dtype).
///
/// # Shapes
/// - scores: `[batch, heads, seq, keys]`, hidden: `[1 or batch, seq, keys]`, sinks: `[heads]`
/// - returns `[batch, heads, seq, keys]` and `[batch, heads, seq]`
pub(crate) fn attention_softmax_sinks<R: CubeRuntime>(
    scores: &CubeTensor<R>,
    hidden: &CubeTensor<R>,
    sinks: &CubeTensor<R>,
    scale: f64,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let heads = dims4(scores)?[1];
    if sinks.dtype != scores.dtype || sinks.meta.shape().to_vec() != [heads] {
        return None;
    }
    let (probs, sink_probs) = softmax(scores, hidden, Some(sinks), scale)?;
    Some((probs, sink_probs?))
}

/// Both forms' launch: the weights, and the sink shares where `sinks` are given.
fn softmax<R: CubeRuntime>(
    scores: &CubeTensor<R>,
    hidden: &CubeTensor<R>,
    sinks: Option<&CubeTensor<R>>,
    scale: f64,
) -> Option<(CubeTensor<R>, Option<CubeTensor<R>>)> {
    let dims @ [batch, heads, seq, keys] = dims4(scores)?;
    let [rows, mask_seq, mask_keys] = <[usize; 3]>::try_from(hidden.meta.shape().to_vec()).ok()?;
    let fits = hidden.dtype.is_bool() && (rows == 1 || rows == batch) && [mask_seq, mask_keys] == [seq, keys];
    if !fits {
        return None;
    }
    // One mask row serves every batch row: its batch stride is read as 0.
    let mask_batch_stride = if rows == 1 { 0 } else { hidden.meta.strides()[0] };
    let out = output(scores, dims);
    let sink_out = sinks.map(|_| output(scores, [batch, heads, seq]));
    let n_rows = batch * heads * seq;
    let (count, dim) = cube_per_row(scores, n_rows, THREADS);
    // SAFETY: `scores` is read at its strides within `[batch, heads, seq, keys]`, `hidden` at
    // its strides within `[rows, seq, keys]` (row 0 alone where `rows` is 1), `sinks` at its
    // stride within `[heads]`; `out` holds `n_rows · keys` contiguous elements, each row
    // written by its cube, and `sink_out` `n_rows`, each written by its row's first thread;
    // cubes past the last row leave before reading.
    unsafe {
        attention_softmax_kernel::launch_unchecked(
            &scores.client,
            count,
            dim,
            scores.clone().into_tensor_arg(),
            hidden.clone().into_tensor_arg(),
            sinks.map(|t| t.clone().into_tensor_arg()).into(),
            out.clone().into_tensor_arg(),
            sink_out.clone().map(|t| t.into_tensor_arg()).into(),
            n_rows,
            heads,
            seq,
            keys,
            mask_batch_stride,
            scale as f32,
            THREADS,
            [scores.dtype.into(), hidden.dtype.into()],
        )
    };
    Some((out, sink_out))
}

/// The scores' gradient in one kernel; `None` where the kernel does not read the tensors.
///
/// # Shapes
/// - probs, grad: `[batch, heads, seq, keys]` → as probs
pub(crate) fn attention_softmax_backward<R: CubeRuntime>(
    probs: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    scale: f64,
) -> Option<CubeTensor<R>> {
    softmax_backward(probs, None, grad, scale).map(|(dscores, _)| dscores)
}

/// The scores' gradient and each row's term of its head's sink gradient,
/// `−p_sink · Σ_keys grad · probs`, in one kernel ([`per_head_sums`] adds the terms up);
/// `None` where the kernel does not read the tensors.
///
/// # Shapes
/// - probs, grad: `[batch, heads, seq, keys]`, sink_probs: `[batch, heads, seq]`
/// - returns `[batch, heads, seq, keys]` and `[batch, heads, seq]`
pub(crate) fn attention_softmax_sinks_backward<R: CubeRuntime>(
    probs: &CubeTensor<R>,
    sink_probs: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    scale: f64,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let [batch, heads, seq, _] = dims4(probs)?;
    // The kernel reads a row's share at the row's index.
    let fits = sink_probs.dtype == probs.dtype
        && sink_probs.meta.shape().to_vec() == [batch, heads, seq]
        && sink_probs.is_contiguous();
    if !fits {
        return None;
    }
    let (dscores, rows) = softmax_backward(probs, Some(sink_probs), grad, scale)?;
    Some((dscores, rows?))
}

/// Both forms' backward launch.
fn softmax_backward<R: CubeRuntime>(
    probs: &CubeTensor<R>,
    sink_probs: Option<&CubeTensor<R>>,
    grad: &CubeTensor<R>,
    scale: f64,
) -> Option<(CubeTensor<R>, Option<CubeTensor<R>>)> {
    let dims @ [batch, heads, seq, keys] = dims4(probs)?;
    if grad.dtype != probs.dtype || grad.meta.shape().to_vec() != dims {
        return None;
    }
    let out = output(probs, dims);
    let sink_grad = sink_probs.map(|_| output(probs, [batch, heads, seq]));
    let n_rows = batch * heads * seq;
    let (count, dim) = cube_per_row(probs, n_rows, THREADS);
    // SAFETY: as in `softmax`, both inputs read at their strides within their shapes,
    // `sink_probs` (contiguous) at row indices below `n_rows`; `out` `n_rows · keys`
    // contiguous elements, each row written by its cube, `sink_grad` `n_rows`, each written by
    // its row's first thread.
    unsafe {
        attention_softmax_backward_kernel::launch_unchecked(
            &probs.client,
            count,
            dim,
            probs.clone().into_tensor_arg(),
            sink_probs.map(|t| t.clone().into_tensor_arg()).into(),
            grad.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            sink_grad.clone().map(|t| t.into_tensor_arg()).into(),
            n_rows,
            heads,
            seq,
            keys,
            scale as f32,
            THREADS,
            probs.dtype.into(),
        )
    };
    Some((out, sink_grad))
}

/// Each head's sum of the `[batch, heads, seq]` row terms: `[heads]`.
pub(crate) fn per_head_sums<B: Backend>(rows: FloatTensor<B>) -> FloatTensor<B> {
    let heads = rows.shape()[1];
    let per_head = B::float_sum_dim(B::float_sum_dim(rows, 2), 0);
    B::float_reshape(per_head, Shape::new([heads]))
}
