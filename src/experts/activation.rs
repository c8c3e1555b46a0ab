//! Expert activations, on plain tensors (reference path) and on primitives (fused op).

use burn::tensor::activation;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::Tensor;
use serde::{Deserialize, Serialize};

use super::ActivationKernels;

/// The expert FFN's activation.
///
/// `Eq` and `Hash` hold because [`Activation::clamped_swiglu`], the only way to build the one
/// variant with numbers, refuses NaN; its numbers hash by their bits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Activation {
    /// GELU in its exact erf form, `x · Φ(x)`.
    Gelu,
    /// `max(x, 0)`.
    Relu,
    /// `silu(gate) · up`, with the first expert GEMM producing `[gate | up]` (2·d_hidden).
    SwiGlu,
    /// GPT-OSS's clamped SwiGLU on `[gate | up]`:
    /// `g = min(gate, limit)`, `u = clamp(up, -limit, limit)`, `(u + 1) · g · σ(alpha · g)`.
    /// Build it with [`Activation::clamped_swiglu`].
    ClampedSwiGlu {
        /// The sigmoid's slope (GPT-OSS: 1.702).
        alpha: f32,
        /// The clamp (GPT-OSS: `swiglu_limit`, 7.0).
        limit: f32,
    },
}

impl Eq for Activation {}

impl std::hash::Hash for Activation {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        std::mem::discriminant(self).hash(state);
        if let Activation::ClampedSwiGlu { alpha, limit } = self {
            (alpha.to_bits(), limit.to_bits()).hash(state);
        }
    }
}

impl Activation {
    /// GPT-OSS's clamped SwiGLU with slope `alpha` and clamp `limit`.
    ///
    /// # Errors
    /// [`MoeError::Config`](crate::error::MoeError::Config) naming `alpha` or `limit` if it is not
    /// a finite positive number.
    pub fn clamped_swiglu(alpha: f64, limit: f64) -> crate::error::Result<Self> {
        for (field, value) in [("alpha", alpha), ("limit", limit)] {
            if !(value.is_finite() && value > 0.0 && value <= f32::MAX as f64) {
                return Err(crate::error::MoeError::config(
                    field,
                    format!("the clamped SwiGLU's {field} is {value}; it must be a finite positive number"),
                ));
            }
        }
        Ok(Activation::ClampedSwiGlu {
            alpha: alpha as f32,
            limit: limit as f32,
        })
    }

    /// Whether the first GEMM's output is `[gate | up]` (both SwiGLU forms).
    pub fn gated(self) -> bool {
        matches!(self, Activation::SwiGlu | Activation::ClampedSwiGlu { .. })
    }

    /// Width of the first GEMM's output for a hidden width `d_hidden`.
    pub fn d_inner(self, d_hidden: usize) -> usize {
        match self.gated() {
            true => 2 * d_hidden,
            false => d_hidden,
        }
    }

    /// Width of the activation's output for a first GEMM of `d_inner` columns.
    pub fn d_hidden(self, d_inner: usize) -> usize {
        match self.gated() {
            true => d_inner / 2,
            false => d_inner,
        }
    }

    /// The name used in case files and on the command line (`swiglu_clamped` files carry
    /// `swiglu_alpha` and `swiglu_limit` beside it).
    pub fn name(self) -> &'static str {
        match self {
            Activation::Gelu => "gelu",
            Activation::Relu => "relu",
            Activation::SwiGlu => "swiglu",
            Activation::ClampedSwiGlu { .. } => "swiglu_clamped",
        }
    }

    /// Parses `gelu`, `relu` or `swiglu`; the clamped SwiGLU needs its numbers
    /// ([`Activation::clamped_swiglu`]).
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
            Activation::ClampedSwiGlu { alpha, limit } => {
                let [rows, inner] = z.dims();
                let hidden = inner / 2;
                let (alpha, limit) = (alpha as f64, limit as f64);
                // burn's clamps pass the gradient where the value is within the bounds,
                // bounds included, as torch's do.
                let gate = z.clone().slice([0..rows, 0..hidden]).clamp_max(limit);
                let up = z.slice([0..rows, hidden..inner]).clamp(-limit, limit);
                let glu = gate.clone() * activation::sigmoid(gate * alpha);
                (up.add_scalar(1.0)) * glu
            }
        }
    }
}

/// `act(z)` on primitives. `z` is `[n_rows, d_inner]`.
pub(crate) fn activation_forward<B: ActivationKernels>(act: Activation, z: FloatTensor<B>) -> FloatTensor<B> {
    match act {
        Activation::Gelu => B::gelu_exact(z),
        Activation::Relu => B::relu(z),
        Activation::SwiGlu => B::swiglu(z),
        Activation::ClampedSwiGlu { alpha, limit } => B::clamped_swiglu(z, alpha, limit),
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
        Activation::SwiGlu => B::swiglu_backward(z, grad),
        Activation::ClampedSwiGlu { alpha, limit } => B::clamped_swiglu_backward(z, grad, alpha, limit),
    }
}

