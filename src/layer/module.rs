//! `MoeLayer`: the burn module and its forward pass.

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};

use super::losses::RouterLosses;
use super::plan::Route;
use super::{ExchangePath, MoeContext, MoeLayerConfig, MoeOutput, MoeStats};
use crate::dispatch::{CombineMap, ExchangePlan, RowMap};
use crate::error::{MoeError, Result};
use crate::exchange::{exchange_reference, row_weights, MoeBackend};
use crate::experts::{ExpertAdapters, ExpertTensors, Experts, ExpertsSpec, SharedExpert};
use crate::memory::Strategy;
use crate::router::Router;

/// A Mixture-of-Experts layer: a drop-in replacement for a transformer FFN.
///
/// Build it from a [`MoeLayerConfig`]; with expert parallelism, each rank builds its part
/// with [`MoeLayerConfig::init_rank`] and calls `forward` on its slice of the batch.
///
/// ```
/// use burn::backend::{Autodiff, NdArray};
/// use burn::tensor::Tensor;
/// use mpipemoe::MoeLayerConfig;
///
/// type B = Autodiff<NdArray>;
/// let device = Default::default();
/// let layer = MoeLayerConfig::new(16, 32, 4, 2).init::<B>(&device);
/// let x = Tensor::<B, 3>::ones([2, 5, 16], &device);
/// let out = layer.forward(x);
/// assert_eq!(out.output.dims(), [2, 5, 16]);
/// let loss = out.output.sum() + out.aux_loss;
/// let _grads = loss.backward();
/// ```
#[derive(Module, Debug)]
pub struct MoeLayer<B: Backend> {
    /// The gate (replicated on every rank).
    pub router: Router<B>,
    /// This rank's experts.
    pub experts: Experts<B>,
    /// The shared expert, if configured (replicated on every rank).
    pub shared: Option<SharedExpert<B>>,
    /// Low-rank adapters on this rank's experts, if any ([`MoeLayer::with_adapters`]).
    pub adapters: Option<ExpertAdapters<B>>,
    #[module(skip)]
    pub(super) ctx: MoeContext,
}

impl<B: Backend> MoeLayer<B> {
    pub(crate) fn init(config: &MoeLayerConfig, device: &B::Device, ctx: MoeContext) -> Self {
        let (rank, n_ranks) = (ctx.comm.rank(), ctx.comm.n_ranks());
        let n_local = config.n_experts / n_ranks;
        let spec = ExpertsSpec {
            experts: rank * n_local..(rank + 1) * n_local,
            n_experts: config.n_experts,
            rank,
            n_ranks,
            d_model: config.d_model,
            d_hidden: config.d_hidden,
            activation: config.activation,
            bias: config.bias,
            seed: config.seed,
        };
        Self {
            router: Router::init(
                config.n_experts,
                config.d_model,
                config.router_bias,
                config.score_bias,
                config.seed,
                device,
            ),
            experts: Experts::init(&spec, device),
            shared: config.shared_expert.map(|h| {
                SharedExpert::init(config.d_model, h, config.shared_expert_gate, config.seed, device)
            }),
            adapters: None,
            ctx,
        }
    }

    pub(crate) fn from_parts(
        router: Router<B>,
        experts: Experts<B>,
        shared: Option<SharedExpert<B>>,
        ctx: MoeContext,
    ) -> Self {
        Self {
            router,
            experts,
            shared,
            adapters: None,
            ctx,
        }
    }

    /// The layer's configuration.
    pub fn config(&self) -> &MoeLayerConfig {
        &self.ctx.config
    }

    /// The layer's context: communicator, host store, meter.
    pub fn context(&self) -> &MoeContext {
        &self.ctx
    }

    /// Builds this layer's partitions in `arena` (e.g. another layer's,
    /// `other.context().partition_arena()`), so that the layers of a model, which run one
    /// after another, hold one set of partition buffers between them on the backends that
    /// have an arena (the CubeCL backends).
    pub fn set_partition_arena(&mut self, arena: crate::exchange::PartitionArena) {
        self.ctx.arena = arena;
    }

    /// Sets the data-parallel replicas of this rank's experts (the ranks that hold the same
    /// experts, [`ParallelGroups::expert_data`](crate::parallel::ParallelGroups::expert_data)),
    /// as [`MoeLayerConfig::init_groups`] does: the routing statistics, the losses'
    /// normalisation and the per-expert load are then the world's batch's. For a layer built
    /// per rank ([`MoeLayerConfig::init_rank`], as a checkpoint loader builds them) that then
    /// trains with data-parallel replicas. Every rank of the group must set it alike.
    pub fn set_replicas(&mut self, replicas: Arc<dyn crate::comm::Communicator>) {
        self.ctx.replicas = replicas;
    }

