//! The experts' activations on the CubeCL backends (CUDA, ROCm, WGPU) as one kernel each way:
//! the exact GELU and SwiGLU (plain or GPT-OSS's clamped form), forward and derivative. Composed from burn's ops, the GELU is five
//! kernels forward and eleven for its derivative, SwiGLU's derivative a dozen more with its
//! slices and concatenation, each a pass over the partition; here each is one pass that reads
//! its inputs once and writes its output once.
//!
//! The formulas are the composed defaults' (`activation.rs`), in the same order of operations;
//! the tests hold the kernels to the composed forms on WGPU (`tests/wgpu.rs`), and every case
//! runs through them in the fused exchange there.

use std::f64::consts::{FRAC_1_SQRT_2, PI};

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use crate::cubecl_launch::{grid, kernel_float, output};

#[cube(launch_unchecked)]
fn gelu_kernel<F: Float>(z: &Tensor<F>, out: &mut Tensor<F>, #[define(F)] _dtype: StorageType) {
    if ABSOLUTE_POS >= out.len() {
        terminate!();
    }
    let x = z[ABSOLUTE_POS];
    let cdf = (F::erf(x * F::new(FRAC_1_SQRT_2 as f32)) + F::new(1.0)) * F::new(0.5);
    out[ABSOLUTE_POS] = x * cdf;
}

/// The derivative, and with `with_value` the forward's value too (`value`, written with the
/// forward kernel's expression: the backward that needs both reads `z` once).
#[cube(launch_unchecked)]
fn gelu_backward_kernel<F: Float>(
    z: &Tensor<F>,
    grad: &Tensor<F>,
    out: &mut Tensor<F>,
    value: &mut Tensor<F>,
    #[comptime] with_value: bool,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= out.len() {
        terminate!();
    }
    let x = z[ABSOLUTE_POS];
    let cdf = (F::erf(x * F::new(FRAC_1_SQRT_2 as f32)) + F::new(1.0)) * F::new(0.5);
    let pdf = F::exp(x * x * F::new(-0.5)) * F::new((1.0 / (2.0 * PI).sqrt()) as f32);
    out[ABSOLUTE_POS] = grad[ABSOLUTE_POS] * (cdf + x * pdf);
    if with_value {
        value[ABSOLUTE_POS] = x * cdf;
    }
}

#[cube(launch_unchecked)]
fn swiglu_kernel<F: Float>(
    z: &Tensor<F>,
    out: &mut Tensor<F>,
    hidden: usize,
    alpha: f32,
    limit: f32,
    #[comptime] clamped: bool,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= out.len() {
        terminate!();
    }
    let r = ABSOLUTE_POS / hidden;
    let c = ABSOLUTE_POS % hidden;
    let g = z[r * 2 * hidden + c];
    let u = z[r * 2 * hidden + hidden + c];
    if clamped {
        // `(u + 1) · g · σ(alpha · g)` on the clamped halves, in the composed form's order.
        let bound = F::cast_from(limit);
        let g = F::min(g, bound);
        let u = F::clamp(u, -bound, bound);
        let s = F::new(1.0) / (F::new(1.0) + F::exp(-(g * F::cast_from(alpha))));
        out[ABSOLUTE_POS] = (u + F::new(1.0)) * (g * s);
    } else {
        let s = F::new(1.0) / (F::new(1.0) + F::exp(-g));
        out[ABSOLUTE_POS] = g * s * u;
    }
}

/// `[d gate | d up]`, and with `with_value` the forward's value too (`value`, written with
/// the forward kernel's expressions).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn swiglu_backward_kernel<F: Float>(
    z: &Tensor<F>,
    grad: &Tensor<F>,
    out: &mut Tensor<F>,
    value: &mut Tensor<F>,
    hidden: usize,
    alpha: f32,
    limit: f32,
    #[comptime] clamped: bool,
    #[comptime] with_value: bool,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= grad.len() {
        terminate!();
    }
    let r = ABSOLUTE_POS / hidden;
    let c = ABSOLUTE_POS % hidden;
    let g = z[r * 2 * hidden + c];
    let u = z[r * 2 * hidden + hidden + c];
    let dy = grad[ABSOLUTE_POS];
    if clamped {
        // With `gc = min(gate, limit)`, `uc = clamp(up, ±limit)` and `s = σ(alpha · gc)`:
        // d/d up = grad · gc · s, d/d gate = grad · (uc + 1) · s · (1 + alpha · gc · (1 − s)),
        // each zero where its clamp clamped (the bounds themselves pass the gradient).
        let bound = F::cast_from(limit);
        let a = F::cast_from(alpha);
        let gc = F::min(g, bound);
        let uc = F::clamp(u, -bound, bound);
        let s = F::new(1.0) / (F::new(1.0) + F::exp(-(gc * a)));
        let mut d_up = dy * (gc * s);
        if u > bound || u < -bound {
            d_up = F::new(0.0);
        }
        let slope = gc * (F::new(1.0) - s) * a + F::new(1.0);
        let mut d_gate = (dy * (uc + F::new(1.0))) * (s * slope);
        if g > bound {
            d_gate = F::new(0.0);
        }
        out[r * 2 * hidden + hidden + c] = d_up;
        out[r * 2 * hidden + c] = d_gate;
        if with_value {
            value[ABSOLUTE_POS] = (uc + F::new(1.0)) * (gc * s);
        }
    } else {
        let s = F::new(1.0) / (F::new(1.0) + F::exp(-g));
        // d/d up = grad · silu(gate); d/d gate = grad · up · σ(g) · (1 + g · (1 − σ(g))).
        out[r * 2 * hidden + hidden + c] = dy * (g * s);
        let slope = g * (F::new(1.0) - s) + F::new(1.0);
        out[r * 2 * hidden + c] = (dy * u) * (s * slope);
        if with_value {
            value[ABSOLUTE_POS] = g * s * u;
        }
    }
}

