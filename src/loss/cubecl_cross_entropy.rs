//! The token cross-entropy on the CubeCL backends: each row's negative log-likelihood and
//! log-sum-exp in one kernel (a cube per row), and the logits' gradient in one (a thread per
//! logit).
//!
//! The logits are the largest activation of a language model (`[n_tokens, vocab]`, a vocabulary
//! of 150 k in Qwen3), and composed the loss passes over them about six times forward (the row
//! maximum, the shift, `exp`, the row sum, and a gather) and four backward (the shift, `exp`,
//! the product, the scatter), each pass writing a tensor of their size. Here the forward reads
//! a row three times (its maximum, its shifted exp-sum, its target) and writes two values, and
//! the backward writes the gradient once.
//!
//! Each thread computes in f32 whatever the logits' float type. A target below 0 is ignored
//! (loss and gradient 0), as the composed form and transformers ignore `-100`. A target at or
//! past `vocab` breaks [`LossKernels`](super::LossKernels)'s contract; a kernel cannot panic, so
//! that row's loss is NaN, which no training step lets through. The tests hold both kernels to
//! the composed forms on WGPU (`loss/cubecl_tests.rs`).

use burn::tensor::DType;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use crate::cubecl_cube::{cube_max, cube_sum};
use crate::cubecl_launch::{cube_per_row, grid, kernel_float, output};

/// Threads of a row's cube: a row is a vocabulary, thousands to hundreds of thousands wide.
const THREADS: usize = 128;

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn token_nll_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    nll: &mut Tensor<F>,
    lse: &mut Tensor<F>,
    n_tokens: usize,
    vocab: usize,
    nan: f32,
    #[comptime] threads: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    // A whole cube leaves together (one row per cube), so the barriers are reached by every
    // thread of every cube that stays.
    let row = CUBE_POS;
    if row >= n_tokens {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let at = row * logits.stride(0);
    let step = logits.stride(1);
    let mut max = f32::cast_from(logits[at]);
    let mut c = unit;
    while c < vocab {
        max = f32::max(max, f32::cast_from(logits[at + c * step]));
        c += threads;
    }
    let mut shared = SharedMemory::<f32>::new(threads);
    let max = cube_max(&mut shared, max, threads);
    let mut sum = 0.0f32;
    let mut c = unit;
    while c < vocab {
        sum += f32::exp(f32::cast_from(logits[at + c * step]) - max);
        c += threads;
    }
    let row_lse = f32::ln(cube_sum(&mut shared, sum, threads)) + max;
    if unit == 0 {
        let target = i32::cast_from(targets[row * targets.stride(0)]);
        let mut loss = 0.0f32;
        if target >= 0 {
            let column = usize::cast_from(target);
            if column < vocab {
                loss = row_lse - f32::cast_from(logits[at + column * step]);
            } else {
                loss = nan;
            }
        }
        nll[row] = F::cast_from(loss);
        lse[row] = F::cast_from(row_lse);
    }
}

#[cube(launch_unchecked)]
fn token_nll_backward_kernel<F: Float, I: Int>(
    logits: &Tensor<F>,
    targets: &Tensor<I>,
    lse: &Tensor<F>,
    grad: &Tensor<F>,
    out: &mut Tensor<F>,
    vocab: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let (row, column) = (i / vocab, i % vocab);
    let target = i32::cast_from(targets[row * targets.stride(0)]);
    let mut d = 0.0f32;
    if target >= 0 {
        let g = f32::cast_from(grad[row * grad.stride(0)]);
        let x = f32::cast_from(logits[row * logits.stride(0) + column * logits.stride(1)]);
        d = f32::exp(x - f32::cast_from(lse[row * lse.stride(0)])) * g;
        if i32::cast_from(column) == target {
            d -= g;
        }
    }
    out[i] = F::cast_from(d);
}

/// `[n_tokens, vocab]` where the logits are a float tensor of the kernels' types with two
/// dimensions and something in them, and the targets `[n_tokens]` of a 32- or 64-bit integer.
fn fits<R: CubeRuntime>(logits: &CubeTensor<R>, targets: &CubeTensor<R>) -> Option<[usize; 2]> {
    let dims @ [n_tokens, vocab] = <[usize; 2]>::try_from(logits.meta.shape().to_vec()).ok()?;
    let ok = kernel_float(logits)
        && matches!(targets.dtype, DType::I32 | DType::I64)
        && targets.meta.shape().to_vec() == [n_tokens]
        && n_tokens * vocab > 0;
    ok.then_some(dims)
}

/// Each row's negative log-likelihood and log-sum-exp in one kernel; `None` where the kernel
/// does not read the tensors (the caller composes them then).
///
/// # Shapes
/// - logits: `[n_tokens, vocab]`, targets: `[n_tokens]` → (`[n_tokens]`, `[n_tokens]`)
pub(crate) fn token_nll_forward<R: CubeRuntime>(
    logits: &CubeTensor<R>,
    targets: &CubeTensor<R>,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let [n_tokens, vocab] = fits(logits, targets)?;
    let (nll, lse) = (output(logits, [n_tokens]), output(logits, [n_tokens]));
    let (count, dim) = cube_per_row(logits, n_tokens, THREADS);
    // SAFETY: `logits` is read at its strides within `[n_tokens, vocab]` (a target is read as
    // a column only below `vocab`), `targets` within `[n_tokens]`; `nll` and `lse` hold
    // `n_tokens` contiguous elements, each written by its row's first thread; cubes past the
    // last row leave before reading.
    unsafe {
        token_nll_kernel::launch_unchecked(
            &logits.client,
            count,
            dim,
            logits.clone().into_tensor_arg(),
            targets.clone().into_tensor_arg(),
            nll.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            n_tokens,
            vocab,
            // A NaN constant in a shader is refused where the shading language folds constants
            // (WGSL), so it comes as an argument.
            f32::NAN,
            THREADS,
            [logits.dtype.into(), targets.dtype.into()],
        )
    };
    Some((nll, lse))
}

/// The logits' gradient in one kernel; `None` where the kernel does not read the tensors.
///
/// # Shapes
/// - logits: `[n_tokens, vocab]`, targets, lse, grad: `[n_tokens]` → `[n_tokens, vocab]`
pub(crate) fn token_nll_backward<R: CubeRuntime>(
    logits: &CubeTensor<R>,
    targets: &CubeTensor<R>,
    lse: &CubeTensor<R>,
    grad: &CubeTensor<R>,
) -> Option<CubeTensor<R>> {
    let dims @ [n_tokens, _] = fits(logits, targets)?;
    let rows = |t: &CubeTensor<R>| t.dtype == logits.dtype && t.meta.shape().to_vec() == [n_tokens];
    if !rows(lse) || !rows(grad) {
        return None;
    }
    let out = output(logits, dims);
    let (count, dim) = grid(logits, n_tokens * dims[1]);
    // SAFETY: every input is read at its strides within its shape; `out` holds one contiguous
    // element a thread, and threads past its length leave.
    unsafe {
        token_nll_backward_kernel::launch_unchecked(
            &logits.client,
            count,
            dim,
            logits.clone().into_tensor_arg(),
            targets.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            dims[1],
            [logits.dtype.into(), targets.dtype.into()],
        )
    };
    Some(out)
}
