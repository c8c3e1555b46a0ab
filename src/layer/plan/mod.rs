//! Step 3 of the forward recipe, in one room: from this rank's routing to the batch's plan.
//!
//! 1. **Count.** Every rank learns every rank's routed rows in one collective and capacity
//!    drops are applied ([`RoutingCounts::gather`]).
//! 2. **Split.** The configured `n`, FasterMoE's split, or Algorithm 1's choice for the global
//!    token count, searched on a miss of the granularity table (`split.rs`).
//! 3. **Shadows.** The hot experts replicated on every rank this step, if the layer shadows
//!    (`shadows.rs`); from here on the counts are those of the expert slots every rank runs.
//! 4. **Strategy.** The configured memory strategy or the cost model's (Eq. 13,
//!    `strategy.rs`); under a memory budget, the split and strategy that fit every rank
//!    (`budget.rs`), decided before anything of the exchange is allocated.
//! 5. **Plans.** `T_I`'s row order ([`DispatchPlan`]) and the partitions ([`ExchangePlan`]);
//!    [`MoeLayer::exchange_run`] adds the settings the exchange carries.
//!
//! Every rank reaches the same decisions: they depend only on the gathered counts, the
//! configuration, and profiles or timings summed over the ranks.

mod budget;
mod shadows;
mod split;
mod strategy;

use burn::tensor::Tensor;

use super::{ExchangePath, MoeLayer};
use crate::dispatch::{DispatchPlan, ExchangePlan, RoutingCounts, SplitScheme};
use crate::error::Result;
use crate::exchange::executor::StepExecutor;
use crate::exchange::{ExchangeRun, MoeBackend};
use crate::memory::{Execution, ExpertRoute, GemmOperands, LayerShape, MemoryDecision, Strategy};

/// What step 3 decides for one batch.
pub(super) struct BatchPlan {
    /// How the exchange is split into partitions.
    pub scheme: SplitScheme,
    /// How partition buffers are reused and activations restored.
    pub strategy: Strategy,
    /// The budget's decision, when the layer has a memory budget.
    pub memory: Option<MemoryDecision>,
    /// `T_I`'s rows: which token and top-k slot each row carries.
    pub dispatch: DispatchPlan,
    /// How step 5 runs the rows.
    pub route: Route,
    /// The experts shadowed this step, in increasing index: the exchange's expert slots
    /// after this rank's own.
    pub shadows: Vec<usize>,
}

/// How step 5 takes a batch's rows to the experts.
pub(super) enum Route {
    /// Through the exchange: the partitions of the all-to-all and the local experts' rows in
    /// each.
    Exchange(ExchangePlan),
    /// Straight to this rank's experts in one block (the decode path, `layer/decode.rs`):
    /// each local expert's rows, in order.
    Direct(Vec<usize>),
}

impl Route {
    /// Partitions the rows run in (one block on the decode path).
    pub fn n_partitions(&self) -> usize {
        match self {
            Route::Exchange(plan) => plan.n_partitions(),
            Route::Direct(_) => 1,
        }
    }

    /// Rows this rank's experts compute.
    pub fn recv_rows(&self) -> usize {
        match self {
            Route::Exchange(plan) => plan.recv_rows(),
            Route::Direct(rows) => rows.iter().sum(),
        }
    }
}

