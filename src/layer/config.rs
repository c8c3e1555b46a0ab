//! `MoeLayerConfig`: everything that defines a layer, and its validation.

use std::sync::Arc;

use burn::config::Config;
use burn::tensor::backend::Backend;
use serde::{Deserialize, Serialize};

use super::{MoeContext, MoeLayer};
use crate::comm::{Communicator, SingleRank};
use crate::error::{MoeError, Result};
use crate::exchange::executor::StepExecutor;
use crate::exchange::GemmPrecision;
use crate::experts::Activation;
use crate::memory::MemoryReuse;
use crate::router::{RoutingRule, Scoring};
use crate::tuning::Shadowing;

/// The most partitions the exchange may be cut into. The paper's best `n` is at most 16 on
/// every shape it measures; each partition costs a few small per-rank, per-expert tables, so
/// this bound only keeps a mistyped `n` (10^7) from allocating gigabytes of them.
pub const MAX_PARTITIONS: usize = 4096;

/// How many partitions the exchange is cut into (the paper's `n`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Partitions {
    /// Always `n` partitions along the token dimension.
    Fixed(usize),
    /// FasterMoE's split: one partition per peer rank (point-to-point steps). A baseline.
    ByRank,
    /// Algorithm 1: chosen per batch size by timing trials of `adaptive_candidates`, with
    /// the answers kept in the layer's granularity table.
    Adaptive,
}

/// Which implementation of the exchange the layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum ExchangePath {
    /// The fused op with its own backward: partitions and memory reuse apply.
    #[default]
    Fused,
    /// Plain differentiable tensor ops (the reference twin), unpartitioned.
    Reference,
}

impl ExchangePath {
    /// `fused` or `reference`.
    pub fn name(self) -> &'static str {
        match self {
            ExchangePath::Fused => "fused",
            ExchangePath::Reference => "reference",
        }
    }
}

