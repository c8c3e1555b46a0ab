//! Expert parallelism inside data parallelism: `world = expert-parallel × data-parallel`.
//!
//! With more ranks than experts (or to keep an expert's all-to-all inside one node), the
//! world is cut into data-parallel replicas of an expert-parallel group, as Megatron-Core,
//! DeepSpeed-MoE and Tutel do. World rank `r` is rank `r % ep` of expert-parallel group
//! `r / ep` (consecutive ranks, so that the all-to-all stays among neighbours, within a node
//! where a node holds `ep` GPUs) and rank `r / ep` of expert-data-parallel group `r % ep`: the
//! ranks that hold the same experts.
//!
//! - The MoE layer runs over the expert-parallel group ([`MoeLayerConfig::init_groups`]
//!   (crate::MoeLayerConfig::init_groups)): its all-to-alls and counts stay inside it, and it
//!   holds `n_experts / ep` experts. The routing statistics that the losses and the
//!   score-bias balancing use are summed over the replicas as well, so the auxiliary and
//!   z-losses are shares of the global-batch losses, as with expert parallelism alone.
//! - Gradients ([`ParallelGroups::sync_grads`]): replicated parameters are summed over the
//!   world, expert weights over the expert-data-parallel group.

use std::sync::Arc;

use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;

use super::sync::{sync_expert_grads, sync_replicated_grads, SyncReport};
use crate::comm::{Communicator, SingleRank};
use crate::error::{MoeError, Result};
use crate::exchange::MoeBackend;

/// The communicators of one rank under expert × data parallelism.
#[derive(Debug, Clone)]
pub struct ParallelGroups {
    world: Arc<dyn Communicator>,
    expert: Arc<dyn Communicator>,
    expert_data: Arc<dyn Communicator>,
}

impl ParallelGroups {
    /// Expert parallelism over the whole world, no data-parallel replicas of the experts:
    /// how a model runs with [`MoeLayerConfig::init_rank`](crate::MoeLayerConfig::init_rank).
    pub fn expert_parallel(world: Arc<dyn Communicator>) -> Self {
        Self {
            expert: world.clone(),
            world,
            expert_data: Arc::new(SingleRank),
        }
    }

    /// Whether a world of `n_ranks` cuts into expert-parallel groups of `expert_parallel`:
    /// what [`new`](Self::new) checks first, for a caller that checks its options before it
    /// has a communicator.
    ///
    /// # Errors
    /// [`MoeError::Config`] naming `expert_parallel` if it is 0 or does not divide `n_ranks`.
    pub fn check_sizes(n_ranks: usize, expert_parallel: usize) -> Result<()> {
        if expert_parallel == 0 || !n_ranks.is_multiple_of(expert_parallel) {
            return Err(MoeError::config(
                "expert_parallel",
                format!("{expert_parallel} does not divide the {n_ranks} ranks of the world"),
            ));
        }
        Ok(())
    }

    /// Cuts `world` into expert-parallel groups of `expert_parallel` consecutive ranks and
    /// their data-parallel replicas (see the module docs). Collective: every rank of `world`
    /// calls it with the same `expert_parallel`.
    ///
    /// # Errors
    /// [`MoeError::Config`] naming `expert_parallel` if it is 0 or does not divide the world
    /// size; [`MoeError::Comm`] if the communicator cannot form sub-groups or a peer fails.
    pub fn new(world: Arc<dyn Communicator>, expert_parallel: usize) -> Result<Self> {
        let n = world.n_ranks();
        Self::check_sizes(n, expert_parallel)?;
        if expert_parallel == n {
            return Ok(Self::expert_parallel(world));
        }
        let rank = world.rank();
        let expert = world.split(rank / expert_parallel)?;
        let expert_data = world.split(rank % expert_parallel)?;
        Ok(Self {
            world,
            expert,
            expert_data,
        })
    }

    /// Every rank.
    pub fn world(&self) -> &Arc<dyn Communicator> {
        &self.world
    }

    /// This rank's expert-parallel group: the MoE layers' all-to-alls run in it.
    pub fn expert(&self) -> &Arc<dyn Communicator> {
        &self.expert
    }

    /// The ranks that hold the same experts as this one (one per data-parallel replica).
    pub fn expert_data(&self) -> &Arc<dyn Communicator> {
        &self.expert_data
    }

    /// The number of data-parallel replicas of the expert-parallel group.
    pub fn data_parallel(&self) -> usize {
        self.expert_data.n_ranks()
    }

    /// Sums every gradient over the ranks that hold a copy of its parameter: replicated
    /// parameters over the world, expert weights over the expert-data-parallel group.
    /// Returns the two reports, replicated first.
    ///
    /// # Errors
    /// [`MoeError::Comm`] if a peer fails or the ranks' models differ.
    pub fn sync_grads<B, M>(&self, model: &M, grads: &mut GradientsParams) -> Result<(SyncReport, SyncReport)>
    where
        B: AutodiffBackend,
        B::InnerBackend: MoeBackend,
        M: AutodiffModule<B>,
    {
        let replicated = sync_replicated_grads(model, grads, self.world.as_ref())?;
        let experts = sync_expert_grads(model, grads, self.expert_data.as_ref())?;
        Ok((replicated, experts))
    }
}
