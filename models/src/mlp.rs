//! The dense feed-forward block of the layers that are not MoE.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use mpipemoe::decoder::gated_silu_of;
use mpipemoe::{MoeBackend, Result};

use crate::linear::DenseProducts;
use crate::lora::project_all;

/// `down(silu(gate(x)) · up(x))`, no biases (the `mlp` of Qwen2-MoE's and Qwen3-MoE's dense
/// layers, DeepSeek's first layers, Llama's MLP).
///
/// # Shapes
/// - input: `[batch, seq, d_model]`
/// - output: the same
#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    /// `[d_model, d_hidden]`
    pub gate: Linear<B>,
    /// `[d_model, d_hidden]`
    pub up: Linear<B>,
    /// `[d_hidden, d_model]`
    pub down: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    /// Randomly initialised, as burn initialises a `Linear`.
    pub fn new(d_model: usize, d_hidden: usize, device: &B::Device) -> Self {
        let linear = |i, o| LinearConfig::new(i, o).with_bias(false).init(device);
        Self {
            gate: linear(d_model, d_hidden),
            up: linear(d_model, d_hidden),
            down: linear(d_hidden, d_model),
        }
    }

    /// The Hugging Face names of its projections under `prefix` (`...mlp`).
    pub fn hf_parts(&self, prefix: &str) -> Vec<(String, &Linear<B>)> {
        vec![
            (format!("{prefix}.gate_proj"), &self.gate),
            (format!("{prefix}.up_proj"), &self.up),
            (format!("{prefix}.down_proj"), &self.down),
        ]
    }
}

impl<B: MoeBackend> Mlp<B> {
    /// Applies the block, its products as `dense` makes them.
    ///
    /// # Errors
    /// As [`DenseProducts::matmul`].
    pub fn forward(&self, x: Tensor<B, 3>, dense: &DenseProducts) -> Result<Tensor<B, 3>> {
        // Both projections of the input in one call (one cuBLAS section on CUDA).
        let [gate, up]: [Tensor<B, 3>; 2] = project_all(dense, &[(&self.gate, None), (&self.up, None)], x)?
            .try_into()
            .unwrap_or_else(|_| unreachable!("one output per projection"));
        // One SwiGLU op each way where the backend has the kernel (the halves joined by one
        // copy), burn's `silu(gate) · up` elsewhere.
        let hidden = gated_silu_of(gate, up);
        dense.linear(&self.down, hidden)
    }
}
