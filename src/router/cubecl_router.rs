//! The router's scores and picked weights on the CubeCL backends (CUDA, ROCm, WGPU): one kernel
//! each way for each, one thread per token. A router row is `n_experts` values (8 to a few
//! hundred), so a thread walks its row; composed from burn's ops the same work took five
//! kernels for a softmax and four for the pick forward, and more backward, each a launch.
//!
//! Each thread computes in f32 whatever the tensors' float type (the composed forms reduce in
//! the tensors' type), and reads its inputs at their strides. The tests hold the kernels to the
//! composed forms on WGPU, outputs and gradients (`router/cubecl_tests.rs`).

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::cubecl::server::Handle;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use super::kernels::PickRule;
use super::Scoring;
use crate::cubecl_launch::{grid, kernel_float, output, upload_u32};

#[cube(launch_unchecked)]
fn softmax_kernel<F: Float>(
    logits: &Tensor<F>,
    out: &mut Tensor<F>,
    n_tokens: usize,
    width: usize,
    #[define(F)] _dtype: StorageType,
) {
    let t = ABSOLUTE_POS;
    if t >= n_tokens {
        terminate!();
    }
    let row = t * logits.stride(0);
    let column = logits.stride(1);
    let max = row_max::<F>(logits, row, column, width);
    let sum = row_exp_sum::<F>(logits, row, column, width, max);
    for e in 0..width {
        out[t * width + e] = F::cast_from(f32::exp(f32::cast_from(logits[row + e * column]) - max) / sum);
    }
}

/// The largest of the `width` values of the row that starts at `row`, `column` apart.
#[cube]
pub(super) fn row_max<F: Float>(logits: &Tensor<F>, row: usize, column: usize, width: usize) -> f32 {
    let mut max = f32::cast_from(logits[row]);
    for e in 1..width {
        max = f32::max(max, f32::cast_from(logits[row + e * column]));
    }
    max
}

/// `Σ exp(value − max)` over the same row: the softmax's denominator, shifted so that `exp`
/// cannot overflow.
#[cube]
pub(super) fn row_exp_sum<F: Float>(
    logits: &Tensor<F>,
    row: usize,
    column: usize,
    width: usize,
    max: f32,
) -> f32 {
    let mut sum = 0.0f32;
    for e in 0..width {
        sum += f32::exp(f32::cast_from(logits[row + e * column]) - max);
    }
    sum
}

#[cube(launch_unchecked)]
fn sigmoid_kernel<F: Float>(
    logits: &Tensor<F>,
    out: &mut Tensor<F>,
    width: usize,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= out.len() {
        terminate!();
    }
    let t = ABSOLUTE_POS / width;
    let e = ABSOLUTE_POS % width;
    let x = f32::cast_from(logits[t * logits.stride(0) + e * logits.stride(1)]);
    out[ABSOLUTE_POS] = F::cast_from(1.0f32 / (1.0f32 + f32::exp(-x)));
}

#[cube(launch_unchecked)]
fn softmax_backward_kernel<F: Float>(
    scores: &Tensor<F>,
    grad: &Tensor<F>,
    out: &mut Tensor<F>,
    n_tokens: usize,
    width: usize,
    #[define(F)] _dtype: StorageType,
) {
    let t = ABSOLUTE_POS;
    if t >= n_tokens {
        terminate!();
    }
    let (s_row, s_col) = (t * scores.stride(0), scores.stride(1));
    let (g_row, g_col) = (t * grad.stride(0), grad.stride(1));
    let mut dot = 0.0f32;
    for e in 0..width {
        dot += f32::cast_from(grad[g_row + e * g_col]) * f32::cast_from(scores[s_row + e * s_col]);
    }
    for e in 0..width {
        let s = f32::cast_from(scores[s_row + e * s_col]);
        out[t * width + e] = F::cast_from(s * (f32::cast_from(grad[g_row + e * g_col]) - dot));
    }
}

#[cube(launch_unchecked)]
fn sigmoid_backward_kernel<F: Float>(
    scores: &Tensor<F>,
    grad: &Tensor<F>,
    out: &mut Tensor<F>,
    width: usize,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= out.len() {
        terminate!();
    }
    let t = ABSOLUTE_POS / width;
    let e = ABSOLUTE_POS % width;
    let s = f32::cast_from(scores[t * scores.stride(0) + e * scores.stride(1)]);
    let g = f32::cast_from(grad[t * grad.stride(0) + e * grad.stride(1)]);
    out[ABSOLUTE_POS] = F::cast_from(g * s * (1.0f32 - s));
}

/// One token's sum of its chosen scores plus `eps`, with `normalize` as 1; `1` without.
#[cube]
fn pick_sum<F: Float>(
    scores: &Tensor<F>,
    indices: &Array<u32>,
    t: usize,
    top_k: usize,
    normalize: u32,
    eps: f32,
) -> f32 {
    let mut sum = 1.0f32;
    if normalize == 1 {
        sum = 0.0f32;
        for j in 0..top_k {
            let e = indices[t * top_k + j] as usize;
            sum += f32::cast_from(scores[t * scores.stride(0) + e * scores.stride(1)]);
        }
        sum += eps;
    }
    sum
}

