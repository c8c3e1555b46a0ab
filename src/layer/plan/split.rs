//! How the exchange of a batch is split: `Partitions` resolved to a [`SplitScheme`], with
//! Algorithm 1 (`searchBestGran`) for `Partitions::Adaptive`.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorMetadata};

use super::super::module::permute;
use super::super::{ExchangePath, MoeLayer, Partitions};
use crate::dispatch::{RoutingCounts, SplitScheme};
use crate::error::Result;
use crate::exchange::MoeBackend;
use crate::memory::Strategy;
use crate::tuning::search_best_gran;

impl<B: MoeBackend> MoeLayer<B> {
    /// How the exchange is split for this batch: the configured `n`, FasterMoE's split, or
    /// Algorithm 1's choice for the global token count (searching on a miss of the layer's
    /// granularity table, with trials on this batch's rows `x`).
    pub(super) fn resolve_split(&self, counts: &RoutingCounts, x: &Tensor<B, 2>) -> Result<SplitScheme> {
        let config = &self.ctx.config;
        Ok(match (config.path, config.partitions) {
            (ExchangePath::Reference, _) => SplitScheme::Tokens(1),
            (_, Partitions::Fixed(n)) => SplitScheme::Tokens(n),
            (_, Partitions::ByRank) => SplitScheme::Ranks,
            (_, Partitions::Adaptive) => {
                let tokens = counts.n_tokens_global();
                let mut table = self.ctx.tuning.table();
                let (n, _) = table.lookup(tokens, |tokens| self.search_partitions(tokens, counts, x))?;
                SplitScheme::Tokens(n)
            }
        })
    }

    /// `searchBestGran(B)`: one forward + backward of the exchange per candidate `n`, timed by
    /// the layer's timer, the times summed over ranks so that every rank picks the same `n`.
    /// Trials run without memory reuse (or, under a memory budget, with the strategy the
    /// budget chooses at their `n`) and record no autodiff graph.
    ///
    /// The trials need this batch's `T_I` in some partition order (only the row counts
    /// matter to them), so a miss permutes `x` once more for them in the unpartitioned
    /// order; a hit, every later batch of the same size, permutes `T_I` only in step 4.
    fn search_partitions(&self, tokens: usize, counts: &RoutingCounts, x: &Tensor<B, 2>) -> Result<usize> {
        let config = &self.ctx.config;
        let mut candidates: Vec<usize> = config
            .adaptive_candidates
            .iter()
            .copied()
            .filter(|&n| n == 1 || n <= tokens * config.top_k)
            .collect();
        // Under a memory budget a trial runs with the strategy the budget would choose at its
        // `n`, and partition counts at which nothing fits are not tried: a trial must not
        // break the budget either.
        let mut strategies = std::collections::HashMap::new();
        if let Some(budget) = config.memory_budget {
            let mut fitting = Vec::new();
            let execution = self.model_execution();
            for n in candidates {
                if let Some((strategy, _)) = self.fit_at(counts, SplitScheme::Tokens(n), budget, execution)? {
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
        let (dispatch, _) = counts.plans(SplitScheme::Tokens(1));
        let input: FloatTensor<B> = permute(x, &dispatch.token_map()).into_primitive().tensor();
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
}
