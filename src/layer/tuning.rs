//! Resolving `Partitions::Adaptive` (Algorithm 1) and `MemoryReuse::Auto` (Eq. 13) for a batch.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorMetadata};

use super::{ExchangePath, MoeLayer, Partitions};
use crate::dispatch::{RoutingCounts, SplitScheme};
use crate::error::Result;
use crate::exchange::{ExchangeRun, MoeBackend};
use crate::memory::{LayerShape, Strategy};
use crate::tuning::{
    measure_profile, search_best_gran, CostModel, Lookup, Profile, ProfileOptions, StrategyChoice,
};

impl<B: MoeBackend> MoeLayer<B> {
    /// How the exchange is split for this batch: the configured `n`, FasterMoE's split, or
    /// Algorithm 1's choice for the global token count (searching on a miss).
    pub(crate) fn resolve_split(
        &self,
        counts: &RoutingCounts,
        t_i: &Tensor<B, 2>,
    ) -> Result<(SplitScheme, Option<Lookup>)> {
        let config = &self.ctx.config;
        Ok(match (config.path, config.partitions) {
            (ExchangePath::Reference, _) => (SplitScheme::Tokens(1), None),
            (_, Partitions::Fixed(n)) => (SplitScheme::Tokens(n), None),
            (_, Partitions::ByRank) => (SplitScheme::Ranks, None),
            (_, Partitions::Adaptive) => {
                let tokens = counts.n_tokens_global();
                let mut table = self.ctx.tuning.table();
                let (n, how) = table.lookup(tokens, |tokens| self.search_partitions(tokens, counts, t_i))?;
                (SplitScheme::Tokens(n), Some(how))
            }
        })
    }

    /// `searchBestGran(B)`: one forward + backward of the exchange per candidate `n`, timed by
    /// the layer's timer, the times summed over ranks so that every rank picks the same `n`.
    /// Trials run without memory reuse (or, under a memory budget, with the strategy the
    /// budget chooses at their `n`) and record no autodiff graph.
    fn search_partitions(&self, tokens: usize, counts: &RoutingCounts, t_i: &Tensor<B, 2>) -> Result<usize> {
        let config = &self.ctx.config;
        let candidates: Vec<usize> = config
            .adaptive_candidates
            .iter()
            .copied()
            .filter(|&n| n == 1 || n <= tokens * config.top_k)
            .collect();
        // Under a memory budget a trial runs with the strategy the budget would choose at its
        // `n`, and partition counts at which nothing fits are not tried: a trial must not
        // break the budget either.
        let mut strategies = std::collections::HashMap::new();
        let mut candidates = candidates;
        if let Some(budget) = config.memory_budget {
            let mut fitting = Vec::new();
            for n in candidates {
                if let Some((strategy, _)) = self.fit_at(counts, SplitScheme::Tokens(n), budget)? {
                    strategies.insert(n, strategy);
                    fitting.push(n);
                }
            }
            if fitting.is_empty() {
                let largest = config.adaptive_candidates.iter().copied().max().unwrap_or(1);
                return self
                    .decide_under_budget(counts, SplitScheme::Tokens(largest), budget)
                    .map(|(scheme, _, _)| scheme.n_partitions(counts.n_ranks()));
            }
            candidates = fitting;
        }
        let input: FloatTensor<B> = t_i.clone().into_primitive().tensor();
        let experts = self.experts.tensors();
        let mut trial = |n: usize| -> Result<()> {
            let run = self.exchange_run(strategies.get(&n).copied().unwrap_or(Strategy::None));
            let plan = counts.exchange_plan(SplitScheme::Tokens(n));
            let (out, saved) = B::exchange_forward(input.clone(), experts.clone(), &plan, &run)?;
            let grad = B::float_ones(out.shape(), &B::float_device(&out), out.dtype().into());
            B::exchange_backward(grad, saved, &plan, &run).map(|_| ())
        };
        let timer = self.ctx.tuning.timer();
        let comm = self.ctx.comm.clone();
        let mut reduce = |times: &mut [f64]| comm.all_reduce_sum(times);
        search_best_gran(tokens, &candidates, timer.as_ref(), &mut trial, &mut reduce).map(|(n, _)| n)
    }

