//! Keeping every rank under `memory_budget`: the partition count and memory strategy of a
//! batch, chosen from every rank's routed rows.
//!
//! After the counts exchange every rank knows how many rows every rank will send and receive
//! in each partition ([`RoutingCounts::rank_rows`]). So every rank evaluates the same memory
//! model for every rank and reaches the same decision: the smallest partition count (the
//! configured one, or from Algorithm 1's choice upwards) at which some allowed strategy's
//! modelled peak fits the budget on *every* rank, and among those strategies the cheapest by
//! the cost model. If nothing fits, every rank returns the same [`MoeError::Memory`] before
//! the exchange allocates anything, so the caller can split the batch and retry.

use super::super::{MoeLayer, Partitions};
use crate::dispatch::{RoutingCounts, SplitScheme};
use crate::error::{MoeError, Result};
use crate::exchange::MoeBackend;
use crate::memory::{fit_budget, rank_peak_bytes, Execution, MemoryDecision, Strategy, MODEL_HEADROOM};
use crate::tuning::CostModel;

impl<B: MoeBackend> MoeLayer<B> {
    /// Every rank's modelled peak (bytes) at `scheme` under `strategy`, the pass run as
    /// `execution` says.
    fn rank_peaks(
        &self,
        counts: &RoutingCounts,
        scheme: SplitScheme,
        strategy: Strategy,
        execution: Execution,
    ) -> Vec<f64> {
        let n_ranks = counts.n_ranks();
        let shape = self.model_shape(counts.n_tokens_global(), n_ranks, scheme.n_partitions(n_ranks));
        let elem = std::mem::size_of::<B::FloatElem>();
        (0..counts.n_ranks())
            .map(|r| rank_peak_bytes(&shape, &counts.rank_rows(r, scheme), strategy, execution, elem))
            .collect()
    }

    /// The strategies the configuration allows, cheapest first by the cost model (a fixed
    /// strategy alone; every strategy for `MemoryReuse::Auto`).
    pub(super) fn strategies_by_cost(
        &self,
        counts: &RoutingCounts,
        n_partitions: usize,
    ) -> Result<Vec<Strategy>> {
        match self.ctx.config.memory_reuse.fixed() {
            Some(strategy) => Ok(vec![strategy]),
            None => {
                let shape = self.model_shape(counts.n_tokens_global(), counts.n_ranks(), n_partitions);
                let elem = std::mem::size_of::<B::FloatElem>();
                Ok(CostModel::new(self.profile_or_measure()?).cheapest_first(&shape, elem))
            }
        }
    }

    /// The cheapest allowed strategy that fits the budget on every rank at `scheme`, the
    /// pass run as `execution` says ([`model_execution`](Self::model_execution)), with the
    /// ranks' peaks;
    /// `None` if none fits.
    pub(super) fn fit_at(
        &self,
        counts: &RoutingCounts,
        scheme: SplitScheme,
        budget: usize,
        execution: Execution,
    ) -> Result<Option<(Strategy, Vec<f64>)>> {
        let n = scheme.n_partitions(counts.n_ranks());
        let order = self.strategies_by_cost(counts, n)?;
        let mut peaks = std::collections::HashMap::new();
        let (choice, _) = fit_budget(budget, &[n], &mut |_| order.clone(), &mut |_, strategy| {
            let p = self.rank_peaks(counts, scheme, strategy, execution);
            let worst = p.iter().cloned().fold(0.0, f64::max);
            peaks.insert(strategy, p);
            worst
        });
        Ok(choice.map(|c| (c.strategy, peaks.remove(&c.strategy).expect("evaluated"))))
    }

    /// The split schemes the budget may choose from, in order: the configured `n`; FasterMoE's
    /// split; or, when adaptive, Algorithm 1's `n` and the larger candidates.
    fn budget_schemes(&self, chosen: SplitScheme) -> Vec<SplitScheme> {
        match (self.ctx.config.partitions, chosen) {
            (Partitions::Adaptive, SplitScheme::Tokens(n)) => {
                let mut larger: Vec<usize> = self
                    .ctx
                    .config
                    .adaptive_candidates
                    .iter()
                    .copied()
                    .filter(|&c| c > n)
                    .collect();
                larger.sort_unstable();
                larger.dedup();
                std::iter::once(n)
                    .chain(larger)
                    .map(SplitScheme::Tokens)
                    .collect()
            }
            _ => vec![chosen],
        }
    }

    /// Chooses the split and strategy of this batch under the budget (see the module docs).
    ///
    /// # Errors
    /// [`MoeError::Memory`] if no allowed choice fits on every rank, naming the rank, its
    /// received rows, the bytes it needs at the largest partition count with S4, and the budget.
    pub(super) fn decide_under_budget(
        &self,
        counts: &RoutingCounts,
        chosen: SplitScheme,
        budget: usize,
    ) -> Result<(SplitScheme, Strategy, MemoryDecision)> {
        let n_ranks = counts.n_ranks();
        let recv_rows: Vec<usize> = (0..n_ranks).map(|r| counts.recv_rows_of(r)).collect();
        let schemes = self.budget_schemes(chosen);
        let execution = self.model_execution();
        let mut rejected = Vec::new();
        for &scheme in &schemes {
            if let Some((strategy, peaks)) = self.fit_at(counts, scheme, budget, execution)? {
                let n = scheme.n_partitions(n_ranks);
                let worst = peaks.iter().cloned().fold(0.0, f64::max);
                let reason = if rejected.is_empty() {
                    format!("n = {n} with {strategy} fits: the largest modelled rank peak is {worst:.0} of {budget} bytes")
                } else {
                    format!(
                        "n = {n} with {strategy} is the first that fits (largest modelled rank peak {worst:.0} of {budget} bytes); {} did not",
                        rejected.join(", ")
                    )
                };
                return Ok((
                    scheme,
                    strategy,
                    MemoryDecision {
                        budget_bytes: budget,
                        n_partitions: n,
                        strategy,
                        recv_rows,
                        peak_bytes: peaks,
                        route: execution.route,
                        threaded: execution.threaded,
                        reason,
                    },
                ));
            }
            rejected.push(format!("n = {}", scheme.n_partitions(n_ranks)));
        }
        // Nothing fits: report the rank that needs the most at the largest n with S4.
        let last = *schemes.last().expect("at least the chosen scheme");
        let peaks = self.rank_peaks(counts, last, Strategy::S4, execution);
        let (rank, need) = peaks
            .iter()
            .copied()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .expect("at least one rank");
        Err(MoeError::Memory(format!(
            "rank {rank} receives {} rows and needs {need:.0} bytes at n = {} with S4 ({:.0} with the model's {:.0}% headroom), over the memory_budget of {budget} bytes per rank; split the batch or raise the budget",
            recv_rows[rank],
            last.n_partitions(n_ranks),
            need * MODEL_HEADROOM,
            (MODEL_HEADROOM - 1.0) * 100.0
        )))
    }
}