impl<B: MoeBackend> MoeLayer<B> {
    /// Plans this batch from its routing (see the module docs).
    ///
    /// # Shapes
    /// - `indices`: `[n_tokens * top_k]`, the chosen experts, best first
    /// - `x`: `[n_tokens, d_model]`, read only when Algorithm 1 must time trials on this batch
    ///
    /// # Errors
    /// [`MoeError::Comm`](crate::MoeError::Comm) if a peer fails in the counts collective or a
    /// search; [`MoeError::Memory`](crate::MoeError::Memory) if nothing fits the budget.
    pub(super) fn plan(&self, indices: &[usize], x: &Tensor<B, 2>) -> Result<BatchPlan> {
        let config = &self.ctx.config;
        let [n_tokens, _] = x.dims();
        let counts = self.gather_counts(indices, n_tokens)?;
        let scheme = self.resolve_split(&counts, x)?;
        // Shadows are chosen on the experts' counts; from here on the plan sees the expert
        // slots every rank runs (its own, then the shadows), so the budget and the cost model
        // count the shadows' rows where they are computed. (Algorithm 1 above timed the
        // exchange without shadows: its choice of n is for the unshadowed exchange.)
        let shadows = self.choose_shadows(&counts)?;
        let counts = counts.with_shadows(&shadows);
        let (scheme, strategy, memory) = match (config.path, config.memory_budget) {
            (ExchangePath::Reference, _) => (scheme, Strategy::None, None),
            (ExchangePath::Fused, Some(budget)) => {
                let (scheme, strategy, decision) = self.decide_under_budget(&counts, scheme, budget)?;
                (scheme, strategy, Some(decision))
            }
            (ExchangePath::Fused, None) => {
                let n = scheme.n_partitions(counts.n_ranks());
                (scheme, self.resolve_strategy(&counts, n)?, None)
            }
        };
        let (dispatch, exchange) = counts.plans(scheme);
        Ok(BatchPlan {
            scheme,
            strategy,
            memory,
            dispatch,
            route: Route::Exchange(exchange),
            shadows,
        })
    }

    /// Step 3's collective: every rank's routed rows per expert, capacity applied (see
    /// [`RoutingCounts::gather`]).
    ///
    /// # Errors
    /// [`MoeError::Comm`](crate::MoeError::Comm) if a peer fails in it.
    pub(super) fn gather_counts(&self, indices: &[usize], n_tokens: usize) -> Result<RoutingCounts> {
        let config = &self.ctx.config;
        RoutingCounts::gather(
            indices,
            n_tokens,
            config.top_k,
            config.n_experts,
            config.capacity_factor,
            self.ctx.comm.as_ref(),
            self.ctx.replicas.as_ref(),
        )
    }

    /// The run settings the fused exchange carries: communicator, activation, strategy, host
    /// store, executor, partition arena and the experts' GEMM precision.
    pub(crate) fn exchange_run(&self, strategy: Strategy) -> ExchangeRun {
        let mut run = ExchangeRun::new(
            self.ctx.comm.clone(),
            self.ctx.config.activation,
            strategy,
            self.ctx.host.clone(),
        );
        // With nothing to exchange (one rank), the schedule's streams have nothing to overlap:
        // in issue order it runs without worker threads and without a fence per step.
        run.executor = self.ctx.config.executor.or(self
            .ctx
            .comm
            .is_identity()
            .then_some(StepExecutor::InOrder));
        run.arena = Some(self.ctx.arena.clone());
        run.precision = self.ctx.config.gemm_precision;
        // The backend's own expert path unless the configuration says otherwise: the memory
        // model replays its route (`expert_route`), so a memory budget keeps it.
        run.backend_experts = self.ctx.config.backend_experts;
        // The primitives' activation over a whole partition, and every expert's products in
        // one library call, where no memory budget rests on the model, which replays the
        // primitives expert by expert (see the field).
        run.partition_transients = self.ctx.config.memory_budget.is_none();
        run
    }

    /// How this layer's exchange runs a pass, for the memory model: the executor its run
    /// takes ([`exchange_run`](Self::exchange_run): the config's, in issue order at one rank,
    /// else the backend's), and the route its experts take there
    /// ([`expert_route`](Self::expert_route)). Both executors compute the experts on the
    /// calling thread (the threaded one runs the compute stream there), so a path's answer
    /// asked here holds for either.
    pub(super) fn model_execution(&self) -> Execution {
        let device = self.experts.w_in.val().device();
        let threaded =
            self.exchange_run(Strategy::None).executor_for::<B>(&device) == StepExecutor::StreamThreads;
        Execution {
            route: self.expert_route(),
            threaded,
        }
    }

