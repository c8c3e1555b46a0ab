//! Step 8 of the forward recipe: the router's auxiliary losses, and the softmax sum a whole
//! model's balancing loss takes across its layers.

use std::cell::OnceCell;

use burn::tensor::activation::softmax;
use burn::tensor::Tensor;

use super::MoeLayerConfig;
use crate::dispatch::DispatchPlan;
use crate::exchange::MoeBackend;
use crate::router::{load_balancing_loss, z_loss, Scoring};

/// This rank's shares of the global-batch losses, and its softmax sum.
///
/// # Shapes
/// - `aux_loss`, `z_loss`: `[1]`; `router_softmax_sum`: `[n_experts]`
pub(super) struct RouterLosses<B: MoeBackend> {
    pub aux_loss: Tensor<B, 1>,
    pub z_loss: Tensor<B, 1>,
    pub router_softmax_sum: Tensor<B, 1>,
}

impl<B: MoeBackend> RouterLosses<B> {
    /// The losses of a forward that routed `n_tokens` tokens on this rank.
    ///
    /// # Shapes
    /// - `logits`, `probs`: `[n_tokens, n_experts]` (the router's, as `Routing` holds them)
    pub(super) fn new(
        config: &MoeLayerConfig,
        logits: Tensor<B, 2>,
        probs: Tensor<B, 2>,
        plan: &DispatchPlan,
        n_tokens: usize,
    ) -> Self {
        let n_global = plan.stats.n_tokens_world;
        let n_experts = config.n_experts;
        // A loss that is off (or has no tokens) is a zero that takes no gradient. One fill
        // serves all three, where each had been a fill of its own (a launch each on a GPU):
        // the losses share it, and the softmax sum is it broadcast to `[n_experts]` (a view:
        // burn-cubecl's `expand` sets a zero stride, and its in-place paths refuse an
        // overlapping tensor).
        let device = logits.device();
        let zero = OnceCell::new();
        let zero = || zero.get_or_init(|| Tensor::<B, 1>::zeros([1], &device)).clone();
        // What a model's load-balancing loss across its layers needs (transformers'
        // `load_balancing_loss_func`): this rank's sum of the softmax over all experts; only
        // where the layer has a balancing loss, so that no other layer keeps a graph for it.
        // A softmax router's probabilities are that softmax already (one op and one node,
        // `RouterKernels`), and their column sums are also the layer's own loss's: one
        // reduction serves both.
        let balancing = n_tokens > 0 && config.aux_loss_coef != 0.0;
        let prob_sums = balancing.then(|| probs.sum_dim(0).reshape([n_experts]));
        let router_softmax_sum = match (&prob_sums, config.scoring) {
            (None, _) => zero().expand([n_experts]),
            (Some(sums), Scoring::Softmax) => sums.clone(),
            (Some(_), Scoring::Sigmoid) => softmax(logits.clone(), 1).sum_dim(0).reshape([n_experts]),
        };
        let aux_loss = match prob_sums {
            None => zero(),
            Some(sums) => load_balancing_loss(sums, &plan.expert_fraction, n_global, config.aux_loss_coef),
        };
        let z_loss = match n_tokens > 0 && config.z_loss_coef != 0.0 {
            false => zero(),
            true => z_loss(logits, n_global, config.z_loss_coef),
        };
        Self {
            aux_loss,
            z_loss,
            router_softmax_sum,
        }
    }
}
