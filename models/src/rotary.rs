//! Rotary position embeddings (unscaled), computed as transformers computes them.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

/// Rotary embeddings of `head_dim` with base `theta`, applied in transformers' "rotate half"
/// layout: the first half of a head pairs with the second half.
///
/// The angles are computed in f32 as transformers does in every dtype
/// (`inv_freq = 1 / theta^(2i / d)` in f32, `angle = inv_freq · position` in f32, then cos and
/// sin), so that the tables are the same numbers.
#[derive(Debug, Clone)]
pub struct Rotary {
    inv_freq: Vec<f32>,
}

impl Rotary {
    /// For heads of `head_dim` (even) and base `theta`.
    pub fn new(head_dim: usize, theta: f64) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| {
                let exponent = (2 * i) as f32 / head_dim as f32;
                1.0 / (theta as f32).powf(exponent)
            })
            .collect();
        Self { inv_freq }
    }

    /// `cos` and `sin` for `positions`, each `[n_positions, head_dim]` (the half-width table
    /// repeated twice, as `cat(freqs, freqs)`).
    pub fn tables<B: Backend>(
        &self,
        positions: &[usize],
        device: &B::Device,
    ) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * 2 * half);
        let mut sin = Vec::with_capacity(positions.len() * 2 * half);
        for &p in positions {
            for _ in 0..2 {
                for &f in &self.inv_freq {
                    let angle = f * p as f32;
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        let shape = [positions.len(), 2 * half];
        (
            Tensor::from_data(TensorData::new(cos, shape), device),
            Tensor::from_data(TensorData::new(sin, shape), device),
        )
    }

    /// Rotates `x` by the tables of its positions.
    ///
    /// # Shapes
    /// - x: `[batch, heads, seq, head_dim]`
    /// - cos, sin: `[seq, head_dim]`
    pub fn apply<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 2>, sin: &Tensor<B, 2>) -> Tensor<B, 4> {
        let [b, h, t, d] = x.dims();
        let half = d / 2;
        let first = x.clone().slice([0..b, 0..h, 0..t, 0..half]);
        let second = x.clone().slice([0..b, 0..h, 0..t, half..d]);
        let rotated = Tensor::cat(vec![second.neg(), first], 3);
        let cos = cos.clone().unsqueeze::<4>();
        let sin = sin.clone().unsqueeze::<4>();
        x * cos + rotated * sin
    }
}
