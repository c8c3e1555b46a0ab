//! The experts' activation kernels on backend primitives, overridable per backend.

use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::Autodiff;
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
}

#[cfg(feature = "ndarray")]
impl<E, I, Q> ActivationKernels for burn::backend::NdArray<E, I, Q>
where
    E: burn::backend::ndarray::FloatNdArrayElement,
    I: burn::backend::ndarray::IntNdArrayElement,
    Q: burn::backend::ndarray::QuantElement,
    burn::backend::ndarray::NdArrayTensor:
        From<burn::backend::ndarray::SharedArray<E>> + From<burn::backend::ndarray::SharedArray<I>>,
{
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
}

/// The exchange runs its expert FFNs on the inner backend, so the autodiff wrapper only needs
/// the defaults (it never calls them on tracked tensors).
impl<B: ActivationKernels, C: CheckpointStrategy> ActivationKernels for Autodiff<B, C> {}

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
}

/// The defaults on fusion tensors: where the layer computes an activation outside the
/// exchange (the reference path), fusion can fuse the composed erf GELU with its neighbours;
/// the exchange itself runs the inner backend's kernels.
#[cfg(feature = "fusion")]
impl<B: burn_fusion::FusionBackend + ActivationKernels> ActivationKernels for burn_fusion::Fusion<B> {}
