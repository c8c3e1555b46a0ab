//! The experts' activation kernels on backend primitives, overridable per backend.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

/// The activation kernels the fused expert FFN runs on a backend's primitives.
///
/// The defaults are composed from burn's primitive ops and are exact (the erf form of GELU in
/// both directions; burn's own `gelu_backward` is the tanh approximation's derivative on some
/// backends). A backend with faster exact kernels overrides them, as Flex does: its
/// element-wise ops run on one thread, so `mpipemoe` computes GELU on every core for it.
pub trait ActivationKernels: Backend {
    /// The exact (erf) GELU, `z · Φ(z)`.
    ///
    /// # Shapes
    /// - z: any; returns the same shape
    fn gelu_exact(z: FloatTensor<Self>) -> FloatTensor<Self> {
        <Self as burn::tensor::ops::ActivationOps<Self>>::gelu(z)
    }

    /// `grad · d gelu(z)/dz` for the exact (erf) GELU.
    ///
    /// # Shapes
    /// - z, grad: the same shape; returns that shape
    fn gelu_backward_exact(z: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        super::activation::gelu_backward_composed::<Self>(z, grad)
    }

    /// `(gelu(z), grad · d gelu(z)/dz)` at once, for a backward that needs the activation's
    /// value (the second GEMM's weight gradient) beside its derivative: one pass over `z`
    /// where a backend fuses them. The value equals [`gelu_exact`](Self::gelu_exact)'s.
    ///
    /// # Shapes
    /// - z, grad: the same shape; returns two of that shape
    fn gelu_with_backward_exact(
        z: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        (Self::gelu_exact(z.clone()), Self::gelu_backward_exact(z, grad))
    }

    /// SwiGLU, `silu(gate) · up`, of `z = [gate | up]`.
    ///
    /// # Shapes
    /// - z: `[n_rows, 2 · d_hidden]`; returns `[n_rows, d_hidden]`
    fn swiglu(z: FloatTensor<Self>) -> FloatTensor<Self> {
        super::activation::swiglu_composed::<Self>(z)
    }

    /// `d swiglu(z)/dz · grad`: `[d gate | d up]`.
    ///
    /// # Shapes
    /// - z: `[n_rows, 2 · d_hidden]`; grad: `[n_rows, d_hidden]`; returns `[n_rows, 2 · d_hidden]`
    fn swiglu_backward(z: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        super::activation::swiglu_backward_composed::<Self>(z, grad)
    }

    /// `(swiglu(z), d swiglu(z)/dz · grad)` at once (see
    /// [`gelu_with_backward_exact`](Self::gelu_with_backward_exact)).
    ///
    /// # Shapes
    /// - z: `[n_rows, 2 · d_hidden]`; grad: `[n_rows, d_hidden]`; returns `[n_rows, d_hidden]`
    ///   and `[n_rows, 2 · d_hidden]`
    fn swiglu_with_backward(
        z: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        (Self::swiglu(z.clone()), Self::swiglu_backward(z, grad))
    }

    /// GPT-OSS's clamped SwiGLU of `z = [gate | up]`: `(u + 1) · g · σ(alpha · g)` with
    /// `g = min(gate, limit)` and `u = clamp(up, −limit, limit)`.
    ///
    /// # Shapes
    /// - z: `[n_rows, 2 · d_hidden]`; returns `[n_rows, d_hidden]`
    fn clamped_swiglu(z: FloatTensor<Self>, alpha: f32, limit: f32) -> FloatTensor<Self> {
        super::activation::clamped_swiglu_composed::<Self>(z, alpha, limit)
    }

    /// `d clamped_swiglu(z)/dz · grad`: `[d gate | d up]`, zero where a clamp clamped (the
    /// bounds themselves pass the gradient, as torch's clamps do).
    ///
    /// # Shapes
    /// - z: `[n_rows, 2 · d_hidden]`; grad: `[n_rows, d_hidden]`; returns `[n_rows, 2 · d_hidden]`
    fn clamped_swiglu_backward(
        z: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        alpha: f32,
        limit: f32,
    ) -> FloatTensor<Self> {
        super::activation::clamped_swiglu_backward_composed::<Self>(z, grad, alpha, limit)
    }

    /// `(clamped_swiglu(z), d clamped_swiglu(z)/dz · grad)` at once (see
    /// [`gelu_with_backward_exact`](Self::gelu_with_backward_exact)).
    ///
    /// # Shapes
    /// - z: `[n_rows, 2 · d_hidden]`; grad: `[n_rows, d_hidden]`; returns `[n_rows, d_hidden]`
    ///   and `[n_rows, 2 · d_hidden]`
    fn clamped_swiglu_with_backward(
        z: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        alpha: f32,
        limit: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        (
            Self::clamped_swiglu(z.clone(), alpha, limit),
            Self::clamped_swiglu_backward(z, grad, alpha, limit),
        )
    }
}

