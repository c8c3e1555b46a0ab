//! The memory strategy of a batch: `MemoryReuse` resolved to a [`Strategy`], with the cost
//! model's choice (Eq. 10–13) for `MemoryReuse::Auto` from the layer's measured profile.

use super::super::MoeLayer;
use crate::dispatch::RoutingCounts;
use crate::error::Result;
use crate::exchange::MoeBackend;
use crate::memory::Strategy;
use crate::tuning::{measure_profile, CostModel, Profile, ProfileOptions, StrategyChoice};

impl<B: MoeBackend> MoeLayer<B> {
    /// The memory strategy for this batch without a memory budget: the configured one, or
    /// the cost model's cheapest (every strategy fits without a budget, so no peak is
    /// modelled for the choice).
    pub(super) fn resolve_strategy(&self, counts: &RoutingCounts, n_partitions: usize) -> Result<Strategy> {
        Ok(self.strategies_by_cost(counts, n_partitions)?[0])
    }

    /// What `MemoryReuse::Auto` chooses for `n_tokens_global` tokens over the group and
    /// `n_partitions`, with every candidate's three stream terms ([`StrategyChoice::explain`]).
    ///
    /// Under a `memory_budget` a candidate fits as the layer's own budget tests it: its
    /// modelled peak, with the model's headroom, on this layer's route and executor (the
    /// memory model the batch's decision replays), with balanced routing. A batch's decision
    /// models each rank's own rows, so under skew it may pick another strategy or more
    /// partitions ([`MemoryDecision`](crate::memory::MemoryDecision) says which and why).
    ///
    /// Uses the layer's profile; without one, measures one on first use at the layer's own
    /// shapes (a few seconds) and averages it over the ranks so that all ranks decide alike.
    /// A collective in that case: every rank must call it.
    pub fn strategy_choice(&self, n_tokens_global: usize, n_partitions: usize) -> Result<StrategyChoice> {
        let budget = self.ctx.config.memory_budget;
        let profile = self.profile_or_measure()?;
        let shape = self.model_shape(n_tokens_global, self.ctx.comm.n_ranks(), n_partitions);
        let elem_bytes = std::mem::size_of::<B::FloatElem>();
        CostModel::new(profile).choose(
            &shape,
            elem_bytes,
            budget.map(|b| b as f64),
            self.model_execution(),
        )
    }

    pub(super) fn profile_or_measure(&self) -> Result<Profile> {
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
}