/// Configuration of a [`MoeLayer`].
///
/// ```
/// use mpipemoe::{Activation, MemoryReuse, MoeLayerConfig, Partitions};
/// let config = MoeLayerConfig::new(64, 256, 8, 2)
///     .with_activation(Activation::SwiGlu)
///     .with_normalize_topk(true)
///     .with_partitions(Partitions::Fixed(4))
///     .with_memory_reuse(MemoryReuse::S4);
/// assert!(config.validate().is_ok());
/// ```
#[derive(Config, Debug)]
pub struct MoeLayerConfig {
    /// Token width `M`.
    pub d_model: usize,
    /// Expert hidden width `H`.
    pub d_hidden: usize,
    /// Number of experts `E` over all ranks.
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// The experts' activation.
    #[config(default = "Activation::Gelu")]
    pub activation: Activation,
    /// Whether the experts' GEMMs have biases.
    #[config(default = false)]
    pub bias: bool,
    /// Whether the router has a bias (added to its logits, trained).
    #[config(default = false)]
    pub router_bias: bool,
    /// How the router scores experts: softmax over all of them, or a sigmoid each
    /// (DeepSeek-V3).
    #[config(default = "Scoring::Softmax")]
    pub scoring: Scoring,
    /// Divide each token's top-k weights by their sum (Mixtral, Qwen3-MoE, DeepSeek-V3); off
    /// keeps the scores as they are (Switch, Qwen2-MoE, OLMoE).
    #[config(default = false)]
    pub normalize_topk: bool,
    /// Group-limited routing (DeepSeek-V3): the experts form `n_group` contiguous groups, and
    /// a token chooses only among the `topk_group` groups whose two best scores sum highest.
    /// 1 turns the limit off.
    #[config(default = 1)]
    pub n_group: usize,
    /// Groups each token may choose experts from (with `n_group > 1`).
    #[config(default = 1)]
    pub topk_group: usize,
    /// A per-expert bias added to the scores for *choosing* experts only (DeepSeek-V3's
    /// `e_score_correction_bias`): a buffer that is saved and loaded with the module but not
    /// trained by gradient; `MoeLayer::balance_score_bias` moves it towards balanced load.
    #[config(default = false)]
    pub score_bias: bool,
    /// Factor on every combine weight, after normalisation (DeepSeek-V3's
    /// `routed_scaling_factor`).
    #[config(default = 1.0)]
    pub routed_scaling_factor: f64,
    /// Multiply each chosen expert's combine weight into that expert's *input* row rather than
    /// its output (Llama 4): `y = Σ_j expert_{idx_j}(w_j · x)` instead of
    /// `Σ_j w_j · expert_{idx_j}(x)`. The two differ because the experts are not linear.
    /// Gradients reach the router through the expert's input either way.
    #[config(default = false)]
    pub weights_on_input: bool,
    /// Expert capacity as a factor: each expert takes at most
    /// `floor(factor · n_tokens · top_k / n_experts)` assignments of the global batch, first
    /// come (token order, best choice first) first served. `None` is dropless.
    #[config(default = "None")]
    pub capacity_factor: Option<f64>,
    /// Hidden width of a shared SwiGLU expert that every token passes through (DeepSeek's
    /// `n_shared_experts` experts of width H are one shared expert of width `n · H`).
    #[config(default = "None")]
    pub shared_expert: Option<usize>,
    /// Whether the shared expert's output is scaled by a sigmoid gate `σ(x · gate^T)`
    /// (Qwen2-MoE); DeepSeek's shared experts are ungated.
    #[config(default = true)]
    pub shared_expert_gate: bool,
    /// Issue the shared expert's products while the routing read is in flight, before the
    /// plan and the exchange, rather than after the combine (Megatron-Core's
    /// `moe_shared_expert_overlap`). On a GPU the device then runs them while the host waits
    /// for the router's choice and plans the batch; outputs and gradients are the same bits.
    /// The cost is memory: what autodiff keeps of the shared expert and its output (about
    /// `n_tokens · (3 · shared_expert + 2 · d_model)` values gated, `d_model` fewer ungated)
    /// are then live through the exchange's forward, whose peak the memory model and a
    /// `memory_budget` count them in.
    /// Needs `shared_expert`.
    #[config(default = false)]
    pub shared_expert_overlap: bool,
    /// Weight of the Switch load-balancing loss (0 turns it off).
    #[config(default = 0.0)]
    pub aux_loss_coef: f64,
    /// Weight of the router z-loss (0 turns it off).
    #[config(default = 0.0)]
    pub z_loss_coef: f64,
    /// Partitions of the exchange (the paper's `n`).
    #[config(default = "Partitions::Fixed(1)")]
    pub partitions: Partitions,
    /// Memory reuse and the strategy that restores activations in backward.
    #[config(default = "MemoryReuse::Off")]
    pub memory_reuse: MemoryReuse,
    /// A guarantee on device memory: the bytes per rank one forward + backward of this layer
    /// may hold above what was live before it, by this implementation's memory model (with
    /// headroom for its error). Each batch, every rank computes from every rank's routed rows
    /// the smallest partition count (the fixed one; or from Algorithm 1's choice upwards) and
    /// the cheapest allowed strategy that fit on every rank; if none does, the forward returns
    /// `MoeError::Memory` on every rank before the exchange allocates anything. With
    /// `MemoryReuse::Auto`, give the layer a profile (`MoeContext::set_profile`) when the
    /// budget is tight: without one it measures one on its first call, which allocates tens of
    /// MiB that no budget accounts for. `None`: no limit.
    #[config(default = "None")]
    pub memory_budget: Option<usize>,
    /// Partition counts `Partitions::Adaptive` tries.
    #[config(default = "vec![1, 2, 4, 8, 16]")]
    pub adaptive_candidates: Vec<usize>,
    /// Fused op or reference twin.
    #[config(default = "ExchangePath::Fused")]
    pub path: ExchangePath,
    /// Seed of the parameter initialisation.
    #[config(default = 0)]
    pub seed: u64,
    /// Reject inputs with NaN or infinite values. Checked on the host on the router's logits,
    /// which come there for the choice anyway (a NaN or an infinity in a token's input makes
    /// all of its logits NaN or infinite); one extra pass over the input where a logit is not
    /// finite, and on every forward of a router with a score bias.
    #[config(default = true)]
    pub check_finite: bool,
    /// How the fused exchange runs its schedule: `None` is the backend's choice
    /// ([`MoeBackend::step_executor`](crate::MoeBackend::step_executor)); set it to compare the
    /// two, or to run the threaded executor where it is not the default (tests do, on the CPU,
    /// so that a missing dependency between streams shows up there).
    #[config(default = "None")]
    pub executor: Option<StepExecutor>,
    /// Whether a partition's experts may run on the backend's own expert path
    /// ([`MoeBackend::expert_path`](crate::MoeBackend::expert_path): Flex's runs them side by
    /// side over its pool and writes their weight gradients straight into the stacked sums)
    /// where the communicator offers no device library. `false` keeps them on the primitives,
    /// one expert after another, as on backends without a path of their own: to compare the
    /// two, or as a way back. The memory model replays whichever runs
    /// ([`MemoryDecision::route`](crate::memory::MemoryDecision::route)).
    #[config(default = true)]
    pub backend_experts: bool,
    /// Hot experts replicated on every rank of the expert-parallel group for a step
    /// (FasterMoE's shadowing): their rows are computed where they were routed instead of
    /// crossing the all-to-all. Changes the step's time and memory, never its result; nothing
    /// to do on one rank. See [`Shadowing`].
    #[config(default = "Shadowing::Off")]
    pub shadowing: Shadowing,
    /// The precision of the experts' GEMMs (and of the shared expert's) where the communicator
    /// offers a device library's expert path for the backend (cuBLAS through `mpipemoe-cuda`):
    /// IEEE f32 (the default, PyTorch's default too), TF32 or bf16 on the tensor cores, f32
    /// accumulation in all three. The router's logits follow it, except under bf16, where they
    /// stay f32 (routing is a discrete choice). Every other path multiplies as its backend
    /// does and ignores it.
    #[config(default = "GemmPrecision::F32")]
    pub gemm_precision: GemmPrecision,
    /// Batches of at most this many tokens, on one rank with nothing to exchange (not
    /// `HostLoopback`, which emulates the network) and where the backend tracks no gradients
    /// (a generation's decode steps), take the decode path: the rows go straight
    /// to the chosen experts in one block, without the exchange's plan, partitions, schedule
    /// or buffers, none of which does anything for a few tokens that stay on their rank and
    /// need no backward. The values are the exchange's: the same expert compute on the same
    /// rows. Above it, on more ranks, under autodiff or on the reference path, the batch goes
    /// through the exchange. `0` turns the decode path off. The default, 16, is where
    /// every expert's product is still one of a few rows on the CPU (Flex's streaming kernel).
    #[config(default = 16)]
    pub decode_tokens: usize,
}

