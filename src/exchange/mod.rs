//! Step 4 of the forward recipe ([`MoeLayer::forward`](crate::MoeLayer::forward)): the exchange op (dispatch all-to-all → local experts → combine
//! all-to-all), in partitions, with memory reuse.
//!
//! [`MoeBackend`] is the backend contract; `fused` is its generic implementation for CPU
//! backends, `autodiff` records it as one backward node, and [`exchange_reference`] is the
//! same function built from ordinary differentiable tensor ops, which the tests hold the
//! fused op to.

mod adapter_scales;
pub(crate) mod arena;
mod assemble;
mod autodiff;
mod backend;
mod blocks;
#[cfg(feature = "cubecl")]
mod cubecl;
#[cfg(feature = "cubecl")]
mod cubecl_arena;
#[cfg(feature = "cubecl")]
mod cubecl_combine;
#[cfg(all(test, feature = "wgpu"))]
mod cubecl_combine_tests;
mod dense;
mod dense_heads;
mod direct;
pub(crate) use dense::dense;
pub(crate) mod executor;
mod expert_path;
mod ffn;
#[cfg(feature = "flex")]
mod flex_dot;
#[cfg(feature = "flex")]
mod flex_experts;
#[cfg(feature = "flex")]
mod flex_gemm;
#[cfg(feature = "flex")]
mod flex_gemv;
#[cfg(feature = "flex")]
mod flex_gemv_avx512;
#[cfg(feature = "flex")]
mod flex_heads;
#[cfg(feature = "flex")]
mod flex_rows;
pub(crate) mod fused;
#[cfg(feature = "fusion")]
pub(crate) mod fusion;
mod pass_store;
mod products;
mod reference;
mod row_moves;
pub(crate) mod rows;
mod shadows;
pub(crate) mod streams;
mod weighted_combine;

/// The schedule lives on the ground floor (`pipeline`), shared with `memory` and `sim`.
pub(crate) use crate::pipeline::schedule;

pub use arena::{buffer_of, ArenaCounters, ArenaStats, PartitionArena, SlotMemory};
pub use backend::{ExchangeGrads, ExchangeRun, MoeBackend};
pub use blocks::BlockLayout;
pub use expert_path::{
    ComposedExperts, ExpertBackward, ExpertBackwardOut, ExpertForward, ExpertGroups, ExpertPath,
    GemmPrecision,
};
pub use pass_store::PassStore;
pub use reference::exchange_reference;
pub use streams::{NoStreams, StepHold, SyncStreams, WorkerStreams};
pub(crate) use weighted_combine::row_weights;
pub use weighted_combine::{combine_weighted_backward_composed, combine_weighted_composed};
