//! RMSNorm as transformers computes it.

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use mpipemoe::backend::DecoderKernels;

/// A block's parameters under their Hugging Face names: projections (a `Linear` named `x` is
/// stored as `x.weight` `[out, in]` and `x.bias`) and vectors under their full names (norm
/// weights `x.weight`, GPT-OSS's `sinks`).
#[derive(Debug)]
pub struct NamedParts<'a, B: Backend> {
    /// The projections.
    pub linears: Vec<(String, &'a Linear<B>)>,
    /// The vectors, stored as they are.
    pub vectors: Vec<(String, &'a Param<Tensor<B, 1>>)>,
}

impl<B: Backend> Default for NamedParts<'_, B> {
    fn default() -> Self {
        Self {
            linears: Vec::new(),
            vectors: Vec::new(),
        }
    }
}

impl<'a, B: Backend> NamedParts<'a, B> {
    /// Adds `other`'s parts.
    pub fn extend(&mut self, other: NamedParts<'a, B>) {
        self.linears.extend(other.linears);
        self.vectors.extend(other.vectors);
    }

    /// Adds norm `norm` named `name` (stored as `name.weight`).
    pub fn norm(&mut self, name: String, norm: &'a RmsNorm<B>) {
        self.vectors.push((format!("{name}.weight"), &norm.weight));
    }
}

/// `weight · x / sqrt(mean(x²) + eps)` over the last dimension (transformers' `*RMSNorm`:
/// `x · rsqrt(variance + eps)`, then the weight).
///
/// # Shapes
/// - input: `[..., width]`
/// - output: the same
#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    /// `[width]`
    pub weight: Param<Tensor<B, 1>>,
    /// Added to the mean square.
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    /// A norm of `width` with weight one.
    pub fn new(width: usize, eps: f64, device: &B::Device) -> Self {
        Self {
            weight: Param::from_tensor(Tensor::ones([width], device)),
            eps,
        }
    }
}

impl<B: DecoderKernels> RmsNorm<B> {
    /// Normalises over the last dimension, with the backend's kernel
    /// ([`DecoderKernels::rms_norm`]: burn's ops, one pass on Flex).
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dims = x.dims();
        let width = self.weight.dims()[0];
        let rows = dims[..D - 1].iter().product::<usize>();
        let y = B::rms_norm(
            x.reshape([rows, width]).into_primitive().tensor(),
            self.weight.val().into_primitive().tensor(),
            self.eps,
        );
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)).reshape(dims)
    }

    /// Normalises the first `width` values of the last dimension of a wider `x`, `width` the
    /// weight's (DeepSeek's latent, the front of its compression), read where they lie
    /// ([`DecoderKernels::rms_norm_columns`]: on the CubeCL backends nothing is copied forward,
    /// and `x`'s gradient is its whole width's rather than a slice's padded).
    ///
    /// # Shapes
    /// - x: `[.., total]` → `[.., width]`
    pub fn forward_columns<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let mut dims = x.dims();
        let total = dims[D - 1];
        let rows = dims[..D - 1].iter().product::<usize>();
        let y = B::rms_norm_columns(
            x.reshape([rows, total]).into_primitive().tensor(),
            self.weight.val().into_primitive().tensor(),
            self.eps,
        );
        dims[D - 1] = self.weight.dims()[0];
        Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)).reshape(dims)
    }
}
