//! RMSNorm on the CubeCL backends: one kernel forward and one backward, one cube per row.
//!
//! A row is a model's width (hundreds to thousands of values), so its threads stride along it
//! (neighbouring threads read neighbouring values) and sum their parts in shared memory, as
//! the weighted combine's backward does (`exchange/cubecl_combine.rs`). Composed from burn's
//! ops the norm is seven kernels forward (the square, the mean, the addition, the square root,
//! the reciprocal, two products) and about a dozen backward under autodiff, for every norm of
//! every layer of every step: four a layer in Qwen3 (the input, the attention's output, the
//! query's and the key's).
//!
//! Each thread computes in f32 whatever the tensors' float type. The backward writes `x`'s
//! gradient and each row's `grad · x · r`, whose column sums (burn's reduction) are the
//! weight's gradient. The tests hold both to the composed forms on WGPU
//! (`decoder/cubecl_tests.rs`).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use crate::cubecl_cube::cube_sum;
use crate::cubecl_launch::{cube_per_row, kernel_float, output};

/// Threads of a row's cube.
const THREADS: usize = 64;

#[cube(launch_unchecked)]
fn rms_norm_kernel<F: Float>(
    x: &Tensor<F>,
    weight: &Tensor<F>,
    out: &mut Tensor<F>,
    n_rows: usize,
    width: usize,
    eps: f32,
    #[comptime] threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    // A whole cube leaves together (one row per cube), so the barriers are reached by every
    // thread of every cube that stays.
    let row = CUBE_POS;
    if row >= n_rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let at = row * x.stride(0);
    let mut squares = 0.0f32;
    let mut c = unit;
    while c < width {
        let v = f32::cast_from(x[at + c * x.stride(1)]);
        squares += v * v;
        c += threads;
    }
    let mut sums = SharedMemory::<f32>::new(threads);
    let total = cube_sum(&mut sums, squares, threads);
    let r = 1.0f32 / f32::sqrt(total / f32::cast_from(width) + eps);
    let mut c = unit;
    while c < width {
        let v = f32::cast_from(x[at + c * x.stride(1)]);
        let w = f32::cast_from(weight[c * weight.stride(0)]);
        out[row * width + c] = F::cast_from(v * r * w);
        c += threads;
    }
}

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rms_norm_backward_kernel<F: Float>(
    x: &Tensor<F>,
    weight: &Tensor<F>,
    grad: &Tensor<F>,
    dx: &mut Tensor<F>,
    scaled: &mut Tensor<F>,
    n_rows: usize,
    width: usize,
    dx_width: usize,
    eps: f32,
    #[comptime] threads: usize,
    #[comptime] weight_grad: bool,
    #[define(F)] _dtype: StorageType,
) {
    let row = CUBE_POS;
    if row >= n_rows {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let (xa, ga) = (row * x.stride(0), row * grad.stride(0));
    let mut squares = 0.0f32;
    let mut dot = 0.0f32;
    let mut c = unit;
    while c < width {
        let v = f32::cast_from(x[xa + c * x.stride(1)]);
        let u = f32::cast_from(grad[ga + c * grad.stride(1)]) * f32::cast_from(weight[c * weight.stride(0)]);
        squares += v * v;
        dot += u * v;
        c += threads;
    }
    let mut sums = SharedMemory::<f32>::new(threads);
    let n = f32::cast_from(width);
    let r = 1.0f32 / f32::sqrt(cube_sum(&mut sums, squares, threads) / n + eps);
    let mean_ux = cube_sum(&mut sums, dot, threads) / n;
    let r3 = r * r * r;
    let mut c = unit;
    while c < width {
        let v = f32::cast_from(x[xa + c * x.stride(1)]);
        let g = f32::cast_from(grad[ga + c * grad.stride(1)]);
        let u = g * f32::cast_from(weight[c * weight.stride(0)]);
        dx[row * dx_width + c] = F::cast_from(u * r - v * r3 * mean_ux);
        if weight_grad {
            scaled[row * width + c] = F::cast_from(g * v * r);
        }
        c += threads;
    }
    // A norm of a row's first `width` values of a wider `x`: the rest's gradient is zero.
    let mut c = width + unit;
    while c < dx_width {
        dx[row * dx_width + c] = F::new(0.0);
        c += threads;
    }
}

/// `[rows, width]` where `x` is a float tensor of the kernels' dtypes with two dimensions and
/// something to normalise, and `weight` a `[width]` one of its dtype (both read at their
/// strides).
fn fits<R: CubeRuntime>(x: &CubeTensor<R>, weight: &CubeTensor<R>) -> Option<[usize; 2]> {
    let dims @ [rows, width] = <[usize; 2]>::try_from(x.meta.shape().to_vec()).ok()?;
    let ok = kernel_float(x) && weight.dtype == x.dtype && weight.meta.shape().to_vec() == [width];
    (ok && rows * width > 0).then_some(dims)
}

/// The norm in one kernel; `None` where the kernel does not read the tensors (the caller
/// composes it then).
///
/// # Shapes
/// - x: `[rows, width]`, weight: `[width]` → `[rows, width]`
pub(crate) fn rms_norm<R: CubeRuntime>(
    x: &CubeTensor<R>,
    weight: &CubeTensor<R>,
    eps: f64,
) -> Option<CubeTensor<R>> {
    let dims @ [rows, width] = fits(x, weight)?;
    let out = output(x, dims);
    let (count, dim) = cube_per_row(x, rows, THREADS);
    // SAFETY: `x` and `weight` are read at their strides within their shapes; `out` holds
    // `rows · width` contiguous elements, each row written by its cube; cubes past the last
    // row leave before reading.
    unsafe {
        rms_norm_kernel::launch_unchecked(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            weight.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rows,
            width,
            eps as f32,
            THREADS,
            x.dtype.into(),
        )
    };
    Some(out)
}

/// The norm's backward in one kernel: `x`'s gradient and, where `weight_grad` asks, each row's
/// `grad · x · r` (the weight's gradient is their column sums); `None` where the kernel does not
/// read the tensors.
///
/// # Shapes
/// - x, grad: `[rows, width]`, weight: `[width]` → (`[rows, width]`, `[rows, width]`)
pub(crate) fn rms_norm_backward<R: CubeRuntime>(
    x: &CubeTensor<R>,
    weight: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    eps: f64,
    weight_grad: bool,
) -> Option<(CubeTensor<R>, Option<CubeTensor<R>>)> {
    let [_, width] = fits(x, weight)?;
    backward_into(x, weight, grad, (eps, weight_grad), width)
}

/// The norm of each row's first `weight`-width values of `x` (DeepSeek's latent, the front of
/// its compression), read where they lie: a view of `x`'s buffer, nothing copied. `None` where
/// the kernel does not read the tensors.
///
/// # Shapes
/// - x: `[rows, total]`, weight: `[width]`, `width ≤ total` → `[rows, width]`
pub(crate) fn rms_norm_columns<R: CubeRuntime>(
    x: &CubeTensor<R>,
    weight: &CubeTensor<R>,
    eps: f64,
) -> Option<CubeTensor<R>> {
    rms_norm(&front(x, weight)?, weight, eps)
}

/// The backward of [`rms_norm_columns`]: `x`'s gradient over its whole width, zero after the
/// first `width` values of each row, and the weight's products as [`rms_norm_backward`]'s, in
/// one kernel. `None` where the kernel does not read the tensors.
///
/// # Shapes
/// - x: `[rows, total]`, weight: `[width]`, grad: `[rows, width]` → (`[rows, total]`,
///   `[rows, width]`)
pub(crate) fn rms_norm_columns_backward<R: CubeRuntime>(
    x: &CubeTensor<R>,
    weight: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    eps: f64,
    weight_grad: bool,
) -> Option<(CubeTensor<R>, Option<CubeTensor<R>>)> {
    let total = *x.meta.shape().to_vec().get(1)?;
    backward_into(&front(x, weight)?, weight, grad, (eps, weight_grad), total)
}

/// `x` `[rows, total]` seen as its first `weight`-width columns: the same buffer and strides,
/// a narrower shape (the view starts where `x` does, so no binding offset is needed).
fn front<R: CubeRuntime>(x: &CubeTensor<R>, weight: &CubeTensor<R>) -> Option<CubeTensor<R>> {
    let [rows, total] = <[usize; 2]>::try_from(x.meta.shape().to_vec()).ok()?;
    let width = *weight.meta.shape().to_vec().first()?;
    if width == 0 || width > total {
        return None;
    }
    let mut view = x.clone();
    view.meta.shape_mut()[1] = width;
    debug_assert_eq!(view.meta.shape().to_vec(), [rows, width]);
    Some(view)
}

/// The backward kernel with `x`'s gradient written `dx_width` values a row (zero after the
/// norm's `width`).
fn backward_into<R: CubeRuntime>(
    x: &CubeTensor<R>,
    weight: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    (eps, weight_grad): (f64, bool),
    dx_width: usize,
) -> Option<(CubeTensor<R>, Option<CubeTensor<R>>)> {
    let dims @ [rows, width] = fits(x, weight)?;
    if grad.dtype != x.dtype || grad.meta.shape().to_vec() != dims || dx_width < width {
        return None;
    }
    let dx = output(x, [rows, dx_width]);
    // Without the weight's gradient the kernel writes no products: it is handed one element
    // it never touches (a binding the launch needs, as no output may alias another).
    let scaled = output(x, if weight_grad { dims } else { [1, 1] });
    let (count, dim) = cube_per_row(x, rows, THREADS);
    // SAFETY: as in `rms_norm`, `grad` read at its strides within `[rows, width]`; `dx` holds
    // `rows · dx_width` contiguous elements and `scaled` `rows · width` where it is written,
    // each row written by its cube.
    unsafe {
        rms_norm_backward_kernel::launch_unchecked(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            weight.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            dx.clone().into_tensor_arg(),
            scaled.clone().into_tensor_arg(),
            rows,
            width,
            dx_width,
            eps as f32,
            THREADS,
            weight_grad,
            x.dtype.into(),
        )
    };
    Some((dx, weight_grad.then_some(scaled)))
}

/// The column sums of a `[rows, width]` tensor, as `[width]` (burn's reduction).
pub(crate) fn column_sums<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    let width = t.shape()[1];
    B::float_reshape(B::float_sum_dim(t, 0), Shape::new([width]))
}