#[cube(launch_unchecked)]
fn pick_kernel<F: Float>(
    scores: &Tensor<F>,
    indices: &Array<u32>,
    out: &mut Tensor<F>,
    n_tokens: usize,
    top_k: usize,
    normalize: u32,
    eps: f32,
    scaling: f32,
    #[define(F)] _dtype: StorageType,
) {
    let t = ABSOLUTE_POS;
    if t >= n_tokens {
        terminate!();
    }
    let sum = pick_sum::<F>(scores, indices, t, top_k, normalize, eps);
    for j in 0..top_k {
        let e = indices[t * top_k + j] as usize;
        let c = f32::cast_from(scores[t * scores.stride(0) + e * scores.stride(1)]);
        out[t * top_k + j] = F::cast_from(c / sum * scaling);
    }
}

#[cube(launch_unchecked)]
fn pick_backward_kernel<F: Float>(
    scores: &Tensor<F>,
    indices: &Array<u32>,
    grad: &Tensor<F>,
    out: &mut Tensor<F>,
    n_tokens: usize,
    width: usize,
    top_k: usize,
    normalize: u32,
    eps: f32,
    scaling: f32,
    #[define(F)] _dtype: StorageType,
) {
    let t = ABSOLUTE_POS;
    if t >= n_tokens {
        terminate!();
    }
    let sum = pick_sum::<F>(scores, indices, t, top_k, normalize, eps);
    // Σ_l g_l · c_l / S: what every chosen score's gradient loses to the normalisation.
    let mut dot = 0.0f32;
    if normalize == 1 {
        for j in 0..top_k {
            let e = indices[t * top_k + j] as usize;
            let c = f32::cast_from(scores[t * scores.stride(0) + e * scores.stride(1)]);
            dot += f32::cast_from(grad[t * grad.stride(0) + j * grad.stride(1)]) * scaling * c;
        }
        dot /= sum;
    }
    for e in 0..width {
        out[t * width + e] = F::new(0.0);
    }
    for j in 0..top_k {
        let e = indices[t * top_k + j] as usize;
        let g = f32::cast_from(grad[t * grad.stride(0) + j * grad.stride(1)]) * scaling;
        let d = (g - dot) / sum;
        out[t * width + e] = F::cast_from(f32::cast_from(out[t * width + e]) + d);
    }
}

/// Whether the kernels read `t`: a float tensor of the kernels' dtypes with two dimensions
/// (any strides: the kernels index by them).
fn readable<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<[usize; 2]> {
    let dims = <[usize; 2]>::try_from(t.meta.shape().to_vec()).ok()?;
    kernel_float(t).then_some(dims)
}

/// The choice as `u32`s on the device; `None` when an index is not a column of `n_experts`
/// or the choice is not `n_tokens · top_k` long (the caller's composed form then holds the
/// contract: burn's `gather` refuses it).
fn upload<R: CubeRuntime>(
    like: &CubeTensor<R>,
    indices: &[usize],
    [n_tokens, n_experts]: [usize; 2],
    top_k: usize,
) -> Option<Handle> {
    if indices.len() != n_tokens.checked_mul(top_k)? || indices.iter().any(|&e| e >= n_experts) {
        return None;
    }
    upload_u32(like, indices.iter().copied())
}

fn flag(rule: &PickRule) -> u32 {
    u32::from(rule.normalize)
}

/// The scores in one kernel; `None` for a tensor the kernel does not read or with no element.
///
/// # Shapes
/// - logits: `[n_tokens, n_experts]` → `[n_tokens, n_experts]`
pub(crate) fn scores<R: CubeRuntime>(logits: &CubeTensor<R>, scoring: Scoring) -> Option<CubeTensor<R>> {
    let [n_tokens, width] = readable(logits)?;
    if n_tokens * width == 0 {
        return None;
    }
    let out = output(logits, [n_tokens, width]);
    // SAFETY: the kernels read `logits` at its strides within its `[n_tokens, width]` shape and
    // write `out`'s `n_tokens · width` contiguous elements, each bounding its index.
    unsafe {
        match scoring {
            Scoring::Softmax => {
                let (count, dim) = grid(logits, n_tokens);
                softmax_kernel::launch_unchecked(
                    &logits.client,
                    count,
                    dim,
                    logits.clone().into_tensor_arg(),
                    out.clone().into_tensor_arg(),
                    n_tokens,
                    width,
                    logits.dtype.into(),
                )
            }
            Scoring::Sigmoid => {
                let (count, dim) = grid(logits, n_tokens * width);
                sigmoid_kernel::launch_unchecked(
                    &logits.client,
                    count,
                    dim,
                    logits.clone().into_tensor_arg(),
                    out.clone().into_tensor_arg(),
                    width,
                    logits.dtype.into(),
                )
            }
        }
    };
    Some(out)
}