    /// The same weights with other run settings (partitions, memory reuse, path, ...).
    ///
    /// # Errors
    /// If `config` changes the layer's shape or parameters, or is invalid.
    pub fn with_config(mut self, config: MoeLayerConfig) -> Result<Self> {
        let old = &self.ctx.config;
        let same_shape = (
            old.d_model,
            old.d_hidden,
            old.n_experts,
            old.activation,
            old.bias,
            old.router_bias,
            old.score_bias,
            old.shared_expert,
            old.shared_expert_gate,
            old.weights_on_input,
        ) == (
            config.d_model,
            config.d_hidden,
            config.n_experts,
            config.activation,
            config.bias,
            config.router_bias,
            config.score_bias,
            config.shared_expert,
            config.shared_expert_gate,
            config.weights_on_input,
        );
        if !same_shape {
            return Err(MoeError::config(
                "with_config",
                "may change run settings only, not the layer's shape or parameters",
            ));
        }
        config.validate_for_ranks(self.ctx.comm.n_ranks())?;
        self.ctx.config = config;
        Ok(self)
    }
}

impl<B: MoeBackend> MoeLayer<B> {
    /// Runs the layer on `[..., d_model]` tokens.
    ///
    /// # Shapes
    /// - input: `[..., d_model]` (`[n_tokens, d_model]`, `[batch, seq, d_model]`, ...)
    /// - output: `output` shaped like the input; `aux_loss` and `z_loss` `[1]`
    ///
    /// # Panics
    /// With the [`MoeError`] message where [`try_forward`](Self::try_forward) would return it.
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> MoeOutput<B, D> {
        self.try_forward(input).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs the layer on `[..., d_model]` tokens: `[n_tokens, d_model]`,
    /// `[batch, seq, d_model]`, or any leading dimensions.
    ///
    /// # Shapes
    /// - input: `[..., d_model]`, flattened to `[n_tokens, d_model]` inside
    /// - output: `output` shaped like the input; `aux_loss` and `z_loss` `[1]`
    ///
    /// # Errors
    /// [`MoeError::Input`] if the last dimension is not `d_model` or (with `check_finite`) a
    /// value is NaN or infinite; [`MoeError::Comm`] if a peer rank fails.
    pub fn try_forward<const D: usize>(&self, input: Tensor<B, D>) -> Result<MoeOutput<B, D>> {
        let config = &self.ctx.config;
        // 1. Flatten to [n_tokens, d_model] and check the input (and that the experts are this
        //    rank's: a record of another rank's experts loads without a shape error).
        self.experts.check_shard()?;
        let shape = input.dims();
        let x = self.flatten(input)?;
        let n_tokens = x.dims()[0];

        // 2. Route: top-k experts and their weights per token, the input checked on what the
        //    routing reads to the host (one transfer, one host wait; `route.rs`). The read is
        //    in flight between the halves: with `shared_expert_overlap` the shared expert
        //    (step 7) is issued there, and a GPU runs it while the host waits and plans.
        let mut pending = self.route_start(&x)?;
        let overlapped = match config.shared_expert_overlap {
            true => {
                let shared = self.shared_expert(&x)?;
                pending.launch_issued();
                shared
            }
            false => None,
        };
        let routing = self.route_finish(pending, &x, &shape)?;

        // 3. Plan: count with the other ranks, apply capacity; choose n and the strategy. A few
        //    tokens at inference on one rank take the decode path: the counts alone, no
        //    partitions (`decode.rs`).
        let plan = match self.decodes(n_tokens, &x.device()) {
            true => self.plan_direct(&routing.indices, n_tokens)?,
            false => self.plan(&routing.indices, &x)?,
        };

        // 4. Permute: T_I = the input rows in plan order (scaled by their combine weights
        //    where the weights go on the experts' input, as in Llama 4).
        let tokens = plan.dispatch.token_map();
        let combine = plan.dispatch.combine_map(tokens.clone());
        let (t_i, combine_weights) = match config.weights_on_input {
            true => (
                permute(&x, &tokens) * row_weights(routing.weights.into_primitive().tensor(), &combine),
                None,
            ),
            false => (permute(&x, &tokens), Some(routing.weights)),
        };

        // 5. Exchange: dispatch, local experts (and copies of the shadowed ones), combine —
        //    fused or reference; on the decode path, this rank's experts alone.
        let n_partitions = plan.route.n_partitions();
        let recv_rows = plan.route.recv_rows();
        let decode = matches!(plan.route, Route::Direct(_));
        let t_o = match plan.route {
            Route::Exchange(exchange) => self.exchange(t_i, exchange, plan.strategy, &plan.shadows)?,
            Route::Direct(rows_per_expert) => self.experts_direct(t_i, &rows_per_expert)?,
        };

        // 6. Unpermute: y[t] += w[t, j] · T_O[row(t, j)] (unweighted where step 4 weighted).
        let mut y = unpermute(t_o, combine_weights, &combine);

        // 7. Shared expert, its products at the GEMM precision (through the device library
        //    where the communicator offers one); issued in step 2 under the overlap.
        let shared = match config.shared_expert_overlap {
            true => overlapped,
            false => self.shared_expert(&x)?,
        };
        if let Some(shared) = shared {
            y = y + shared;
        }

        // 8. Auxiliary losses (this rank's shares of the global-batch losses).
        let losses = RouterLosses::new(config, routing.logits, routing.probs, &plan.dispatch, n_tokens);

        Ok(MoeOutput {
            output: y.reshape(shape),
            aux_loss: losses.aux_loss,
            z_loss: losses.z_loss,
            router_softmax_sum: losses.router_softmax_sum,
            stats: MoeStats {
                load_imbalance: plan.dispatch.stats.load_imbalance(),
                routing: plan.dispatch.stats,
                n_partitions,
                split: plan.scheme,
                strategy: plan.strategy,
                path: config.path,
                memory: plan.memory,
                recv_rows,
                shadows: plan.shadows,
                decode,
            },
        })
    }

    fn flatten<const D: usize>(&self, input: Tensor<B, D>) -> Result<Tensor<B, 2>> {
        let dims = input.dims();
        let d_model = self.ctx.config.d_model;
        if D < 2 {
            return Err(MoeError::Input(format!(
                "expected [n_tokens, {d_model}] or [batch, seq, {d_model}], got a {D}-d tensor {dims:?}"
            )));
        }
        if dims[D - 1] != d_model {
            return Err(MoeError::Input(format!(
                "last dimension is {}, expected d_model = {d_model} (input shape {dims:?})",
                dims[D - 1]
            )));
        }
        let n_tokens = dims[..D - 1].iter().product();
        // The finite check is read with the routing (step 2).
        Ok(input.reshape([n_tokens, d_model]))
    }

    /// Step 5 with this rank's experts and the copies of the shadowed ones: the fused op
    /// broadcasts the copies and folds their gradients back itself (`exchange/shadows.rs`);
    /// the reference twin is handed them built from differentiable ops.
    fn exchange(
        &self,
        t_i: Tensor<B, 2>,
        plan: ExchangePlan,
        strategy: Strategy,
        shadows: &[usize],
    ) -> Result<Tensor<B, 2>> {
        match self.ctx.config.path {
            ExchangePath::Reference => {
                let experts = self.weights_with_shadows(shadows)?;
                exchange_reference(t_i, &experts, &plan, &self.ctx.comm)
            }
            ExchangePath::Fused => {
                let mut run = self.exchange_run(strategy);
                run.shadows = shadows.to_vec();
                let out = B::exchange(
                    t_i.into_primitive().tensor(),
                    self.expert_tensors(),
                    Arc::new(plan),
                    &run,
                )?;
                Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
            }
        }
    }

    /// This rank's experts as the fused op and the decode path take them: the stacked weights,
    /// with the adapters' factors beside them where the layer has adapters.
    pub(super) fn expert_tensors(&self) -> ExpertTensors<B> {
        let experts = self.experts.weights().tensors();
        match &self.adapters {
            Some(adapters) => adapters.attach(experts),
            None => experts,
        }
    }
}

/// Step 4: the rows of `x` in the plan's order, one per kept (token, expert) assignment
/// ([`DispatchPlan::token_map`](crate::dispatch::DispatchPlan::token_map)).
///
/// # Shapes
/// - `x`: `[n_tokens, d_model]`
/// - returns `T_I`: `[n_rows, d_model]`, `n_rows = tokens.n_rows()`
pub(super) fn permute<B: MoeBackend>(x: &Tensor<B, 2>, tokens: &Arc<RowMap>) -> Tensor<B, 2> {
    float(B::gather_rows(x.clone().into_primitive().tensor(), tokens))
}

fn float<B: Backend>(x: burn::tensor::ops::FloatTensor<B>) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// Step 6: sums each row of `T_O`, scaled by its combine weight where step 4 did not apply
/// it, onto its token: one op with the weights (`MoeBackend::combine_weighted`, a kernel on
/// the CubeCL backends), the plain combine without. Dropped assignments have no row and add
/// nothing.
///
/// # Shapes
/// - `t_o`: `[n_rows, d_model]`, `weights`: `[n_tokens, top_k]` → `[n_tokens, d_model]`
fn unpermute<B: MoeBackend>(
    t_o: Tensor<B, 2>,
    weights: Option<Tensor<B, 2>>,
    map: &Arc<CombineMap>,
) -> Tensor<B, 2> {
    let t_o = t_o.into_primitive().tensor();
    float(match weights {
        Some(w) => B::combine_weighted(t_o, w.into_primitive().tensor(), map),
        None => B::combine_rows(t_o, map.tokens()),
    })
}
