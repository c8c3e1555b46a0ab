//! The decode path: steps 3 and 5 of the forward for a few tokens at inference on one rank.
//!
//! A generation's decode step sends one token per prompt through the layer. The exchange's
//! machinery is built for thousands: Algorithm 1's table, the cost model's strategy, the
//! partitions, the schedule and its executor, the partition buffers. For a few tokens that
//! stay on their rank and need no backward, all of it runs for nothing (about a tenth of the
//! layer's time at one token on the CPU, where the experts' products are the rest). So here
//! step 3 is the counts alone (capacity applied as the plan applies it) and `T_I`'s rows in
//! one block by expert, and step 5 hands the block to this rank's experts
//! ([`MoeBackend::experts_forward`]): the products the exchange would run, on the same rows,
//! at the same precision, so the output is the exchange's.
//!
//! The layer takes it where [`MoeLayerConfig::decode_tokens`](super::MoeLayerConfig) allows
//! the batch's size, the backend tracks no gradients, the path is the fused op, and neither
//! the expert-parallel group nor its data-parallel replicas have anything to exchange
//! ([`Communicator::is_identity`](crate::Communicator::is_identity)): a second rank must join
//! every collective, and a one-rank group that emulates the network (`HostLoopback`) is there
//! to send its rows.

use burn::tensor::{Tensor, TensorPrimitive};

use super::plan::{BatchPlan, Route};
use super::{ExchangePath, MoeLayer};
use crate::dispatch::SplitScheme;
use crate::error::Result;
use crate::exchange::MoeBackend;
use crate::memory::Strategy;

impl<B: MoeBackend> MoeLayer<B> {
    /// Whether a batch of `n_tokens` on `device` takes the decode path (see the module docs).
    pub(super) fn decodes(&self, n_tokens: usize, device: &B::Device) -> bool {
        let config = &self.ctx.config;
        (1..=config.decode_tokens).contains(&n_tokens)
            && config.path == ExchangePath::Fused
            && self.ctx.comm.is_identity()
            && self.ctx.replicas.is_identity()
            && !B::ad_enabled(device)
    }

    /// Step 3 on the decode path: the counts and `T_I`'s rows in one block, by expert.
    ///
    /// # Shapes
    /// - `indices`: `[n_tokens * top_k]`, the chosen experts, best first
    ///
    /// # Errors
    /// As [`RoutingCounts::gather`](crate::dispatch::RoutingCounts::gather) (which, on one
    /// rank, has no peer to fail).
    pub(super) fn plan_direct(&self, indices: &[usize], n_tokens: usize) -> Result<BatchPlan> {
        let counts = self.gather_counts(indices, n_tokens)?;
        Ok(BatchPlan {
            scheme: SplitScheme::Tokens(1),
            strategy: Strategy::None,
            memory: None,
            dispatch: counts.dispatch_plan(),
            route: Route::Direct(counts.kept_per_expert().to_vec()),
            shadows: Vec::new(),
        })
    }

    /// Step 5 on the decode path: `T_I`'s rows through this rank's experts (with their
    /// adapters, if any).
    ///
    /// # Shapes
    /// - `t_i`: `[n_rows, d_model]`, expert `e`'s `rows_per_expert[e]` rows in order
    /// - returns `T_O`: `[n_rows, d_model]`
    pub(super) fn experts_direct(
        &self,
        t_i: Tensor<B, 2>,
        rows_per_expert: &[usize],
    ) -> Result<Tensor<B, 2>> {
        let run = self.exchange_run(Strategy::None);
        let out = B::experts_forward(
            t_i.into_primitive().tensor(),
            self.expert_tensors(),
            rows_per_expert,
            &run,
        )?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(out)))
    }
}