/// The scores' backward in one kernel; `None` where the kernel does not read the tensors.
///
/// # Shapes
/// - scores, grad: `[n_tokens, n_experts]` → `[n_tokens, n_experts]`
pub(crate) fn scores_backward<R: CubeRuntime>(
    scores: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    scoring: Scoring,
) -> Option<CubeTensor<R>> {
    let dims @ [n_tokens, width] = readable(scores)?;
    if readable(grad)? != dims || grad.dtype != scores.dtype || n_tokens * width == 0 {
        return None;
    }
    let out = output(scores, dims);
    // SAFETY: `scores` and `grad` are read at their strides within `[n_tokens, width]`; `out`
    // holds `n_tokens · width` contiguous elements; each kernel bounds its index.
    unsafe {
        match scoring {
            Scoring::Softmax => {
                let (count, dim) = grid(scores, n_tokens);
                softmax_backward_kernel::launch_unchecked(
                    &scores.client,
                    count,
                    dim,
                    scores.clone().into_tensor_arg(),
                    grad.clone().into_tensor_arg(),
                    out.clone().into_tensor_arg(),
                    n_tokens,
                    width,
                    scores.dtype.into(),
                )
            }
            Scoring::Sigmoid => {
                let (count, dim) = grid(scores, n_tokens * width);
                sigmoid_backward_kernel::launch_unchecked(
                    &scores.client,
                    count,
                    dim,
                    scores.clone().into_tensor_arg(),
                    grad.clone().into_tensor_arg(),
                    out.clone().into_tensor_arg(),
                    width,
                    scores.dtype.into(),
                )
            }
        }
    };
    Some(out)
}

/// The combine weights in one kernel; `None` where the kernel does not read the tensors or
/// the choice breaks the contract (the composed form then panics as burn's `gather` does).
///
/// # Shapes
/// - scores: `[n_tokens, n_experts]`, indices: `n_tokens · top_k` → `[n_tokens, top_k]`
pub(crate) fn pick<R: CubeRuntime>(
    scores: &CubeTensor<R>,
    indices: &[usize],
    top_k: usize,
    rule: PickRule,
) -> Option<CubeTensor<R>> {
    let dims @ [n_tokens, _] = readable(scores)?;
    if n_tokens * top_k == 0 {
        return None;
    }
    let choice = upload(scores, indices, dims, top_k)?;
    let out = output(scores, [n_tokens, top_k]);
    let (count, dim) = grid(scores, n_tokens);
    // SAFETY: `choice` holds `n_tokens · top_k` columns of `scores` (checked by `upload`);
    // `scores` is read at its strides; `out` holds `n_tokens · top_k` contiguous elements; the
    // kernel bounds its token by `n_tokens`.
    unsafe {
        pick_kernel::launch_unchecked(
            &scores.client,
            count,
            dim,
            scores.clone().into_tensor_arg(),
            ArrayArg::from_raw_parts(choice, indices.len()),
            out.clone().into_tensor_arg(),
            n_tokens,
            top_k,
            flag(&rule),
            rule.eps as f32,
            rule.scaling as f32,
            scores.dtype.into(),
        )
    };
    Some(out)
}

/// The pick's backward in one kernel; `None` where [`pick`] would be.
///
/// # Shapes
/// - scores: `[n_tokens, n_experts]`, indices: `n_tokens · top_k`, grad: `[n_tokens, top_k]`
///   → `[n_tokens, n_experts]`
pub(crate) fn pick_backward<R: CubeRuntime>(
    scores: &CubeTensor<R>,
    indices: &[usize],
    top_k: usize,
    grad: &CubeTensor<R>,
    rule: PickRule,
) -> Option<CubeTensor<R>> {
    let dims @ [n_tokens, width] = readable(scores)?;
    if readable(grad)? != [n_tokens, top_k] || grad.dtype != scores.dtype || n_tokens * top_k == 0 {
        return None;
    }
    let choice = upload(scores, indices, dims, top_k)?;
    let out = output(scores, dims);
    let (count, dim) = grid(scores, n_tokens);
    // SAFETY: as in `pick`; `grad` is read at its strides within `[n_tokens, top_k]` and `out`
    // holds `n_tokens · width` contiguous elements, each token's row written by its thread.
    unsafe {
        pick_backward_kernel::launch_unchecked(
            &scores.client,
            count,
            dim,
            scores.clone().into_tensor_arg(),
            ArrayArg::from_raw_parts(choice, indices.len()),
            grad.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            n_tokens,
            width,
            top_k,
            flag(&rule),
            rule.eps as f32,
            rule.scaling as f32,
            scores.dtype.into(),
        )
    };
    Some(out)
}
