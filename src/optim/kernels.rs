//! The optimizer's per-parameter update on backend tensors, overridable per backend.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// The scalars of one AdamW step, computed as burn's `AdamW` computes them (in `f32`, from
/// the `f64` learning rate), so that every kernel gives burn's update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWCoefficients {
    /// β₁, the first moment's decay.
    pub beta_1: f32,
    /// β₂, the second moment's decay.
    pub beta_2: f32,
    /// ε, added to `sqrt(v̂)`.
    pub epsilon: f32,
    /// `1 − β₁ᵗ`, the first moment's bias correction at step `t` (from 1).
    pub bias_1: f32,
    /// `1 − β₂ᵗ`.
    pub bias_2: f32,
    /// The learning rate.
    pub lr: f32,
    /// `1 − lr · weight_decay`, the decoupled weight decay's factor.
    pub decay: f32,
}

impl AdamWCoefficients {
    /// The coefficients of step `time` (1 for the first update) with learning rate `lr`.
    pub fn new(beta_1: f32, beta_2: f32, epsilon: f32, weight_decay: f32, lr: f64, time: usize) -> Self {
        // burn raises β to an `i32` power and converts `1 - lr · wd` and `lr` to the element
        // type from `f64`; doing the same keeps the kernels' update equal to burn's.
        let time = i32::try_from(time).unwrap_or(i32::MAX);
        Self {
            beta_1,
            beta_2,
            epsilon,
            bias_1: 1.0 - beta_1.powi(time),
            bias_2: 1.0 - beta_2.powi(time),
            lr: lr as f32,
            decay: (1.0 - lr * f64::from(weight_decay)) as f32,
        }
    }

    /// The update of one element: returns the new `(param, moment_1, moment_2)`. The kernels
    /// that work element by element call this, so that they round as the composed ops do.
    #[inline(always)]
    pub fn update(&self, param: f32, grad: f32, moment_1: f32, moment_2: f32) -> (f32, f32, f32) {
        let m = moment_1 * self.beta_1 + grad * (1.0 - self.beta_1);
        let v = moment_2 * self.beta_2 + grad * grad * (1.0 - self.beta_2);
        let delta = (m / self.bias_1) / ((v / self.bias_2).sqrt() + self.epsilon);
        (param * self.decay - delta * self.lr, m, v)
    }
}

/// A parameter and its two AdamW moments, all of the parameter's shape.
#[derive(Debug, Clone)]
pub struct AdamWTensors<B: Backend, const D: usize> {
    /// The parameter.
    pub param: Tensor<B, D>,
    /// The first moment `m` (zeros before the first step).
    pub moment_1: Tensor<B, D>,
    /// The second moment `v` (zeros before the first step).
    pub moment_2: Tensor<B, D>,
}

/// The optimizer kernels, on the backend that runs the optimizer (the inner backend of
/// `Autodiff`).
///
/// The default is composed from burn's tensor ops: correct on every backend, and fused into
/// one kernel by burn's fusion on the GPU backends. A backend whose element-wise ops run one
/// at a time overrides it, as Flex does.
pub trait OptimizerKernels: Backend {
    /// One AdamW step of one parameter: the moments updated with `grad`, then the parameter.
    ///
    /// # Shapes
    /// - every tensor: the parameter's shape, any rank `D`
    fn adamw_update<const D: usize>(
        tensors: AdamWTensors<Self, D>,
        grad: Tensor<Self, D>,
        coefficients: &AdamWCoefficients,
    ) -> AdamWTensors<Self, D> {
        adamw_update_composed(tensors, grad, coefficients)
    }
}

/// [`OptimizerKernels::adamw_update`] composed from tensor ops, in burn's order: the reference
/// twin of every backend's kernel.
///
/// # Shapes
/// - every tensor: the parameter's shape
pub fn adamw_update_composed<B: Backend, const D: usize>(
    tensors: AdamWTensors<B, D>,
    grad: Tensor<B, D>,
    c: &AdamWCoefficients,
) -> AdamWTensors<B, D> {
    let moment_1 = tensors
        .moment_1
        .mul_scalar(c.beta_1)
        .add(grad.clone().mul_scalar(1.0 - c.beta_1));
    let moment_2 = tensors
        .moment_2
        .mul_scalar(c.beta_2)
        .add(grad.square().mul_scalar(1.0 - c.beta_2));
    let delta = moment_1
        .clone()
        .div_scalar(c.bias_1)
        .div(moment_2.clone().div_scalar(c.bias_2).sqrt().add_scalar(c.epsilon));
    let param = tensors.param.mul_scalar(c.decay) - delta.mul_scalar(c.lr);
    AdamWTensors {
        param,
        moment_1,
        moment_2,
    }
}

// On NdArray, fusion (which fuses the composed update's element-wise ops into one kernel) and
// autodiff (burn's optimizers run on the inner backend; the wrapper's is for a caller that
// steps tracked tensors itself): the composed default.
default_kernel_impls!(OptimizerKernels, except cubecl);

/// One kernel in place (`optim/cubecl_adamw.rs`); composed where the kernel does not take the
/// tensors (shared or strided ones).
#[cfg(feature = "cubecl")]
impl<R, F, I, BT> OptimizerKernels for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    R::Server: burn_cubecl::cubecl::server::ComputeServer,
    R::Device: burn::tensor::backend::DeviceOps,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    fn adamw_update<const D: usize>(
        tensors: AdamWTensors<Self, D>,
        grad: Tensor<Self, D>,
        coefficients: &AdamWCoefficients,
    ) -> AdamWTensors<Self, D> {
        super::cubecl_adamw::adamw_update(tensors, grad, coefficients)
            .unwrap_or_else(|(tensors, grad)| adamw_update_composed(tensors, grad, coefficients))
    }
}

#[cfg(feature = "flex")]
impl OptimizerKernels for burn::backend::Flex {
    /// One parallel pass in place over the parameter and its moments.
    fn adamw_update<const D: usize>(
        tensors: AdamWTensors<Self, D>,
        grad: Tensor<Self, D>,
        coefficients: &AdamWCoefficients,
    ) -> AdamWTensors<Self, D> {
        super::flex_adamw::adamw_update(tensors, grad, coefficients)
    }
}