// On NdArray, fusion (where the layer computes an activation outside the exchange, on the
// reference path, fusion can fuse the composed erf GELU with its neighbours; the exchange itself
// runs the inner backend's kernels) and autodiff (the exchange runs its expert FFNs on the inner
// backend, so the wrapper never calls them on tracked tensors): the defaults. The CubeCL
// backends have kernels of their own (below).
default_kernel_impls!(ActivationKernels, except cubecl);

/// One kernel each way (`cubecl_activation.rs`), the composed form for what the kernels do not
/// read (strided views, other dtypes).
#[cfg(feature = "cubecl")]
impl<R, F, I, BT> ActivationKernels for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    R::Server: burn_cubecl::cubecl::server::ComputeServer,
    R::Device: burn::tensor::backend::DeviceOps,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    fn gelu_exact(z: FloatTensor<Self>) -> FloatTensor<Self> {
        super::cubecl_activation::gelu(&z)
            .unwrap_or_else(|| <Self as burn::tensor::ops::ActivationOps<Self>>::gelu(z))
    }

    fn gelu_backward_exact(z: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        super::cubecl_activation::gelu_backward(&z, &grad)
            .unwrap_or_else(|| super::activation::gelu_backward_composed::<Self>(z, grad))
    }

    fn gelu_with_backward_exact(
        z: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        super::cubecl_activation::gelu_with_backward(&z, &grad)
            .unwrap_or_else(|| (Self::gelu_exact(z.clone()), Self::gelu_backward_exact(z, grad)))
    }

    fn swiglu(z: FloatTensor<Self>) -> FloatTensor<Self> {
        super::cubecl_activation::swiglu(&z, None)
            .unwrap_or_else(|| super::activation::swiglu_composed::<Self>(z))
    }

    fn swiglu_backward(z: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        super::cubecl_activation::swiglu_backward(&z, &grad, None)
            .unwrap_or_else(|| super::activation::swiglu_backward_composed::<Self>(z, grad))
    }

    fn swiglu_with_backward(
        z: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        super::cubecl_activation::swiglu_with_backward(&z, &grad, None)
            .unwrap_or_else(|| (Self::swiglu(z.clone()), Self::swiglu_backward(z, grad)))
    }

    fn clamped_swiglu(z: FloatTensor<Self>, alpha: f32, limit: f32) -> FloatTensor<Self> {
        super::cubecl_activation::swiglu(&z, Some((alpha, limit)))
            .unwrap_or_else(|| super::activation::clamped_swiglu_composed::<Self>(z, alpha, limit))
    }

    fn clamped_swiglu_backward(
        z: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        alpha: f32,
        limit: f32,
    ) -> FloatTensor<Self> {
        super::cubecl_activation::swiglu_backward(&z, &grad, Some((alpha, limit))).unwrap_or_else(|| {
            super::activation::clamped_swiglu_backward_composed::<Self>(z, grad, alpha, limit)
        })
    }

    fn clamped_swiglu_with_backward(
        z: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        alpha: f32,
        limit: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        super::cubecl_activation::swiglu_with_backward(&z, &grad, Some((alpha, limit))).unwrap_or_else(|| {
            (
                Self::clamped_swiglu(z.clone(), alpha, limit),
                Self::clamped_swiglu_backward(z, grad, alpha, limit),
            )
        })
    }
}

#[cfg(feature = "flex")]
impl ActivationKernels for burn::backend::Flex {
    /// Flex's element-wise ops run on one thread; this one uses every core.
    fn gelu_exact(z: FloatTensor<Self>) -> FloatTensor<Self> {
        super::flex_gelu::gelu(z)
    }

    /// The exact erf derivative in one pass over every core, in place where it can be.
    fn gelu_backward_exact(z: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        super::flex_gelu::gelu_backward(z, grad)
    }

    /// One vectorised pass over every core; the composed form for layouts it does not read.
    fn swiglu(z: FloatTensor<Self>) -> FloatTensor<Self> {
        super::flex_swiglu::swiglu(z)
    }

    /// One vectorised pass over every core; the composed form for layouts it does not read.
    fn swiglu_backward(z: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        super::flex_swiglu::swiglu_backward(z, grad)
    }

    /// One vectorised pass over every core; the composed form for layouts it does not read.
    fn clamped_swiglu(z: FloatTensor<Self>, alpha: f32, limit: f32) -> FloatTensor<Self> {
        super::flex_swiglu::clamped_swiglu(z, alpha, limit)
    }

    /// One vectorised pass over every core; the composed form for layouts it does not read.
    fn clamped_swiglu_backward(
        z: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        alpha: f32,
        limit: f32,
    ) -> FloatTensor<Self> {
        super::flex_swiglu::clamped_swiglu_backward(z, grad, alpha, limit)
    }
}
