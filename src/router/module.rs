//! The router module: logits, scores, top-k.

use burn::module::{Module, Param, ParamId};
use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use super::{group_limited_top_k, RoutingRule, Scoring};
use crate::experts::HostInit;

/// The gate: `logits = x · weight^T (+ bias)`, scores (softmax over all experts, or a sigmoid
/// per expert), and the top-k choice, optionally group-limited and biased for selection.
///
/// Replicated on every rank; its gradients are summed over ranks like any data-parallel
/// parameter. It is a part of [`MoeLayer`](crate::MoeLayer) (its `router` field), built by
/// [`MoeLayerConfig::init`](crate::MoeLayerConfig::init) with the rest of the layer; it is
/// public so that its parameters can be read, loaded and given to an optimizer.
///
/// # Shapes
/// - weight: `[n_experts, d_model]` (the Hugging Face / canonical layout)
/// - bias: `[n_experts]`
/// - score_bias: `[n_experts]`
#[derive(Module, Debug)]
pub struct Router<B: Backend> {
    /// Gate weights.
    pub weight: Param<Tensor<B, 2>>,
    /// Gate bias, if any (added to the logits; trained).
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// DeepSeek-V3's per-expert score correction: added to the scores when *choosing* experts
    /// only, never to the combine weights. A buffer, not trained by gradient (it does not
    /// require one); [`MoeLayer::balance_score_bias`](crate::MoeLayer::balance_score_bias)
    /// moves it towards balanced load. It is part of the module's record, so it is saved and
    /// loaded with the model.
    pub score_bias: Option<Param<Tensor<B, 1>>>,
}

/// The router's decision for a batch of tokens.
#[derive(Debug, Clone)]
pub struct Routing<B: Backend> {
    /// `[n_tokens, n_experts]`
    pub logits: Tensor<B, 2>,
    /// Each token's distribution over experts, for the load-balancing loss: the softmax, or
    /// the sigmoid scores divided by their sum. `[n_tokens, n_experts]`
    pub probs: Tensor<B, 2>,
    /// Combine weights of the chosen experts, differentiable. `[n_tokens, top_k]`
    pub weights: Tensor<B, 2>,
    /// Chosen experts per token, best first, on the host. `[n_tokens * top_k]`
    pub indices: Vec<usize>,
}

impl<B: Backend> Router<B> {
    pub(crate) fn init(
        n_experts: usize,
        d_model: usize,
        bias: bool,
        score_bias: bool,
        seed: u64,
        device: &B::Device,
    ) -> Self {
        let weight = HostInit::new(seed, "router.weight", 0).tensor([n_experts, d_model], d_model, device);
        let bias = bias.then(|| {
            Param::from_tensor(HostInit::new(seed, "router.bias", 0).tensor([n_experts], d_model, device))
        });
        Self {
            weight: Param::from_tensor(weight),
            bias,
            score_bias: score_bias.then(|| buffer(Tensor::zeros([n_experts], device))),
        }
    }

    /// Number of experts the router chooses among.
    pub fn n_experts(&self) -> usize {
        self.weight.dims()[0]
    }

    /// Routes `x` to each token's `rule.top_k` best experts.
    ///
    /// The choice reads the scores on the host (one `[n_tokens, n_experts]` transfer); the
    /// combine weights are gathered from the scores on the device so that gradients reach the
    /// router. With `rule.normalize` each token's weights are divided by their sum (plus
    /// 1e-20 for sigmoid scores, which can all be tiny), then multiplied by `rule.scaling`.
    ///
    /// # Shapes
    /// - x: `[n_tokens, d_model]`
    pub fn route(&self, x: Tensor<B, 2>, rule: &RoutingRule) -> Routing<B> {
        let [n_tokens, _] = x.dims();
        let n_experts = self.n_experts();
        let device = x.device();
        // NdArray cannot multiply a matrix with no rows; a rank with no tokens still routes
        // (to nothing) so that it joins every collective.
        let mut logits = if n_tokens == 0 {
            Tensor::zeros([0, n_experts], &device)
        } else {
            x.matmul(self.weight.val().transpose())
        };
        if let Some(bias) = &self.bias {
            logits = logits + bias.val().unsqueeze::<2>();
        }
        let scores = match rule.scoring {
            Scoring::Softmax => softmax(logits.clone(), 1),
            Scoring::Sigmoid => sigmoid(logits.clone()),
        };
        let indices = if n_tokens == 0 {
            Vec::new()
        } else {
            group_limited_top_k(
                &self.choice_scores(&logits, &scores),
                n_experts,
                rule.top_k,
                rule.n_group,
                rule.topk_group,
            )
        };
        let weights = if n_tokens == 0 {
            Tensor::zeros([0, rule.top_k], &device)
        } else {
            let index_data = TensorData::new(
                indices.iter().map(|&i| i as i64).collect::<Vec<_>>(),
                [n_tokens, rule.top_k],
            );
            let index = Tensor::<B, 2, Int>::from_data(index_data, &device);
            let mut chosen = scores.clone().gather(1, index);
            if rule.normalize {
                let sum = chosen.clone().sum_dim(1);
                chosen = match rule.scoring {
                    Scoring::Softmax => chosen / sum,
                    Scoring::Sigmoid => chosen / sum.add_scalar(1e-20),
                };
            }
            if rule.scaling != 1.0 {
                chosen = chosen * rule.scaling;
            }
            chosen
        };
        let probs = match rule.scoring {
            Scoring::Softmax => scores,
            Scoring::Sigmoid => scores.clone() / scores.sum_dim(1),
        };
        Routing {
            logits,
            probs,
            weights,
            indices,
        }
    }

    /// What experts are chosen by, on the host: the scores plus the score bias where there is
    /// one. A router without one chooses by its logits, which order the experts as the
    /// softmax or the sigmoid does without their rounding: a sigmoid rounds every logit above
    /// about 17 to 1.0 in f32, which would turn a clear choice into a tie (Llama 4 chooses
    /// by the logits).
    fn choice_scores(&self, logits: &Tensor<B, 2>, scores: &Tensor<B, 2>) -> Vec<f32> {
        let host = |t: &Tensor<B, 2>| -> Vec<f32> {
            t.to_data()
                .convert::<f32>()
                .into_vec()
                .expect("router values convert to f32")
        };
        match &self.score_bias {
            None => host(logits),
            Some(bias) => {
                let bias: Vec<f32> = bias
                    .val()
                    .to_data()
                    .convert::<f32>()
                    .into_vec()
                    .expect("score bias converts to f32");
                let mut values = host(scores);
                for row in values.chunks_exact_mut(bias.len()) {
                    row.iter_mut().zip(&bias).for_each(|(v, b)| *v += b);
                }
                values
            }
        }
    }
}

/// A parameter that is saved and loaded with the module but receives no gradient.
pub(crate) fn buffer<B: Backend, const D: usize>(value: Tensor<B, D>) -> Param<Tensor<B, D>> {
    Param::initialized(ParamId::new(), value.set_require_grad(false))
}
