//! The router module: logits, scores, top-k.

use burn::module::{Module, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::kernels::float;
use super::{group_limited_top_k, PickRule, RouterKernels, RoutingRule, Scoring};
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
}

impl<B: RouterKernels> Router<B> {
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
        let plain = |x: Tensor<B, 2>, w: Tensor<B, 2>| Ok(x.matmul(w));
        self.route_with(x, rule, &plain)
            .expect("burn's matmul does not fail")
    }

    /// [`route`](Self::route) with the logits' product `x · weightᵀ` computed by `matmul` (the
    /// layer passes its dense product at the config's GEMM precision).
    ///
    /// # Shapes
    /// - x: `[n_tokens, d_model]`
    ///
    /// # Errors
    /// What `matmul` returns.
    pub fn route_with(
        &self,
        x: Tensor<B, 2>,
        rule: &RoutingRule,
        matmul: &dyn Fn(Tensor<B, 2>, Tensor<B, 2>) -> crate::Result<Tensor<B, 2>>,
    ) -> crate::Result<Routing<B>> {
        self.route_reading(x, rule, matmul, None)
            .map(|(routing, _)| routing)
    }

    /// Whether experts are chosen by the logits themselves (a router without a score bias):
    /// then the values read to the host are `x · weightᵀ` (plus the bias), and a NaN or an
    /// infinity in a token's input makes every one of that token's values NaN or infinite.
    pub(crate) fn chooses_by_logits(&self) -> bool {
        self.score_bias.is_none()
    }

    /// [`route_with`](Self::route_with), reading `also` (a few values the caller needs on the
    /// host, such as the layer's finite check) in the same transfer as the choice values: one
    /// host wait instead of two.
    ///
    /// # Errors
    /// What `matmul` returns.
    pub(crate) fn route_reading(
        &self,
        x: Tensor<B, 2>,
        rule: &RoutingRule,
        matmul: &dyn Fn(Tensor<B, 2>, Tensor<B, 2>) -> crate::Result<Tensor<B, 2>>,
        also: Option<Tensor<B, 1>>,
    ) -> crate::Result<(Routing<B>, HostRead)> {
        let [n_tokens, _] = x.dims();
        let n_experts = self.n_experts();
        let device = x.device();
        // NdArray cannot multiply a matrix with no rows; a rank with no tokens still routes
        // (to nothing) so that it joins every collective.
        let mut logits = if n_tokens == 0 {
            Tensor::zeros([0, n_experts], &device)
        } else {
            matmul(x, self.weight.val().transpose())?
        };
        if let Some(bias) = &self.bias {
            logits = logits + bias.val().unsqueeze::<2>();
        }
        let scores = float::<B, 2>(B::router_scores(
            logits.clone().into_primitive().tensor(),
            rule.scoring,
        ));
        let (choice, also) = self.choice_scores(&logits, &scores, also);
        let read = HostRead {
            choice_finite: super::topk::all_finite(&choice),
            also,
        };
        let indices = if n_tokens == 0 {
            Vec::new()
        } else {
            group_limited_top_k(&choice, n_experts, rule.top_k, rule.n_group, rule.topk_group)
        };
        let weights = if n_tokens == 0 {
            Tensor::zeros([0, rule.top_k], &device)
        } else {
            let pick = PickRule {
                normalize: rule.normalize,
                eps: match rule.scoring {
                    Scoring::Softmax => 0.0,
                    Scoring::Sigmoid => 1e-20,
                },
                scaling: rule.scaling,
            };
            let scores = scores.clone().into_primitive().tensor();
            float::<B, 2>(B::router_pick(scores, &indices, rule.top_k, pick))
        };
        let probs = match rule.scoring {
            Scoring::Softmax => scores,
            Scoring::Sigmoid => scores.clone() / scores.sum_dim(1),
        };
        Ok((
            Routing {
                logits,
                probs,
                weights,
                indices,
            },
            read,
        ))
    }

    /// What experts are chosen by, on the host: the scores plus the score bias where there is
    /// one. A router without one chooses by its logits, which order the experts as the
    /// softmax or the sigmoid does without their rounding: a sigmoid rounds every logit above
    /// about 17 to 1.0 in f32, which would turn a clear choice into a tie (Llama 4 chooses
    /// by the logits). The bias is added on the device (in f32, as the host did), so that the
    /// choice is one transfer, with `also`'s values after it (returned second).
    fn choice_scores(
        &self,
        logits: &Tensor<B, 2>,
        scores: &Tensor<B, 2>,
        also: Option<Tensor<B, 1>>,
    ) -> (Vec<f32>, Vec<f32>) {
        let values = match &self.score_bias {
            None => logits.clone(),
            Some(bias) => scores.clone() + bias.val().unsqueeze::<2>(),
        };
        let [n_tokens, n_experts] = values.dims();
        let flat = values.reshape([n_tokens * n_experts]);
        let (flat, extra) = match also {
            Some(also) => {
                let extra = also.dims()[0];
                (Tensor::cat(vec![flat, also], 0), extra)
            }
            None => (flat, 0),
        };
        if flat.dims()[0] == 0 {
            return (Vec::new(), Vec::new());
        }
        let mut host: Vec<f32> = flat
            .into_data()
            .convert::<f32>()
            .into_vec()
            .expect("router values convert to f32");
        let also = host.split_off(host.len() - extra);
        (host, also)
    }
}

/// What [`Router::route_reading`] read to the host besides the choice.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HostRead {
    /// Whether every value the experts were chosen by is finite.
    pub choice_finite: bool,
    /// The values of the caller's `also` (empty without it).
    pub also: Vec<f32>,
}

/// A parameter that is saved and loaded with the module but receives no gradient.
pub(crate) fn buffer<B: Backend, const D: usize>(value: Tensor<B, D>) -> Param<Tensor<B, D>> {
    Param::initialized(ParamId::new(), value.set_require_grad(false))
}