/// The clamped SwiGLU's slope and bound (`alpha`, `limit`), or `None` for the plain SwiGLU.
pub(crate) type Clamp = Option<(f32, f32)>;

/// Whether the kernels read `t` as it is: a contiguous float tensor of the kernels' dtypes.
fn readable<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    kernel_float(t) && t.is_contiguous()
}

/// The exact GELU in one kernel; `None` for a tensor the kernel does not read (the caller
/// composes it then) or with no element.
pub(crate) fn gelu<R: CubeRuntime>(z: &CubeTensor<R>) -> Option<CubeTensor<R>> {
    let dims = z.meta.shape().to_vec();
    let units: usize = dims.iter().product();
    if !readable(z) || units == 0 {
        return None;
    }
    let out = output(z, [units, 1]);
    let (count, dim) = grid(z, units);
    // SAFETY: both tensors are contiguous with `units` elements; the kernel bounds its index.
    unsafe {
        gelu_kernel::launch_unchecked(
            &z.client,
            count,
            dim,
            z.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            z.dtype.into(),
        )
    };
    Some(reshaped(out, dims))
}

/// `grad · gelu'(z)` in one kernel; `None` where the kernel does not read the tensors.
pub(crate) fn gelu_backward<R: CubeRuntime>(
    z: &CubeTensor<R>,
    grad: &CubeTensor<R>,
) -> Option<CubeTensor<R>> {
    gelu_backward_launch(z, grad, false).map(|(dz, _)| dz)
}

/// `(gelu(z), grad · gelu'(z))` in one kernel; `None` where the kernel does not read the
/// tensors.
pub(crate) fn gelu_with_backward<R: CubeRuntime>(
    z: &CubeTensor<R>,
    grad: &CubeTensor<R>,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let (dz, value) = gelu_backward_launch(z, grad, true)?;
    Some((value?, dz))
}

/// The derivative, and the value where `with_value` asks for it.
fn gelu_backward_launch<R: CubeRuntime>(
    z: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    with_value: bool,
) -> Option<(CubeTensor<R>, Option<CubeTensor<R>>)> {
    let dims = z.meta.shape().to_vec();
    let units: usize = dims.iter().product();
    if !readable(z)
        || !readable(grad)
        || grad.dtype != z.dtype
        || grad.meta.shape().to_vec() != dims
        || units == 0
    {
        return None;
    }
    let out = output(z, [units, 1]);
    // Without the value the kernel writes nothing to its `value` argument: one element stands in.
    let value = output(z, [if with_value { units } else { 1 }, 1]);
    let (count, dim) = grid(z, units);
    // SAFETY: `z`, `grad` and `out` are contiguous with `units` elements, and `value` too where
    // the kernel writes it; the kernel bounds its index.
    unsafe {
        gelu_backward_kernel::launch_unchecked(
            &z.client,
            count,
            dim,
            z.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            value.clone().into_tensor_arg(),
            with_value,
            z.dtype.into(),
        )
    };
    let value = with_value.then(|| reshaped(value, dims.clone()));
    Some((reshaped(out, dims), value))
}

/// SwiGLU of `z = [gate | up]` in one kernel, clamped as GPT-OSS's where `clamp` gives the
/// slope and bound; `None` where the kernel does not read `z`.
///
/// # Shapes
/// - z: `[n_rows, 2 · d_hidden]` → `[n_rows, d_hidden]`
pub(crate) fn swiglu<R: CubeRuntime>(z: &CubeTensor<R>, clamp: Clamp) -> Option<CubeTensor<R>> {
    let dims = z.meta.shape().to_vec();
    let [rows, inner] = <[usize; 2]>::try_from(dims).ok()?;
    let hidden = inner / 2;
    if !readable(z) || rows * hidden == 0 || inner % 2 != 0 {
        return None;
    }
    let out = output(z, [rows, hidden]);
    let (count, dim) = grid(z, rows * hidden);
    // SAFETY: `z` holds `rows · 2 · hidden` contiguous elements and `out` `rows · hidden`; the
    // kernel bounds its index by `out`'s length.
    unsafe {
        swiglu_kernel::launch_unchecked(
            &z.client,
            count,
            dim,
            z.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            hidden,
            clamp.map_or(1.0, |c| c.0),
            clamp.map_or(0.0, |c| c.1),
            clamp.is_some(),
            z.dtype.into(),
        )
    };
    Some(out)
}

