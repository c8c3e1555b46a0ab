//! Which experts this step shadows: the configured [`Shadowing`] resolved on the gathered
//! counts (the rule and its derivation: `tuning::choose_shadows`, and "Shadowing hot experts"
//! in docs/design-notes.md).

use super::super::MoeLayer;
use crate::dispatch::RoutingCounts;
use crate::error::Result;
use crate::exchange::executor::StepExecutor;
use crate::exchange::MoeBackend;
use crate::tuning::{choose_shadows, hottest_experts, ShadowCosts, Shadowing};

impl<B: MoeBackend> MoeLayer<B> {
    /// The experts to replicate on every rank for this step, in increasing index (the order
    /// of their slots after each rank's own experts). Empty on one rank. Every rank reaches
    /// the same answer: it depends on the gathered counts and the profile averaged over the
    /// ranks.
    ///
    /// # Errors
    /// [`MoeError::Comm`](crate::MoeError::Comm) if `Auto` must measure the profile and a peer
    /// fails in its collective.
    pub(super) fn choose_shadows(&self, counts: &RoutingCounts) -> Result<Vec<usize>> {
        let config = &self.ctx.config;
        let n_ranks = counts.n_ranks();
        if n_ranks == 1 {
            return Ok(Vec::new());
        }
        let n_experts = config.n_experts;
        let kept = counts.kept_by_rank();
        let mut shadows = match config.shadowing {
            Shadowing::Off => Vec::new(),
            Shadowing::Fixed(k) => hottest_experts(kept, n_experts, k.min(n_experts)),
            Shadowing::Auto => {
                let profile = self.profile_or_measure()?;
                let n_local = n_experts / n_ranks;
                let owner: Vec<usize> = (0..n_experts).map(|e| e / n_local).collect();
                let (m, h) = (config.d_model, config.d_hidden);
                // GEMMs of d_model × d_hidden per expert: two, or three with SwiGLU's gate.
                let gemms = (config.activation.d_inner(h) + h) / h;
                let elem_bytes = std::mem::size_of::<B::FloatElem>();
                let costs = ShadowCosts::from_profile(&profile, m, h, gemms, elem_bytes);
                // A device broadcast (NCCL's ring) moves about an expert's bytes per rank and
                // shadow; the host path's owner sends one copy to each other rank.
                // Asked of the backend, not looked up by type here: under `Autodiff<..>` or
                // `Fusion<..>` the broadcast runs on the inner backend's path.
                let device_path = B::has_device_reduce(self.ctx.comm.as_ref());
                let costs = if device_path {
                    costs
                } else {
                    costs.with_host_broadcast(n_ranks)
                };
                // The pipeline overlaps a rank's compute and exchange only where its steps run
                // on streams at once; the in-order executor (every CPU backend's) pays both.
                let executor = config
                    .executor
                    .unwrap_or_else(|| B::step_executor(&self.experts.w_in.device()));
                let costs = if executor == StepExecutor::InOrder {
                    costs.serial()
                } else {
                    costs
                };
                // At most all but one: with every expert shadowed nothing crosses, which is
                // the data-parallel layer, not a balancing of this one.
                choose_shadows(kept, &owner, &costs, n_experts - 1)
            }
        };
        shadows.sort_unstable();
        Ok(shadows)
    }
}
