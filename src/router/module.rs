//! The router module: logits, scores, top-k.

use burn::module::{Module, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::kernels::float;
use super::{group_limited_top_k, ChoiceRead, DeviceChoice, PickRule, RouterKernels, RoutingRule, Scoring};
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
        Ok(self.route_start(x, rule, matmul)?.finish(&|| None).0)
    }

    /// Whether experts are chosen by the logits themselves (a router without a score bias):
    /// then the values read to the host are `x · weightᵀ` (plus the bias), and a NaN or an
    /// infinity in a token's input makes every one of that token's values NaN or infinite.
    pub(crate) fn chooses_by_logits(&self) -> bool {
        self.score_bias.is_none()
    }

    /// The first half of [`route_with`](Self::route_with): the router's products and scores,
    /// and on a backend that chooses on the device ([`RouterKernels::router_choose`]) the
    /// choice, its read in flight. Nothing here waits for the device, so what the caller
    /// issues before [`PendingRoute::finish`] runs on the device while the host waits there.
    ///
    /// # Errors
    /// What `matmul` returns.
    pub(crate) fn route_start(
        &self,
        x: Tensor<B, 2>,
        rule: &RoutingRule,
        matmul: &dyn Fn(Tensor<B, 2>, Tensor<B, 2>) -> crate::Result<Tensor<B, 2>>,
    ) -> crate::Result<PendingRoute<B>> {
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
        // Experts are chosen by the scores plus the score bias where there is one. A router
        // without one chooses by its logits, which order the experts as the softmax or the
        // sigmoid does without their rounding: a sigmoid rounds every logit above about 17 to
        // 1.0 in f32, which would turn a clear choice into a tie (Llama 4 chooses by the
        // logits). The bias is added on the device (in f32, as the host did).
        let values = match &self.score_bias {
            None => logits.clone(),
            Some(bias) => scores.clone() + bias.val().unsqueeze::<2>(),
        };
        let read = (n_tokens > 0)
            .then(|| {
                B::router_choose(
                    values.clone().into_primitive().tensor(),
                    logits.clone().into_primitive().tensor(),
                    rule,
                )
            })
            .flatten();
        Ok(PendingRoute {
            rule: *rule,
            logits,
            scores,
            values,
            read,
        })
    }
}

/// A routing whose choice is still on its way to the host ([`Router::route_start`]).
#[derive(Debug)]
pub(crate) struct PendingRoute<B: Backend> {
    rule: RoutingRule,
    logits: Tensor<B, 2>,
    scores: Tensor<B, 2>,
    /// What the experts are chosen by: the logits, or the scores plus the score bias.
    values: Tensor<B, 2>,
    /// The device's choice, read in flight; `None` where the host chooses.
    read: Option<ChoiceRead>,
}

impl<B: RouterKernels> PendingRoute<B> {
    /// Hands what the caller issued since [`Router::route_start`] to the device before the
    /// wait ([`ChoiceRead::launch_issued`]).
    pub(crate) fn launch_issued(&mut self) {
        if let Some(read) = &mut self.read {
            read.launch_issued();
        }
    }

    /// The choice on the host, the combine weights picked and the probabilities, with what
    /// was read. Where the device chose, the wait for its read; where it could not, or a
    /// token's values were not all finite there, the values come to the host with `also`'s
    /// after them (one transfer: `also` is a few values the caller needs on the host, such as
    /// the layer's finite check, made only on this path) and the host chooses: its rule for a
    /// NaN is the definition's, and the caller's finite check reads what came back.
    pub(crate) fn finish(self, also: &dyn Fn() -> Option<Tensor<B, 1>>) -> (Routing<B>, HostRead) {
        let Self {
            rule,
            logits,
            scores,
            values,
            read,
        } = self;
        let [n_tokens, n_experts] = values.dims();
        let device = values.device();
        let (indices, read) = match read.and_then(ChoiceRead::wait) {
            Some(DeviceChoice::Chosen(indices)) => (indices, HostRead::device()),
            _ if n_tokens == 0 => (Vec::new(), HostRead::host(true, Vec::new())),
            _ => host_choice(values, n_experts, &rule, also),
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
        (
            Routing {
                logits,
                probs,
                weights,
                indices,
            },
            read,
        )
    }
}

/// The choice made on the host: `values` read with `also`'s values after them (one
/// transfer), checked finite, chosen.
///
/// # Shapes
/// - values: `[n_tokens, n_experts]`, `n_tokens > 0`
fn host_choice<B: Backend>(
    values: Tensor<B, 2>,
    n_experts: usize,
    rule: &RoutingRule,
    also: &dyn Fn() -> Option<Tensor<B, 1>>,
) -> (Vec<usize>, HostRead) {
    let [n_tokens, _] = values.dims();
    let flat = values.reshape([n_tokens * n_experts]);
    let (flat, extra) = match also() {
        Some(also) => {
            let extra = also.dims()[0];
            (Tensor::cat(vec![flat, also], 0), extra)
        }
        None => (flat, 0),
    };
    let mut host: Vec<f32> = flat
        .into_data()
        .convert::<f32>()
        .into_vec()
        .expect("router values convert to f32");
    let also = host.split_off(host.len() - extra);
    let finite = super::topk::all_finite(&host);
    let indices = group_limited_top_k(&host, n_experts, rule.top_k, rule.n_group, rule.topk_group);
    (indices, HostRead::host(finite, also))
}

/// What [`PendingRoute::finish`] read to the host besides the choice.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HostRead {
    /// Whether every value the experts were chosen by is finite.
    pub choice_finite: bool,
    /// The device chose, having found every choice value and every logit finite: then the
    /// router's input was finite too (a NaN or an infinity in a token's input makes each of
    /// its logits NaN or infinite), and `also` was not made.
    pub device_checked: bool,
    /// The values of the caller's `also` (empty without it, or where the device chose).
    pub also: Vec<f32>,
}

impl HostRead {
    fn host(choice_finite: bool, also: Vec<f32>) -> Self {
        Self {
            choice_finite,
            device_checked: false,
            also,
        }
    }

    fn device() -> Self {
        Self {
            choice_finite: true,
            device_checked: true,
            also: Vec::new(),
        }
    }
}

/// A parameter that is saved and loaded with the module but receives no gradient.
pub(crate) fn buffer<B: Backend, const D: usize>(value: Tensor<B, D>) -> Param<Tensor<B, D>> {
    Param::initialized(ParamId::new(), value.set_require_grad(false))
}
