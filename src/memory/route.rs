//! How a pass computes its experts, as far as memory goes ([`ExpertRoute`]): the part of the
//! implementation's model that depends on who runs `C_i` and `C'_i`.

use serde::Serialize;

/// Who computes a partition's experts, and so what `C_i` and `C'_i` hold besides the
/// partition buffers: what the implementation's memory model
/// ([`ImplementationModel::for_route`](super::ImplementationModel::for_route)) replays for
/// those steps.
///
/// The layer finds the route the way the exchange finds its expert compute (a device
/// library's path, the backend's own, else the primitives): experts with low-rank adapters
/// always run on the primitives, and a path says its own route
/// ([`ExpertPath::route`](crate::backend::ExpertPath::route)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub enum ExpertRoute {
    /// The primitives, one expert after another: each expert's transients (its GEMMs' outputs,
    /// its activation) one at a time, each expert's weight gradient a tensor of its own until
    /// the backward's end stacks them (`exchange/ffn/`).
    #[default]
    ExpertByExpert,
    /// A path's job over the whole partition that runs its experts as tasks, `concurrent` at
    /// once, each holding its own transients: the partition's `T_M`, `T_DO` and `dT_DI`
    /// buffers and the stacked weight gradients exist whole from the job's start (Flex's own
    /// path, `exchange/flex_experts.rs`, with its pool's threads).
    Tasks {
        /// Experts running at once (at least 1).
        concurrent: usize,
    },
    /// A path's job over the whole partition with scratch for every row of it: the
    /// activation forward, and backward the activation, its gradient, the first GEMM's
    /// gradient and, where `T_M` was dropped, its recomputation, each partition-sized (the
    /// cuBLAS path, `mpipemoe-cuda`'s `gemm/forward.rs` and `gemm/backward.rs`), beside
    /// the whole buffers and the stacked weight gradients. The route assumed for a path that
    /// does not say its own, since it takes every transient as large as the partition.
    PartitionScratch,
}

impl ExpertRoute {
    /// Whether the partition's experts run as one job (every route but the primitives').
    pub fn whole_partition(self) -> bool {
        self != Self::ExpertByExpert
    }

    /// The route's name in reports (`expert-by-expert`, `tasks x2`, `partition-scratch`).
    pub fn name(self) -> String {
        match self {
            Self::ExpertByExpert => "expert-by-expert".into(),
            Self::Tasks { concurrent } => format!("tasks x{concurrent}"),
            Self::PartitionScratch => "partition-scratch".into(),
        }
    }
}
