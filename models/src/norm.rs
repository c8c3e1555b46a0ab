//! RMSNorm as transformers computes it.

use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// A block's projections and norms under their Hugging Face names (a `Linear` named `x` is
/// stored as `x.weight` `[out, in]` and `x.bias`; a norm named `x` as `x.weight`).
pub type NamedParts<'a, B> = (Vec<(String, &'a Linear<B>)>, Vec<(String, &'a RmsNorm<B>)>);

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

    /// Normalises over the last dimension.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let mean_square = x.clone().powi_scalar(2).mean_dim(D - 1);
        let normalised = x * (mean_square + self.eps).sqrt().recip();
        let width = self.weight.dims()[0];
        let mut shape = [1; D];
        shape[D - 1] = width;
        normalised * self.weight.val().reshape(shape)
    }
}