    /// The memory strategy for this batch: the configured one, or the cost model's choice.
    pub(crate) fn resolve_strategy(&self, counts: &RoutingCounts, n_partitions: usize) -> Result<Strategy> {
        match self.ctx.config.memory_reuse.fixed() {
            Some(strategy) => Ok(strategy),
            None => Ok(self.strategy_choice(counts.n_tokens_global(), n_partitions)?.best),
        }
    }

    /// What `MemoryReuse::Auto` chooses for `n_tokens_global` tokens over the group and
    /// `n_partitions`, with every candidate's three stream terms ([`StrategyChoice::explain`]).
    ///
    /// Uses the layer's profile; without one, measures one on first use at the layer's own
    /// shapes (a few seconds) and averages it over the ranks so that all ranks decide alike.
    /// A collective in that case: every rank must call it.
    pub fn strategy_choice(&self, n_tokens_global: usize, n_partitions: usize) -> Result<StrategyChoice> {
        self.choose_strategy(n_tokens_global, n_partitions, self.ctx.config.memory_budget)
    }

    /// [`strategy_choice`](Self::strategy_choice) without the budget: every candidate's cost.
    pub(crate) fn strategy_choice_unbounded(
        &self,
        n_tokens_global: usize,
        n_partitions: usize,
    ) -> Result<StrategyChoice> {
        self.choose_strategy(n_tokens_global, n_partitions, None)
    }

    fn choose_strategy(
        &self,
        n_tokens_global: usize,
        n_partitions: usize,
        budget: Option<usize>,
    ) -> Result<StrategyChoice> {
        let config = &self.ctx.config;
        let profile = self.profile_or_measure()?;
        let n_ranks = self.ctx.comm.n_ranks();
        let shape = LayerShape {
            tokens: n_tokens_global.div_ceil(n_ranks),
            top_k: config.top_k,
            d_model: config.d_model,
            d_hidden: config.d_hidden,
            activation: config.activation,
            shared_expert: config.shared_expert,
            n_experts: config.n_experts,
            n_ranks,
            n_partitions,
        };
        let elem_bytes = std::mem::size_of::<B::FloatElem>();
        CostModel::new(profile).choose(&shape, elem_bytes, budget.map(|b| b as f64))
    }

    fn profile_or_measure(&self) -> Result<Profile> {
        if let Some(profile) = self.ctx.tuning.profile().clone() {
            return Ok(profile);
        }
        let config = &self.ctx.config;
        let options = ProfileOptions {
            d_model: config.d_model,
            d_hidden: config.d_hidden,
            rows: 512,
            small_rows: 32,
            comm_bytes: 4 << 20,
            copy_bytes: 16 << 20,
            repeats: 3,
            ..ProfileOptions::default()
        };
        let device = self.experts.w_in.device();
        let measured = measure_profile::<B>(&device, &options, &mut |_| {})?;
        let profile = self.average_over_ranks(measured)?;
        *self.ctx.tuning.profile() = Some(profile.clone());
        Ok(profile)
    }

    fn average_over_ranks(&self, p: Profile) -> Result<Profile> {
        let mut values = p.numbers().map(|(_, v)| v);
        self.ctx.comm.all_reduce_sum(&mut values)?;
        let n = self.ctx.comm.n_ranks() as f64;
        Ok(p.with_numbers(values.map(|v| v / n)))
    }

    pub(crate) fn exchange_run(&self, strategy: Strategy) -> ExchangeRun {
        let mut run = ExchangeRun::new(
            self.ctx.comm.clone(),
            self.ctx.config.activation,
            strategy,
            self.ctx.host.clone(),
        );
        run.executor = self.ctx.config.executor;
        run.arena = Some(self.ctx.arena.clone());
        run
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use burn::backend::NdArray;

    use crate::exchange::executor::StepExecutor;
    use crate::{MoeLayerConfig, Strategy};

    #[test]
    fn the_configs_executor_reaches_the_exchange_run() {
        for executor in [
            None,
            Some(StepExecutor::StreamThreads),
            Some(StepExecutor::InOrder),
        ] {
            let layer = MoeLayerConfig::new(8, 4, 2, 1)
                .with_executor(executor)
                .init::<NdArray>(&Default::default());
            assert_eq!(layer.exchange_run(Strategy::None).executor, executor);
        }
    }
}
