//! The router z-loss on the CubeCL backends: each token's term `scale · lse_t²` in one kernel
//! (one thread per token, which walks its row, as the router's other kernels do), whose sum
//! the caller takes with burn's reduction, and the backward in one kernel. Composed from
//! burn's ops the loss took ten kernels forward (a maximum, a subtraction, `exp`, a row sum,
//! `log`, an addition, the square, the sum, the scaling) and more backward, every step of a
//! layer that trains with it.
//!
//! Each thread computes in f32 whatever the tensors' float type and reads the logits at their
//! strides. The tests hold both kernels to the composed forms on WGPU (`router/cubecl_tests.rs`).

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use super::cubecl_router::{row_exp_sum, row_max};
use crate::cubecl_launch::{grid, kernel_float, output};

/// Row `t`'s logsumexp, shifted by the row's maximum so that `exp` cannot overflow.
#[cube]
fn row_logsumexp<F: Float>(logits: &Tensor<F>, t: usize, width: usize) -> f32 {
    let row = t * logits.stride(0);
    let column = logits.stride(1);
    let max = row_max::<F>(logits, row, column, width);
    f32::ln(row_exp_sum::<F>(logits, row, column, width, max)) + max
}

#[cube(launch_unchecked)]
fn z_loss_terms_kernel<F: Float>(
    logits: &Tensor<F>,
    out: &mut Tensor<F>,
    n_tokens: usize,
    width: usize,
    scale: f32,
    #[define(F)] _dtype: StorageType,
) {
    let t = ABSOLUTE_POS;
    if t >= n_tokens {
        terminate!();
    }
    let lse = row_logsumexp::<F>(logits, t, width);
    out[t] = F::cast_from(scale * lse * lse);
}

#[cube(launch_unchecked)]
fn z_loss_backward_kernel<F: Float>(
    logits: &Tensor<F>,
    grad: &Tensor<F>,
    out: &mut Tensor<F>,
    n_tokens: usize,
    width: usize,
    scale: f32,
    #[define(F)] _dtype: StorageType,
) {
    let t = ABSOLUTE_POS;
    if t >= n_tokens {
        terminate!();
    }
    let lse = row_logsumexp::<F>(logits, t, width);
    // d(scale · lse²)/d x_e = scale · 2 · lse · softmax_e, and softmax_e = exp(x_e − lse).
    let factor = f32::cast_from(grad[0]) * scale * 2.0f32 * lse;
    let row = t * logits.stride(0);
    let column = logits.stride(1);
    for e in 0..width {
        let x = f32::cast_from(logits[row + e * column]);
        out[t * width + e] = F::cast_from(factor * f32::exp(x - lse));
    }
}

/// Whether the kernels read `t`: a float tensor of the kernels' dtypes with two dimensions
/// (any strides: the kernels index by them) and at least one element.
fn readable<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<[usize; 2]> {
    let dims @ [n_tokens, width] = <[usize; 2]>::try_from(t.meta.shape().to_vec()).ok()?;
    (kernel_float(t) && n_tokens * width > 0).then_some(dims)
}

/// Each token's term `scale · lse_t²` in one kernel, as `[n_tokens]`; `None` for a tensor the
/// kernel does not read (the caller composes the loss then).
///
/// # Shapes
/// - logits: `[n_tokens, n_experts]` → `[n_tokens]`
pub(crate) fn row_terms<R: CubeRuntime>(logits: &CubeTensor<R>, scale: f64) -> Option<CubeTensor<R>> {
    let [n_tokens, width] = readable(logits)?;
    let out = output(logits, [n_tokens, 1]);
    let (count, dim) = grid(logits, n_tokens);
    // SAFETY: `logits` is read at its strides within `[n_tokens, width]`; `out` holds
    // `n_tokens` contiguous elements; the kernel bounds its token by `n_tokens`.
    unsafe {
        z_loss_terms_kernel::launch_unchecked(
            &logits.client,
            count,
            dim,
            logits.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            n_tokens,
            width,
            scale as f32,
            logits.dtype.into(),
        )
    };
    Some(CubeTensor::new_contiguous(
        out.client,
        out.device,
        [n_tokens].into(),
        out.handle,
        out.dtype,
    ))
}

/// The z-loss's backward in one kernel; `None` where the kernel does not read the tensors.
///
/// # Shapes
/// - logits: `[n_tokens, n_experts]`, grad: `[1]` → `[n_tokens, n_experts]`
pub(crate) fn backward<R: CubeRuntime>(
    logits: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    scale: f64,
) -> Option<CubeTensor<R>> {
    let dims @ [n_tokens, width] = readable(logits)?;
    let scalar = grad.meta.shape().iter().product::<usize>() == 1;
    if !scalar || !kernel_float(grad) || grad.dtype != logits.dtype {
        return None;
    }
    let out = output(logits, dims);
    let (count, dim) = grid(logits, n_tokens);
    // SAFETY: `logits` is read at its strides within `[n_tokens, width]`, `grad`'s one element
    // at index 0; `out` holds `n_tokens · width` contiguous elements, each token's row written
    // by its thread.
    unsafe {
        z_loss_backward_kernel::launch_unchecked(
            &logits.client,
            count,
            dim,
            logits.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            n_tokens,
            width,
            scale as f32,
            logits.dtype.into(),
        )
    };
    Some(out)
}
