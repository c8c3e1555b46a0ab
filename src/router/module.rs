//! The router module: logits, softmax, top-k.

use burn::module::{Module, Param};
use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use super::top_k_host;
use crate::experts::HostInit;

/// The gate: `logits = x · weight^T (+ bias)`, softmax over all experts, top-k.
///
/// Replicated on every rank; its gradients are summed over ranks like any data-parallel
/// parameter.
///
/// # Shapes
/// - weight: `[n_experts, d_model]` (the Hugging Face / canonical layout)
/// - bias: `[n_experts]`
#[derive(Module, Debug)]
pub struct Router<B: Backend> {
    /// Gate weights.
    pub weight: Param<Tensor<B, 2>>,
    /// Gate bias, if any.
    pub bias: Option<Param<Tensor<B, 1>>>,
}

/// The router's decision for a batch of tokens.
#[derive(Debug, Clone)]
pub struct Routing<B: Backend> {
    /// `[n_tokens, n_experts]`
    pub logits: Tensor<B, 2>,
    /// Softmax of the logits. `[n_tokens, n_experts]`
    pub probs: Tensor<B, 2>,
    /// Combine weights of the chosen experts, differentiable. `[n_tokens, top_k]`
    pub weights: Tensor<B, 2>,
    /// Chosen experts per token, best first, on the host. `[n_tokens * top_k]`
    pub indices: Vec<usize>,
}

impl<B: Backend> Router<B> {
    pub(crate) fn init(n_experts: usize, d_model: usize, bias: bool, seed: u64, device: &B::Device) -> Self {
        let weight = HostInit::new(seed, "router.weight", 0).tensor([n_experts, d_model], d_model, device);
        let bias = bias.then(|| {
            Param::from_tensor(HostInit::new(seed, "router.bias", 0).tensor([n_experts], d_model, device))
        });
        Self {
            weight: Param::from_tensor(weight),
            bias,
        }
    }

    /// Number of experts the router chooses among.
    pub fn n_experts(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Routes `x` to its `top_k` best experts.
    ///
    /// The selection reads the logits on the host (one `[n_tokens, n_experts]` transfer); the
    /// combine weights are gathered from the softmax on the device so that gradients reach the
    /// router. With `normalize`, each token's `top_k` weights are divided by their sum.
    ///
    /// # Shapes
    /// - x: `[n_tokens, d_model]`
    pub fn route(&self, x: Tensor<B, 2>, top_k: usize, normalize: bool) -> Routing<B> {
        let [n_tokens, _] = x.dims();
        let n_experts = self.n_experts();
        // NdArray cannot multiply a matrix with no rows; a rank with no tokens still routes
        // (to nothing) so that it joins every collective.
        let mut logits = if n_tokens == 0 {
            Tensor::zeros([0, n_experts], &x.device())
        } else {
            x.matmul(self.weight.val().transpose())
        };
        if let Some(bias) = &self.bias {
            logits = logits + bias.val().unsqueeze::<2>();
        }
        let host: Vec<f32> = logits
            .to_data()
            .convert::<f32>()
            .into_vec()
            .expect("logits convert to f32");
        let indices = if n_tokens == 0 {
            Vec::new()
        } else {
            top_k_host(&host, n_experts, top_k)
        };
        let probs = softmax(logits.clone(), 1);
        let weights = if n_tokens == 0 {
            Tensor::zeros([0, top_k], &probs.device())
        } else {
            let index_data = TensorData::new(
                indices.iter().map(|&i| i as i64).collect::<Vec<_>>(),
                [n_tokens, top_k],
            );
            let index = Tensor::<B, 2, Int>::from_data(index_data, &probs.device());
            let chosen = probs.clone().gather(1, index);
            if normalize {
                chosen.clone() / chosen.sum_dim(1)
            } else {
                chosen
            }
        };
        Routing {
            logits,
            probs,
            weights,
            indices,
        }
    }
}
