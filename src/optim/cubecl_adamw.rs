//! AdamW on the CubeCL backends (CUDA, ROCm, WGPU) in one kernel, in place.
//!
//! Composed from burn's ops, one parameter's update is fifteen element-wise kernels (the
//! moments' scalings, additions and square, the bias corrections, the square root, the
//! division, the decay and the step), each a launch on the raw backends, which do not fuse:
//! on WGPU a fine-tuning step of the 3-layer test Qwen3-MoE made 1,462 launches, about 500 of
//! them its optimizer's. Under burn's fusion the composed form is fused already
//! (`optim/kernels.rs`). This kernel reads the gradient once and rewrites the parameter and
//! both moments where they lie, one thread per element, each element through the composed
//! update's arithmetic in its order ([`AdamWCoefficients::update`]'s), in f32.
//!
//! In place only where the three tensors are this update's alone (`can_mut`: the usual case,
//! a parameter after backward and the moments this kernel wrote) and contiguous; otherwise
//! the caller composes the update. A strided gradient is copied contiguous first.

use burn::tensor::{Tensor as BurnTensor, TensorPrimitive};
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::kernels::{AdamWCoefficients, AdamWTensors};
use crate::cubecl_launch::{grid, kernel_float};

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn adamw_kernel<F: Float>(
    param: &mut Tensor<F>,
    moment_1: &mut Tensor<F>,
    moment_2: &mut Tensor<F>,
    grad: &Tensor<F>,
    beta_1: f32,
    one_minus_beta_1: f32,
    beta_2: f32,
    one_minus_beta_2: f32,
    epsilon: f32,
    bias_1: f32,
    bias_2: f32,
    lr: f32,
    decay: f32,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= param.len() {
        terminate!();
    }
    let g = f32::cast_from(grad[i]);
    let m = f32::cast_from(moment_1[i]) * beta_1 + g * one_minus_beta_1;
    let v = f32::cast_from(moment_2[i]) * beta_2 + g * g * one_minus_beta_2;
    let delta = (m / bias_1) / (f32::sqrt(v / bias_2) + epsilon);
    param[i] = F::cast_from(f32::cast_from(param[i]) * decay - delta * lr);
    moment_1[i] = F::cast_from(m);
    moment_2[i] = F::cast_from(v);
}

type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// The update in one kernel, in place; `Err` with the tensors as they came where the kernel
/// does not take them (one shared, strided, of another dtype or shape, or empty).
///
/// # Shapes
/// - every tensor: the parameter's shape
#[allow(clippy::type_complexity)]
pub(crate) fn adamw_update<R, F, I, BT, const D: usize>(
    tensors: AdamWTensors<Cube<R, F, I, BT>, D>,
    grad: BurnTensor<Cube<R, F, I, BT>, D>,
    c: &AdamWCoefficients,
) -> Result<
    AdamWTensors<Cube<R, F, I, BT>, D>,
    (
        AdamWTensors<Cube<R, F, I, BT>, D>,
        BurnTensor<Cube<R, F, I, BT>, D>,
    ),
>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let primitive = |t: BurnTensor<Cube<R, F, I, BT>, D>| -> CubeTensor<R> { t.into_primitive().tensor() };
    let (param, moment_1, moment_2, grad) = (
        primitive(tensors.param),
        primitive(tensors.moment_1),
        primitive(tensors.moment_2),
        primitive(grad),
    );
    let shape = param.meta.shape().to_vec();
    let units: usize = shape.iter().product();
    // A gradient may arrive as a strided view: a weight used transposed (the router's
    // `[n_experts, d_model]`, applied as `x · wᵀ`) gets its gradient as the transpose of a
    // contiguous product. One copy makes it readable, against the composed update's fifteen
    // launches.
    let grad = match grad.is_contiguous() || grad.meta.shape().to_vec() != shape {
        true => grad,
        false => burn_cubecl::kernel::into_contiguous(grad),
    };
    let fits = |t: &CubeTensor<R>| {
        t.meta.shape().to_vec() == shape && t.dtype == param.dtype && kernel_float(t) && t.is_contiguous()
    };
    // Written in place: each must be this update's alone, and no two the same memory.
    let written = [&param, &moment_1, &moment_2];
    let takes = units > 0 && written.iter().all(|t| fits(t) && t.can_mut()) && fits(&grad);
    let tensor = |t: CubeTensor<R>| BurnTensor::from_primitive(TensorPrimitive::Float(t));
    if !takes {
        let tensors = AdamWTensors {
            param: tensor(param),
            moment_1: tensor(moment_1),
            moment_2: tensor(moment_2),
        };
        return Err((tensors, tensor(grad)));
    }
    let (count, dim) = grid(&param, units);
    // SAFETY: the four tensors are contiguous with `units` elements each (checked above); the
    // three written ones are held by this update alone (`can_mut`: a handle that one tensor
    // holds), so no other reader sees them change and no two alias; the kernel bounds its
    // index by the parameter's length.
    unsafe {
        adamw_kernel::launch_unchecked(
            &param.client,
            count,
            dim,
            param.clone().into_tensor_arg(),
            moment_1.clone().into_tensor_arg(),
            moment_2.clone().into_tensor_arg(),
            grad.into_tensor_arg(),
            c.beta_1,
            1.0 - c.beta_1,
            c.beta_2,
            1.0 - c.beta_2,
            c.epsilon,
            c.bias_1,
            c.bias_2,
            c.lr,
            c.decay,
            param.dtype.into(),
        )
    };
    Ok(AdamWTensors {
        param: tensor(param),
        moment_1: tensor(moment_1),
        moment_2: tensor(moment_2),
    })
}
