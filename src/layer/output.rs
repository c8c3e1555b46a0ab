//! What a forward pass returns.

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::ExchangePath;
use crate::dispatch::{RoutingStats, SplitScheme};
use crate::memory::MemoryDecision;
use crate::memory::Strategy;

/// The result of [`MoeLayer::forward`](super::MoeLayer::forward).
///
/// Add `aux_loss` and `z_loss` to the training loss (they are already scaled by their
/// coefficients, and zero when those are zero). With expert parallelism each is this rank's
/// additive share of the global-batch loss: summed over ranks they give the single-rank value
/// (under [`ParallelGroups`](crate::parallel::ParallelGroups), summed over every rank of the
/// world). Do not average them over ranks: add each rank's share to that rank's loss, and let
/// the gradient sync sum the gradients.
#[derive(Debug, Clone)]
pub struct MoeOutput<B: Backend, const D: usize> {
    /// The layer's output, shaped like its input.
    pub output: Tensor<B, D>,
    /// This rank's share of the load-balancing loss (sum over ranks for the loss). `[1]`
    pub aux_loss: Tensor<B, 1>,
    /// This rank's share of the router z-loss (sum over ranks for the loss). `[1]`
    pub z_loss: Tensor<B, 1>,
    /// The softmax over all experts of each of this rank's tokens' router logits, summed over
    /// those tokens (differentiable; zeros without tokens, and where the layer's
    /// `aux_loss_coef` is 0, so that a layer without a balancing loss keeps no graph for it). With
    /// `stats.routing.routed_per_expert` and `n_tokens_world`, what a load-balancing loss
    /// taken across a model's layers needs, as transformers computes it for its MoE models
    /// (`load_balancing_loss_func`: one loss over every layer's rows, not the sum of each
    /// layer's own). `[n_experts]`
    pub router_softmax_sum: Tensor<B, 1>,
    /// Routing and scheduling facts about this call.
    pub stats: MoeStats,
}

/// Routing and scheduling facts about one forward pass.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MoeStats {
    /// Assignments per expert (routed and kept), capacity drops, global token count.
    pub routing: RoutingStats,
    /// The most loaded expert's routed assignments over the mean, over the global batch
    /// ([`RoutingStats::load_imbalance`]): 1 is perfectly balanced.
    pub load_imbalance: f64,
    /// Partitions the exchange ran with.
    pub n_partitions: usize,
    /// How the exchange was split: the configured [`Partitions`](crate::Partitions) resolved
    /// for this batch.
    pub split: SplitScheme,
    /// Memory strategy the exchange ran with: the configured
    /// [`MemoryReuse`](crate::MemoryReuse) resolved for this batch.
    pub strategy: Strategy,
    /// Fused op or reference twin.
    pub path: ExchangePath,
    /// With a `memory_budget`: what the budget chose and why (received rows and modelled
    /// peak per rank). `None` without one.
    pub memory: Option<MemoryDecision>,
    /// Rows this rank's experts computed: every rank's kept rows of its own experts, and with
    /// shadowing, its own rows of the shadowed experts in place of the others' rows of them.
    pub recv_rows: usize,
    /// The experts replicated on every rank this step ([`Shadowing`](crate::Shadowing)), in
    /// increasing index; empty without shadowing.
    pub shadows: Vec<usize>,
    /// Whether the batch took the decode path
    /// ([`MoeLayerConfig::decode_tokens`](crate::MoeLayerConfig::decode_tokens)): a few tokens
    /// at inference on one rank, straight to the experts in one block, with no exchange plan
    /// (`n_partitions` is then 1 and `strategy` `None`).
    pub decode: bool,
}
