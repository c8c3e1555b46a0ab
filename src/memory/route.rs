//! How a pass computes its experts, as far as memory goes ([`ExpertRoute`]): the part of the
//! implementation's model that depends on who runs `C_i` and `C'_i`.

use serde::Serialize;

use crate::GemmPrecision;

/// Who computes a partition's experts, and so what `C_i` and `C'_i` hold besides the
/// partition buffers: what the implementation's memory model
/// ([`ImplementationModel::for_execution`](super::ImplementationModel::for_execution)) replays for
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
    /// The primitives, as [`ExpertByExpert`](Self::ExpertByExpert), with every batch of their
    /// products through a device library at the layer's precision, one section a batch
    /// (`exchange/products.rs`): experts with low-rank adapters where the communicator has a
    /// library (cuBLAS on CUDA), since no library job takes them. At bf16 each section holds
    /// bf16 copies of both operands of each of its products, made for the section and let go
    /// after it (`mpipemoe-cuda`'s `gemm/dense.rs`); the layer's dense products (the shared
    /// expert's) go through the same library.
    LibraryProducts {
        /// What the products read: the f32 tensors, or bf16 copies of them (their
        /// `weights_for_step` is never set: each section converts its own operands).
        operands: GemmOperands,
    },
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
    PartitionScratch {
        /// What the path's GEMMs read: the f32 tensors, or bf16 copies of them.
        operands: GemmOperands,
    },
}

/// What a [`PartitionScratch`](ExpertRoute::PartitionScratch) path's GEMMs read, as far as
/// memory goes: at [`GemmPrecision::Bf16`] the cuBLAS path multiplies bf16 copies of its
/// operands, which it makes in buffers of its own (`mpipemoe-cuda`'s `gemm/operands.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Default)]
pub enum GemmOperands {
    /// The f32 tensors themselves (IEEE f32 and TF32): the path's scratch is f32.
    #[default]
    F32,
    /// bf16 copies, each half an f32 element: of every job's row inputs (`T_DI`; backward
    /// `T_DI` and `dT_DO`) in the job's scratch, where the scratch that a GEMM reads (the
    /// activation, `dT_M`) is bf16 too; and of every expert slot's two matrices, made by a
    /// pass's first job and kept to the pass's end, or, where `weights_for_step`, kept from
    /// the forward's first job to the backward's end (`CublasOptions::bf16_weights_per_step`).
    /// The layer's dense products go through the same library at the same precision: the
    /// shared expert's products each convert their operands for their own section.
    Bf16 {
        /// The weights' copies are the step's, not each pass's.
        weights_for_step: bool,
    },
}

impl GemmOperands {
    /// What a path that multiplies at `precision` reads: at [`GemmPrecision::Bf16`] bf16
    /// copies, the weights' kept for the step where `weights_for_step` (else for each pass);
    /// the f32 tensors otherwise.
    pub fn at(precision: GemmPrecision, weights_for_step: bool) -> Self {
        match precision {
            GemmPrecision::Bf16 => Self::Bf16 { weights_for_step },
            GemmPrecision::F32 | GemmPrecision::Tf32 => Self::F32,
        }
    }
}

impl ExpertRoute {
    /// Whether the partition's experts run as one job (every route but the primitives').
    pub fn whole_partition(self) -> bool {
        !matches!(self, Self::ExpertByExpert | Self::LibraryProducts { .. })
    }

    /// What the route's GEMMs read: bf16 copies on a library at bf16, the f32 tensors
    /// elsewhere.
    pub fn operands(self) -> GemmOperands {
        match self {
            Self::PartitionScratch { operands } | Self::LibraryProducts { operands } => operands,
            Self::ExpertByExpert | Self::Tasks { .. } => GemmOperands::F32,
        }
    }

    /// The partition-scratch route of a path that multiplies at `precision`, its bf16
    /// weights kept for each pass ([`GemmOperands::at`]): what a path that does not say its
    /// own route is taken to hold.
    pub fn partition_scratch(precision: GemmPrecision) -> Self {
        Self::PartitionScratch {
            operands: GemmOperands::at(precision, false),
        }
    }

    /// The route's name in reports (`expert-by-expert`, `expert-by-expert on a library, bf16`,
    /// `tasks x2`, `partition-scratch`, `partition-scratch bf16`, `partition-scratch bf16,
    /// weights per step`).
    pub fn name(self) -> String {
        match self {
            Self::ExpertByExpert => "expert-by-expert".into(),
            Self::LibraryProducts { operands } => match operands {
                GemmOperands::F32 => "expert-by-expert on a library".into(),
                GemmOperands::Bf16 { .. } => "expert-by-expert on a library, bf16".into(),
            },
            Self::Tasks { concurrent } => format!("tasks x{concurrent}"),
            Self::PartitionScratch {
                operands: GemmOperands::F32,
            } => "partition-scratch".into(),
            Self::PartitionScratch {
                operands: GemmOperands::Bf16 { weights_for_step },
            } => match weights_for_step {
                false => "partition-scratch bf16".into(),
                true => "partition-scratch bf16, weights per step".into(),
            },
        }
    }
}

/// How a pass runs, as far as the implementation's memory model goes: who computes the
/// experts, and which executor runs the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Execution {
    /// Who computes the experts.
    pub route: ExpertRoute,
    /// The threaded executor (`StepExecutor::StreamThreads`): the assembled rows of every
    /// pass have a buffer of their own, one partition too (`RowAssembler`); what a step read
    /// is held to its stream's next fence, the step's end for the experts' steps, which the
    /// combines wait for (`Slots::hold`, `execute_on`); and the experts' gradients are handed back
    /// as copies made on the caller's stream while the running sums are still held
    /// (`ExpertGradAcc::finish_on_caller`). In issue order (`StepExecutor::InOrder`) none of
    /// the three.
    pub threaded: bool,
}

impl Execution {
    /// `route` in issue order.
    pub fn in_order(route: ExpertRoute) -> Self {
        Self {
            route,
            threaded: false,
        }
    }

    /// `route` on the threaded executor.
    pub fn threaded(route: ExpertRoute) -> Self {
        Self {
            route,
            threaded: true,
        }
    }

    /// `route` as the layer runs it on `n_ranks` ranks where the backend's streams overlap
    /// (CUDA): in issue order at one rank, where nothing is exchanged
    /// (`MoeLayer`'s exchange run), threaded above it. The CPU backends and WGPU run in issue
    /// order at every rank count, which holds less.
    pub fn on_gpu(route: ExpertRoute, n_ranks: usize) -> Self {
        Self {
            route,
            threaded: n_ranks > 1,
        }
    }
}