/// `(act(z), d act(z)/dz · grad)` on primitives, from one kernel where the backend fuses the
/// two: for a backward that needs the activation's value beside its derivative. Shapes as
/// [`activation_forward`] and [`activation_backward`].
pub(crate) fn activation_with_backward<B: ActivationKernels>(
    act: Activation,
    z: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    match act {
        Activation::Gelu => B::gelu_with_backward_exact(z, grad),
        Activation::Relu => (B::relu(z.clone()), B::relu_backward(z, grad)),
        Activation::SwiGlu => B::swiglu_with_backward(z, grad),
        Activation::ClampedSwiGlu { alpha, limit } => B::clamped_swiglu_with_backward(z, grad, alpha, limit),
    }
}

/// GPT-OSS's clamped SwiGLU composed from primitives; the default of
/// [`ActivationKernels::clamped_swiglu`]: `(u + 1) · g · σ(alpha · g)` with
/// `g = min(gate, limit)` and `u = clamp(up, ±limit)`. `z` is `[n_rows, 2 · d_hidden]`.
pub(crate) fn clamped_swiglu_composed<B: Backend>(
    z: FloatTensor<B>,
    alpha: f32,
    limit: f32,
) -> FloatTensor<B> {
    let (gate, up) = split_halves::<B>(z);
    let gate = B::float_clamp_max(gate, limit.into());
    let up = B::float_clamp(up, (-limit).into(), limit.into());
    let glu = B::float_mul(gate.clone(), B::sigmoid(B::float_mul_scalar(gate, alpha.into())));
    B::float_mul(B::float_add_scalar(up, 1.0.into()), glu)
}

/// The clamped SwiGLU's backward composed from primitives; the default of
/// [`ActivationKernels::clamped_swiglu_backward`]. With `g = min(gate, limit)`,
/// `u = clamp(up, ±limit)` and `s = σ(alpha · g)`:
/// `d/d up = grad · g · s` where `|up| <= limit`, else 0;
/// `d/d gate = grad · (u + 1) · s · (1 + alpha · g · (1 − s))` where `gate <= limit`, else 0.
pub(crate) fn clamped_swiglu_backward_composed<B: Backend>(
    z: FloatTensor<B>,
    grad: FloatTensor<B>,
    alpha: f32,
    limit: f32,
) -> FloatTensor<B> {
    let bool_dtype = burn::tensor::get_device_settings::<B>(&B::float_device(&z)).bool_dtype;
    let (gate, up) = split_halves::<B>(z);
    // The clamps' masks: where the input was clamped, its gradient is zero.
    let gate_clamped = B::float_greater_elem(gate.clone(), limit.into(), bool_dtype);
    let up_clamped = B::bool_or(
        B::float_greater_elem(up.clone(), limit.into(), bool_dtype),
        B::float_lower_elem(up.clone(), (-limit).into(), bool_dtype),
    );
    let g = B::float_clamp_max(gate, limit.into());
    let u = B::float_clamp(up, (-limit).into(), limit.into());
    let s = B::sigmoid(B::float_mul_scalar(g.clone(), alpha.into()));
    let glu = B::float_mul(g.clone(), s.clone());
    let d_up = B::float_mask_fill(B::float_mul(grad.clone(), glu), up_clamped, 0.0.into());
    let one_minus = B::float_add_scalar(B::float_neg(s.clone()), 1.0.into());
    let slope = B::float_add_scalar(
        B::float_mul_scalar(B::float_mul(g, one_minus), alpha.into()),
        1.0.into(),
    );
    let d_glu = B::float_mul(grad, B::float_add_scalar(u, 1.0.into()));
    let d_gate = B::float_mask_fill(
        B::float_mul(d_glu, B::float_mul(s, slope)),
        gate_clamped,
        0.0.into(),
    );
    B::float_cat(vec![d_gate, d_up], 1)
}

/// SwiGLU composed from primitives; the default of [`ActivationKernels::swiglu`].
/// `z` is `[n_rows, 2 · d_hidden]`.
pub(crate) fn swiglu_composed<B: Backend>(z: FloatTensor<B>) -> FloatTensor<B> {
    let (gate, up) = split_halves::<B>(z);
    B::float_mul(B::float_mul(gate.clone(), B::sigmoid(gate)), up)
}

/// SwiGLU's backward composed from primitives; the default of
/// [`ActivationKernels::swiglu_backward`]. `z` is `[n_rows, 2 · d_hidden]`, `grad`
/// `[n_rows, d_hidden]`.
pub(crate) fn swiglu_backward_composed<B: Backend>(
    z: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
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
