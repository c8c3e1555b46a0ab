//! For backend authors: the contract of the fused exchange op and what implementing it needs.
//!
//! The layer calls [`MoeBackend::exchange`] with `T_I` (this rank's rows in plan order), the
//! local experts' weights, the [`ExchangePlan`] and an [`ExchangeRun`]. A backend implements
//! [`MoeBackend::exchange_forward`] and [`MoeBackend::exchange_backward`]; the activation
//! kernels of the expert FFN come from [`ActivationKernels`], the optimizer's update from
//! [`OptimizerKernels`], the training loss's row kernel from [`LossKernels`], attention's
//! layout change from [`LayoutKernels`] and the router's scores and combine weights from
//! [`RouterKernels`] (each with exact defaults from burn's ops, overridable).
//! [`fused_forward`] and [`fused_backward`] are the generic implementation written with
//! burn's primitive ops, which a new backend can start from, and [`exchange_reference`] is the
//! same function built from differentiable tensor ops, which tests hold an implementation to.
//!
//! The order of the exchange's steps is data: [`Schedule::forward`] and
//! [`Schedule::backward`] list every step (dispatch, expert compute, combine, offload,
//! prefetch, re-dispatch) with its stream, the partition buffers it reads and writes, and
//! what it waits for. [`execute_on_threads`] runs a schedule with one worker thread per
//! stream (the CPU executor), [`execute_in_order`] on the calling thread (a backend picks with
//! [`MoeBackend::step_executor`]); [`execute_on`] is the threaded executor on a backend's
//! device streams ([`MoeBackend::worker_streams`]), with a fence after every step another
//! stream waits for: the rule for tensors that cross streams is in [`WorkerStreams`]' module
//! docs and docs/design-notes.md.
//!
//! Where a backend has a partition arena ([`MoeBackend::slot_memory`], the CubeCL backends),
//! the generic implementation builds every partition buffer in it: one device buffer per
//! slot of the schedule, reused by every partition, layer and step the [`PartitionArena`] is
//! handed to.

pub use crate::decoder::DecoderKernels;
pub use crate::dispatch::{
    chunk_len, chunk_range, CombineMap, ExchangePlan, PartitionPlan, RoutingCounts, RowMap, SplitScheme,
};
pub use crate::exchange::executor::{
    execute as execute_on_threads, execute_in_order, execute_on, StepExecutor,
};
pub use crate::exchange::fused::{backward as fused_backward, forward as fused_forward, Saved as FusedSaved};
pub use crate::exchange::MoeBackend;
pub use crate::exchange::{
    buffer_of, exchange_reference, ArenaCounters, ArenaStats, BlockLayout, ComposedExperts, ExchangeGrads,
    ExchangeRun, ExpertBackward, ExpertBackwardOut, ExpertForward, ExpertGroups, ExpertPath, GemmPrecision,
    NoStreams, PartitionArena, PassStore, SlotMemory, StepHold, SyncStreams, WorkerStreams,
};
pub use crate::exchange::{combine_weighted_backward_composed, combine_weighted_composed};
pub use crate::experts::{
    ActivationKernels, ExpertGrads, ExpertPart, ExpertTensors, LowRankTensors, EXPERT_PARTS,
};
pub use crate::layout::LayoutKernels;
pub use crate::loss::LossKernels;
pub use crate::memory::host_store::{HostBlock, HostStore};
pub use crate::memory::Restore;
pub use crate::optim::OptimizerKernels;
pub use crate::pipeline::schedule::{Op, Role, Schedule, Slot, Span, Step, Stream};
pub use crate::router::{
    pick_backward_composed, pick_composed, scores_backward_composed, scores_composed,
    z_loss_backward_composed, z_loss_composed, ChoiceRead, DeviceChoice, PickRule, RouterKernels,
};