    /// The route this layer's experts take in the exchange, for the memory model: found as
    /// the exchange finds its expert compute (`exchange/ffn/library.rs`, `Library::find`).
    /// Experts with adapters run on the primitives (their products on the communicator's
    /// device library where it has one, [`ExpertRoute::LibraryProducts`]); otherwise the communicator's device
    /// library's path if it offers one, else the backend's own unless the experts' weights
    /// are frozen (the primitives then skip their gradients), each saying its route at the
    /// config's GEMM precision ([`MoeBackend::expert_route`]), asked from the layer's thread.
    pub(super) fn expert_route(&self) -> ExpertRoute {
        let adapted = self
            .adapters
            .as_ref()
            .is_some_and(|a| a.w_in.is_some() || a.w_out.is_some());
        if adapted {
            // No library job takes experts with adapters: the primitives run them, with their
            // products on the communicator's library where it has one (`Products::of`, on the
            // backend that runs the exchange: the route without the backend's own path is a
            // library's exactly where there is one).
            let precision = self.ctx.config.gemm_precision;
            return match B::expert_route(self.ctx.comm.as_ref(), false, precision) {
                ExpertRoute::ExpertByExpert => ExpertRoute::ExpertByExpert,
                _ => ExpertRoute::LibraryProducts {
                    operands: GemmOperands::at(precision, false),
                },
            };
        }
        // As the exchange's node marks them (`exchange/autodiff.rs`): a part is frozen where
        // autodiff tracks gradients but not the part's.
        let e = &self.experts;
        let mut tracked = [e.w_in.val().is_require_grad(), e.w_out.val().is_require_grad()]
            .into_iter()
            .chain(e.b_in.iter().map(|b| b.val().is_require_grad()))
            .chain(e.b_out.iter().map(|b| b.val().is_require_grad()));
        let frozen = B::ad_enabled(&e.w_in.val().device()) && !tracked.all(|t| t);
        let own = self.ctx.config.backend_experts && !frozen;
        B::expert_route(self.ctx.comm.as_ref(), own, self.ctx.config.gemm_precision)
    }