/// `[d gate | d up]` of SwiGLU (clamped where `clamp` says) in one kernel; `None` where the
/// kernel does not read the tensors.
///
/// # Shapes
/// - z: `[n_rows, 2 · d_hidden]`, grad: `[n_rows, d_hidden]` → `[n_rows, 2 · d_hidden]`
pub(crate) fn swiglu_backward<R: CubeRuntime>(
    z: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    clamp: Clamp,
) -> Option<CubeTensor<R>> {
    swiglu_backward_launch(z, grad, clamp, false).map(|(dz, _)| dz)
}

/// `(swiglu(z), [d gate | d up])` (clamped where `clamp` says) in one kernel; `None` where the
/// kernel does not read the tensors.
///
/// # Shapes
/// - z: `[n_rows, 2 · d_hidden]`, grad: `[n_rows, d_hidden]` → `([n_rows, d_hidden],
///   [n_rows, 2 · d_hidden])`
pub(crate) fn swiglu_with_backward<R: CubeRuntime>(
    z: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    clamp: Clamp,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let (dz, value) = swiglu_backward_launch(z, grad, clamp, true)?;
    Some((value?, dz))
}

/// The derivative, and the value where `with_value` asks for it.
fn swiglu_backward_launch<R: CubeRuntime>(
    z: &CubeTensor<R>,
    grad: &CubeTensor<R>,
    clamp: Clamp,
    with_value: bool,
) -> Option<(CubeTensor<R>, Option<CubeTensor<R>>)> {
    let dims = z.meta.shape().to_vec();
    let [rows, inner] = <[usize; 2]>::try_from(dims).ok()?;
    let hidden = inner / 2;
    let fits = grad.meta.shape().to_vec() == [rows, hidden] && grad.dtype == z.dtype;
    if !readable(z) || !readable(grad) || !fits || rows * hidden == 0 || inner % 2 != 0 {
        return None;
    }
    let out = output(z, [rows, inner]);
    // Without the value the kernel writes nothing to its `value` argument: one element stands in.
    let value = match with_value {
        true => output(z, [rows, hidden]),
        false => output(z, [1, 1]),
    };
    let (count, dim) = grid(z, rows * hidden);
    // SAFETY: `z` and `out` hold `rows · 2 · hidden` contiguous elements, `grad` `rows · hidden`
    // and `value` as many where the kernel writes it; the kernel bounds its index by `grad`'s
    // length and writes both halves of each row.
    unsafe {
        swiglu_backward_kernel::launch_unchecked(
            &z.client,
            count,
            dim,
            z.clone().into_tensor_arg(),
            grad.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            value.clone().into_tensor_arg(),
            hidden,
            clamp.map_or(1.0, |c| c.0),
            clamp.map_or(0.0, |c| c.1),
            clamp.is_some(),
            with_value,
            z.dtype.into(),
        )
    };
    Some((out, with_value.then_some(value)))
}

/// `t` (contiguous) with the shape `dims`.
fn reshaped<R: CubeRuntime>(t: CubeTensor<R>, dims: Vec<usize>) -> CubeTensor<R> {
    CubeTensor::new_contiguous(t.client, t.device, dims.into(), t.handle, t.dtype)
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::backend::Wgpu;
    use burn::tensor::{Distribution, Tensor};

    /// The kernels take contiguous tensors and leave strided views to the composed form: a
    /// kernel that silently fell back everywhere would pass every comparison with the composed
    /// form (`tests/wgpu.rs`), so this holds which one runs.
    #[test]
    fn the_kernels_run_on_contiguous_tensors_and_hand_views_back() {
        let device = Default::default();
        let z = Tensor::<Wgpu, 2>::random([6, 8], Distribution::Default, &device);
        let g = Tensor::<Wgpu, 2>::random([6, 4], Distribution::Default, &device);
        let p = |t: Tensor<Wgpu, 2>| t.into_primitive().tensor();
        assert!(super::gelu(&p(z.clone())).is_some());
        assert!(super::gelu_backward(&p(z.clone()), &p(z.clone())).is_some());
        assert!(super::gelu_with_backward(&p(z.clone()), &p(z.clone())).is_some());
        for clamp in [None, Some((1.702, 0.5))] {
            assert!(super::swiglu(&p(z.clone()), clamp).is_some());
            assert!(super::swiglu_backward(&p(z.clone()), &p(g.clone()), clamp).is_some());
            assert!(super::swiglu_with_backward(&p(z.clone()), &p(g.clone()), clamp).is_some());
        }
        let view = p(z.clone().transpose());
        assert!(super::gelu(&view).is_none());
        assert!(super::swiglu(&view, None).is_none());
        let strided_grad = Tensor::<Wgpu, 2>::random([4, 6], Distribution::Default, &device).transpose();
        assert!(
            super::swiglu_backward(&p(z.clone()), &p(strided_grad.clone()), Some((1.702, 0.5))).is_none()
        );
        assert!(super::swiglu_with_backward(&p(z), &p(strided_grad), None).is_none());
        assert!(super::gelu_with_backward(&view, &view).is_none());
    }
}