impl MoeLayerConfig {
    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        self.validate_widths()?;
        self.validate_routing()?;
        self.validate_run()
    }

    /// The widths and the expert count.
    fn validate_widths(&self) -> Result<()> {
        for (field, value) in [
            ("d_model", self.d_model),
            ("d_hidden", self.d_hidden),
            ("n_experts", self.n_experts),
        ] {
            if value == 0 {
                return Err(MoeError::config(field, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// The router: top-k, expert groups, scaling and capacity.
    fn validate_routing(&self) -> Result<()> {
        if self.top_k == 0 || self.top_k > self.n_experts {
            return Err(MoeError::config(
                "top_k",
                format!("is {}, must be in 1..={} (n_experts)", self.top_k, self.n_experts),
            ));
        }
        if self.n_group == 0 || !self.n_experts.is_multiple_of(self.n_group) {
            return Err(MoeError::config(
                "n_group",
                format!(
                    "is {}, must divide n_experts = {} (1 for no group limit)",
                    self.n_group, self.n_experts
                ),
            ));
        }
        if self.topk_group == 0 || self.topk_group > self.n_group {
            return Err(MoeError::config(
                "topk_group",
                format!(
                    "is {}, must be in 1..={} (n_group)",
                    self.topk_group, self.n_group
                ),
            ));
        }
        let rule = self.routing_rule();
        if rule.group_limited() && self.top_k > self.topk_group * (self.n_experts / self.n_group) {
            return Err(MoeError::config(
                "top_k",
                format!(
                    "is {}, but the {} kept groups of {} experts hold only {}",
                    self.top_k,
                    self.topk_group,
                    self.n_experts / self.n_group,
                    self.topk_group * (self.n_experts / self.n_group)
                ),
            ));
        }
        if !(self.routed_scaling_factor > 0.0 && self.routed_scaling_factor.is_finite()) {
            return Err(MoeError::config(
                "routed_scaling_factor",
                format!("is {}, must be a finite number > 0", self.routed_scaling_factor),
            ));
        }
        if let Some(f) = self.capacity_factor {
            if !(f > 0.0 && f.is_finite()) {
                return Err(MoeError::config(
                    "capacity_factor",
                    format!("is {f}, must be a finite number > 0 (or None for dropless)"),
                ));
            }
        }
        Ok(())
    }

    /// The shared expert, the loss coefficients and the run settings.
    fn validate_run(&self) -> Result<()> {
        if self.shared_expert == Some(0) {
            return Err(MoeError::config(
                "shared_expert",
                "hidden width must be at least 1",
            ));
        }
        if self.shared_expert_overlap && self.shared_expert.is_none() {
            return Err(MoeError::config(
                "shared_expert_overlap",
                "is set, but the layer has no shared expert to overlap (shared_expert is None)",
            ));
        }
        for (field, value) in [
            ("aux_loss_coef", self.aux_loss_coef),
            ("z_loss_coef", self.z_loss_coef),
        ] {
            if !(value >= 0.0 && value.is_finite()) {
                return Err(MoeError::config(
                    field,
                    format!("is {value}, must be finite and >= 0"),
                ));
            }
        }
        if let Partitions::Fixed(n) = self.partitions {
            if n == 0 || n > MAX_PARTITIONS {
                return Err(MoeError::config(
                    "partitions",
                    format!("is Fixed({n}); n must be in 1..={MAX_PARTITIONS}"),
                ));
            }
        }
        if self.partitions == Partitions::Adaptive
            && (self.adaptive_candidates.is_empty()
                || self
                    .adaptive_candidates
                    .iter()
                    .any(|&n| n == 0 || n > MAX_PARTITIONS))
        {
            return Err(MoeError::config(
                "adaptive_candidates",
                format!(
                    "is {:?}; needs at least one partition count, all in 1..={MAX_PARTITIONS}",
                    self.adaptive_candidates
                ),
            ));
        }
        if self.shadowing == Shadowing::Fixed(0) {
            return Err(MoeError::config(
                "shadowing",
                "is Fixed(0), which shadows nothing; use Shadowing::Off",
            ));
        }
        if self.memory_budget == Some(0) {
            return Err(MoeError::config(
                "memory_budget",
                "must be at least 1 byte (or None)",
            ));
        }
        Ok(())
    }

    /// How the router routes under this config.
    pub fn routing_rule(&self) -> RoutingRule {
        RoutingRule {
            top_k: self.top_k,
            scoring: self.scoring,
            normalize: self.normalize_topk,
            n_group: self.n_group,
            topk_group: self.topk_group,
            scaling: self.routed_scaling_factor,
        }
    }

    /// Checks that the layer can be sharded over `n_ranks`.
    pub fn validate_for_ranks(&self, n_ranks: usize) -> Result<()> {
        self.validate()?;
        if n_ranks == 0 || !self.n_experts.is_multiple_of(n_ranks) {
            return Err(MoeError::config(
                "n_experts",
                format!(
                    "{} experts cannot be split evenly over {n_ranks} ranks",
                    self.n_experts
                ),
            ));
        }
        Ok(())
    }

    /// A single-rank layer with freshly initialised weights.
    ///
    /// # Panics
    /// If the config is invalid; use [`try_init`](Self::try_init) to get the error instead.
    pub fn init<B: Backend>(&self, device: &B::Device) -> MoeLayer<B> {
        self.try_init(device).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A single-rank layer with freshly initialised weights.
    pub fn try_init<B: Backend>(&self, device: &B::Device) -> Result<MoeLayer<B>> {
        self.init_rank(device, Arc::new(SingleRank))
    }

    /// This rank's part of an expert-parallel layer: the replicated router (and shared
    /// expert) and experts `[r·E/N, (r+1)·E/N)`. Weights are drawn per expert from `seed`, so
    /// the layer computes the same function for every rank count.
    pub fn init_rank<B: Backend>(
        &self,
        device: &B::Device,
        comm: Arc<dyn Communicator>,
    ) -> Result<MoeLayer<B>> {
        self.validate_for_ranks(comm.n_ranks())?;
        Ok(MoeLayer::init(self, device, MoeContext::new(self.clone(), comm)))
    }

    /// This rank's part of a layer under expert × data parallelism: experts sharded over the
    /// expert-parallel group of `groups` (so `n_experts` must divide by its size, not by the
    /// world's), routing statistics summed over the data-parallel replicas, so that the
    /// auxiliary and z-losses and the per-expert load are those of the global batch.
    /// Capacity (if set) applies per expert-parallel group, to that group's tokens, as each
    /// group's all-to-all only sees its own.
    ///
    /// # Errors
    /// [`MoeError::Config`] naming `n_experts` if the experts do not split evenly over the
    /// expert-parallel group, or the field at fault if the config is invalid.
    pub fn init_groups<B: Backend>(
        &self,
        device: &B::Device,
        groups: &crate::parallel::ParallelGroups,
    ) -> Result<MoeLayer<B>> {
        self.validate_for_ranks(groups.expert().n_ranks())?;
        let mut ctx = MoeContext::new(self.clone(), groups.expert().clone());
        ctx.replicas = groups.expert_data().clone();
        Ok(MoeLayer::init(self, device, ctx))
    }
}
