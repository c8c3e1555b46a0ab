//! The dense blocks' SwiGLU of two halves given apart (`silu(gate) · up`, a dense MLP's two
//! projections) on the CubeCL backends: one kernel forward, one writing both halves'
//! gradients backward.
//!
//! Joined first, the two halves were a concatenation forward (two `slice_assign`s) and two
//! copies backward (the slices of `[d gate | d up]` the products read), around the experts'
//! SwiGLU kernel. Each value here is computed with that kernel's expressions
//! (`experts/cubecl_activation.rs`, the plain form), so the results are its bits. The tests
//! hold both to burn's ops (`gated.rs`'s comparison, on WGPU) and the GPU check's list to the
//! composed forms.

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use crate::cubecl_launch::{grid, kernel_float, output};

#[cube(launch_unchecked)]
fn pair_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    out: &mut Tensor<F>,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let g = gate[i];
    let s = F::new(1.0) / (F::new(1.0) + F::exp(-g));
    out[i] = g * s * up[i];
}

#[cube(launch_unchecked)]
fn pair_backward_kernel<F: Float>(
    gate: &Tensor<F>,
    up: &Tensor<F>,
    grad: &Tensor<F>,
    d_gate: &mut Tensor<F>,
    d_up: &mut Tensor<F>,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= grad.len() {
        terminate!();
    }
    let (g, u, dy) = (gate[i], up[i], grad[i]);
    let s = F::new(1.0) / (F::new(1.0) + F::exp(-g));
    // d/d up = grad · silu(gate); d/d gate = grad · up · σ(g) · (1 + g · (1 − σ(g))).
    d_up[i] = dy * (g * s);
    let slope = g * (F::new(1.0) - s) + F::new(1.0);
    d_gate[i] = (dy * u) * (s * slope);
}

/// The dims the kernels read all of `tensors` at: one shape, contiguous, a float type of
/// theirs, something in it.
fn fits<R: CubeRuntime>(tensors: &[&CubeTensor<R>]) -> Option<Vec<usize>> {
    let dims = tensors[0].meta.shape().to_vec();
    let ok = tensors.iter().all(|t| {
        kernel_float(t) && t.is_contiguous() && t.dtype == tensors[0].dtype && t.meta.shape().to_vec() == dims
    }) && dims.iter().product::<usize>() > 0;
    ok.then_some(dims)
}

/// `silu(gate) · up` in one kernel; `None` where the kernel does not read the halves.
///
/// # Shapes
/// - gate, up: `[.., d_hidden]` → the same
pub(crate) fn gated_silu_pair<R: CubeRuntime>(
    gate: &CubeTensor<R>,
    up: &CubeTensor<R>,
) -> Option<CubeTensor<R>> {
    let dims = fits(&[gate, up])?;
    let units: usize = dims.iter().product();
    let out = output(gate, [units]);
    let (count, dim) = grid(gate, units);
    // SAFETY: the three tensors are contiguous with `units` elements each; the kernel bounds
    // its index by `out`'s length.
    unsafe {
        pair_kernel::launch_unchecked(
            &gate.client,
            count,
            dim,
            gate.clone().into_tensor_arg(),
            up.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            gate.dtype.into(),
        )
    };
    Some(shaped(out, dims))
}

/// Both halves' gradients of [`gated_silu_pair`] in one kernel; `None` where the kernel does
/// not read the tensors.
///
/// # Shapes
/// - gate, up, grad: `[.., d_hidden]` → (`d gate`, `d up`), the same
pub(crate) fn gated_silu_pair_backward<R: CubeRuntime>(
    gate: &CubeTensor<R>,
    up: &CubeTensor<R>,
    grad: &CubeTensor<R>,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let dims = fits(&[gate, up, grad])?;
    let units: usize = dims.iter().product();
    let (d_gate, d_up) = (output(gate, [units]), output(gate, [units]));
    let (count, dim) = grid(gate, units);
    // SAFETY: the five tensors are contiguous with `units` elements each; the kernel bounds
    // its index by `grad`'s length.
    unsafe {
        pair_backward_kernel::launch_unchecked(
            &gate.client,
            count,
            dim,
            gate.clone().into_tensor_arg(),
            up.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            d_gate.clone().into_tensor_arg(),
            d_up.clone().into_tensor_arg(),
            gate.dtype.into(),
        )
    };
    Some((shaped(d_gate, dims.clone()), shaped(d_up, dims)))
}

/// `t` (contiguous) with the dims `dims`.
fn shaped<R: CubeRuntime>(t: CubeTensor<R>, dims: Vec<usize>) -> CubeTensor<R> {
    CubeTensor::new_contiguous(t.client, t.device, dims.into(), t.handle, t.dtype)
}
