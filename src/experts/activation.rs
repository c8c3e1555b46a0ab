//! Expert activations, on plain tensors (reference path) and on primitives (fused op).

use burn::tensor::activation;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use super::ActivationKernels;

/// The expert FFN's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Activation {
    /// GELU in its exact erf form, `x · Φ(x)`.
    Gelu,
    /// `max(x, 0)`.
    Relu,
    /// `silu(gate) · up`, with the first expert GEMM producing `[gate | up]` (2·d_hidden).
    SwiGlu,
}

impl Activation {
    /// Width of the first GEMM's output for a hidden width `d_hidden`.
    pub fn d_inner(self, d_hidden: usize) -> usize {
        match self {
            Activation::SwiGlu => 2 * d_hidden,
            _ => d_hidden,
        }
    }

    /// The name used in case files and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Activation::Gelu => "gelu",
            Activation::Relu => "relu",
            Activation::SwiGlu => "swiglu",
        }
    }

    /// Parses `gelu`, `relu` or `swiglu`.
    pub fn parse(name: &str) -> Option<Self> {
        [Activation::Gelu, Activation::Relu, Activation::SwiGlu]
            .into_iter()
            .find(|a| a.name().eq_ignore_ascii_case(name))
    }

    /// Applies the activation with ordinary (differentiable) tensor ops.
    ///
    /// GELU is built from `erf` rather than `activation::gelu` because some backends
    /// (NdArray) differentiate the latter with the tanh approximation.
    ///
    /// # Shapes
    /// - z: `[n_rows, d_inner]`
    /// - returns `[n_rows, d_hidden]`
    pub fn forward<B: Backend>(self, z: Tensor<B, 2>) -> Tensor<B, 2> {
        match self {
            Activation::Gelu => {
                let cdf = (z.clone() * std::f64::consts::FRAC_1_SQRT_2)
                    .erf()
                    .add_scalar(1.0)
                    * 0.5;
                z * cdf
            }
            Activation::Relu => activation::relu(z),
            Activation::SwiGlu => {
                let [rows, inner] = z.dims();
                let hidden = inner / 2;
                let gate = z.clone().slice([0..rows, 0..hidden]);
                let up = z.slice([0..rows, hidden..inner]);
                activation::silu(gate) * up
            }
        }
    }
}

/// `act(z)` on primitives. `z` is `[n_rows, d_inner]`.
pub(crate) fn activation_forward<B: ActivationKernels>(act: Activation, z: FloatTensor<B>) -> FloatTensor<B> {
    match act {
        Activation::Gelu => B::gelu_exact(z),
        Activation::Relu => B::relu(z),
        Activation::SwiGlu => {
            let (gate, up) = split_halves::<B>(z);
            B::float_mul(silu::<B>(gate), up)
        }
    }
}

/// `d act(z) / dz · grad`, on primitives. `z` is `[n_rows, d_inner]`, `grad` `[n_rows, d_hidden]`.
pub(crate) fn activation_backward<B: ActivationKernels>(
    act: Activation,
    z: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    match act {
        Activation::Gelu => B::gelu_backward_exact(z, grad),
        // ReLU's mask is the same whether read from z or from relu(z).
        Activation::Relu => B::relu_backward(z, grad),
        Activation::SwiGlu => {
            let (gate, up) = split_halves::<B>(z);
            let sig = B::sigmoid(gate.clone());
            // d/d up = grad · silu(gate)
            let d_up = B::float_mul(grad.clone(), B::float_mul(gate.clone(), sig.clone()));
            // d/d gate = grad · up · σ(g) · (1 + g · (1 − σ(g)))
            let one_minus = B::float_add_scalar(B::float_neg(sig.clone()), 1.0.into());
            let slope = B::float_add_scalar(B::float_mul(gate, one_minus), 1.0.into());
            let d_gate = B::float_mul(B::float_mul(grad, up), B::float_mul(sig, slope));
            B::float_cat(vec![d_gate, d_up], 1)
        }
    }
}

fn silu<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    B::float_mul(x.clone(), B::sigmoid(x))
}

fn split_halves<B: Backend>(z: FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    use burn::tensor::TensorMetadata;
    let dims = z.shape().to_vec();
    let (rows, hidden) = (dims[0], dims[1] / 2);
    let gate = B::float_slice(z.clone(), &[(0..rows).into(), (0..hidden).into()]);
    let up = B::float_slice(z, &[(0..rows).into(), (hidden..2 * hidden).into()]);
    (gate, up)
}

/// Exact GELU backward, `grad · (Φ(z) + z · φ(z))`, composed from primitives; the default
/// of [`ActivationKernels::gelu_backward_exact`].
pub(crate) fn gelu_backward_composed<B: Backend>(z: FloatTensor<B>, grad: FloatTensor<B>) -> FloatTensor<B> {
    let scaled = B::float_mul_scalar(z.clone(), std::f64::consts::FRAC_1_SQRT_2.into());
    let cdf = B::float_mul_scalar(B::float_add_scalar(B::float_erf(scaled), 1.0.into()), 0.5.into());
    let sq = B::float_mul(z.clone(), z.clone());
    let pdf = B::float_mul_scalar(
        B::float_exp(B::float_mul_scalar(sq, (-0.5).into())),
        (1.0 / (2.0 * std::f64::consts::PI).sqrt()).into(),
    );
    let slope = B::float_add(cdf, B::float_mul(z, pdf));
    B::float_mul(grad, slope)
}