    /// The layer's shape for the memory and cost models: `n_tokens_global` tokens over the
    /// group, each rank taking its share, in `n_partitions` partitions.
    fn model_shape(&self, n_tokens_global: usize, n_ranks: usize, n_partitions: usize) -> LayerShape {
        let c = &self.ctx.config;
        LayerShape {
            tokens: n_tokens_global.div_ceil(n_ranks),
            top_k: c.top_k,
            d_model: c.d_model,
            d_hidden: c.d_hidden,
            activation: c.activation,
            shared_expert: c.shared_expert,
            shared_expert_gate: c.shared_expert_gate,
            shared_expert_overlap: c.shared_expert_overlap,
            weights_on_input: c.weights_on_input,
            n_experts: c.n_experts,
            n_ranks,
            n_partitions,
        }
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use burn::backend::NdArray;

    use crate::exchange::executor::StepExecutor;
    use crate::layer::MoeLayerConfig;
    use crate::memory::Strategy;

    /// The config's executor reaches the run; left to the backend, one rank (nothing to
    /// exchange, so nothing to overlap) runs in issue order, and two ranks leave it to the
    /// backend (`None`).
    #[test]
    fn the_configs_executor_reaches_the_exchange_run() {
        for executor in [Some(StepExecutor::StreamThreads), Some(StepExecutor::InOrder)] {
            let layer = MoeLayerConfig::new(8, 4, 2, 1)
                .with_executor(executor)
                .init::<NdArray>(&Default::default());
            assert_eq!(layer.exchange_run(Strategy::None).executor, executor);
        }
        let one = MoeLayerConfig::new(8, 4, 2, 1).init::<NdArray>(&Default::default());
        assert_eq!(
            one.exchange_run(Strategy::None).executor,
            Some(StepExecutor::InOrder)
        );
        let two = crate::LocalGroup::run(2, |ctx| {
            let layer = MoeLayerConfig::new(8, 4, 2, 1)
                .init_rank::<NdArray>(&Default::default(), ctx.comm.clone())?;
            Ok(layer.exchange_run(Strategy::None).executor)
        })
        .unwrap();
        assert_eq!(two, vec![None, None]);
    }

    /// The route the memory model replays is the one the exchange takes: Flex's own path
    /// (with or without autodiff), but the primitives where the configuration turns it off,
    /// where the experts have adapters, where autodiff leaves their weights untracked (the
    /// primitives then skip those gradients), and on a backend without a path of its own.
    #[cfg(feature = "flex")]
    #[test]
    fn the_models_route_is_the_exchanges() {
        use burn::backend::{Autodiff, Flex};
        use burn::module::Module;

        use crate::comm::{RowPaths, SingleRank, WithRowPaths};
        use crate::exchange::ComposedExperts;
        use crate::experts::LoraScaling;
        use crate::layer::ExpertLoraSpec;
        use crate::memory::{Execution, ExpertRoute, GemmOperands};
        use crate::{Communicator, GemmPrecision};
        use std::sync::Arc;

        let config = MoeLayerConfig::new(8, 4, 2, 1).with_memory_budget(Some(1 << 30));
        let device = Default::default();
        let own = |route: ExpertRoute| matches!(route, ExpertRoute::Tasks { .. });
        let layer = config.init::<Autodiff<Flex>>(&device);
        assert!(own(layer.expert_route()));
        // The executor the model replays is the run's: in order at one rank, unless the
        // config asks for threads; the experts' route is asked where both compute (the
        // calling thread's pool: three experts side by side on three threads).
        assert!(!layer.model_execution().threaded);
        let threads = config
            .clone()
            .with_executor(Some(StepExecutor::StreamThreads))
            .init::<Autodiff<Flex>>(&device);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        assert_eq!(
            pool.install(|| threads.model_execution()),
            Execution {
                route: ExpertRoute::Tasks { concurrent: 3 },
                threaded: true
            }
        );
        assert!(
            own(config.init::<Flex>(&device).expert_route()),
            "no autodiff: nothing frozen"
        );
        let off = config.clone().with_backend_experts(false);
        assert_eq!(
            off.init::<Autodiff<Flex>>(&device).expert_route(),
            ExpertRoute::ExpertByExpert
        );
        assert_eq!(
            layer.clone().no_grad().expert_route(),
            ExpertRoute::ExpertByExpert
        );
        let spec = ExpertLoraSpec {
            rank: 2,
            alpha: 4.0,
            scaling: LoraScaling::Standard,
            w_in: true,
            w_out: false,
        };
        let adapted = layer.no_grad().with_adapters(&spec, 1).unwrap();
        assert_eq!(adapted.expert_route(), ExpertRoute::ExpertByExpert);
        assert_eq!(
            config
                .init::<Autodiff<NdArray>>(&Default::default())
                .expert_route(),
            ExpertRoute::ExpertByExpert
        );
        // A device library's path says its route at the config's precision: a path that says
        // nothing holds partition scratch, with bf16 copies of its operands at bf16.
        let paths = RowPaths::new().with_experts::<NdArray>(Arc::new(ComposedExperts));
        let comm: Arc<dyn Communicator> = Arc::new(WithRowPaths::adding(Arc::new(SingleRank), paths));
        let on_library = |precision, adapters: Option<&ExpertLoraSpec>| {
            let layer = config
                .clone()
                .with_gemm_precision(precision)
                .init_rank::<Autodiff<NdArray>>(&Default::default(), comm.clone())
                .unwrap();
            match adapters {
                Some(spec) => layer.with_adapters(spec, 1).unwrap().expert_route(),
                None => layer.expert_route(),
            }
        };
        assert_eq!(
            on_library(GemmPrecision::Tf32, None),
            ExpertRoute::PartitionScratch {
                operands: GemmOperands::F32
            }
        );
        assert_eq!(
            on_library(GemmPrecision::Bf16, None),
            ExpertRoute::PartitionScratch {
                operands: GemmOperands::Bf16 {
                    weights_for_step: false
                }
            }
        );
        // Experts with adapters on the same library: the primitives, their products through
        // it, which converts their operands at bf16.
        assert_eq!(
            on_library(GemmPrecision::Bf16, Some(&spec)),
            ExpertRoute::LibraryProducts {
                operands: GemmOperands::Bf16 {
                    weights_for_step: false
                }
            }
        );
        assert_eq!(
            on_library(GemmPrecision::F32, Some(&spec)),
            ExpertRoute::LibraryProducts {
                operands: GemmOperands::F32
            }
        );
    }
}
