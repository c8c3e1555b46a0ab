//! # mpipemoe
//!
//! Mixture-of-Experts layers for [burn](https://burn.dev) that train faster and in less
//! memory, after *MPipeMoE* (Zhang et al., IPDPS 2023): expert parallelism with an uneven
//! all-to-all, micro-batch pipelining of the exchange along the token dimension, adaptive
//! choice of the number of partitions, and partition-buffer reuse with activations restored
//! in backward by offloading, re-communication or recomputation.
//!
//! ```
//! use burn::backend::{Autodiff, NdArray};
//! use burn::tensor::Tensor;
//! use mpipemoe::{Activation, MemoryReuse, MoeLayerConfig, Partitions};
//!
//! type B = Autodiff<NdArray>;
//! let device = Default::default();
//! let layer = MoeLayerConfig::new(32, 64, 8, 2)
//!     .with_activation(Activation::SwiGlu)
//!     .with_partitions(Partitions::Fixed(2))
//!     .with_memory_reuse(MemoryReuse::S4)
//!     .with_aux_loss_coef(0.01)
//!     .init::<B>(&device);
//! let x = Tensor::<B, 3>::random([4, 16, 32], burn::tensor::Distribution::Default, &device);
//! let out = layer.forward(x);
//! let loss = out.output.powi_scalar(2).mean() + out.aux_loss;
//! let grads = loss.backward();
//! assert!(layer.experts.w_in.grad(&grads).is_some());
//! ```
//!
//! The crate is organised in rooms (see DESIGN.md): [`layer`](MoeLayer) (config, module,
//! forward), `router`, `dispatch` (plans), `experts`, `comm` (communicators), `exchange` (the
//! fused op and its reference twin), `memory` (strategies, host store), and `cases` (the
//! reference-case harness behind `mpipemoe check`).

#![warn(missing_docs)]

pub mod cases;
mod comm;
mod dispatch;
mod error;
mod exchange;
mod experts;
mod layer;
mod memory;
pub mod report;
mod router;
pub mod sim;
pub mod tuning;

pub use comm::{
    Communicator, GroupOptions, HostLoopback, LocalComm, LocalGroup, Payload, RankContext, SingleRank,
};
pub use dispatch::{
    build_plans, capacity_for, chunk_len, chunk_range, CapacityDecision, DispatchPlan, ExchangePlan,
    PartitionPlan, RoutingCounts, RoutingStats, SplitScheme,
};
pub use error::{MoeError, Result};
pub use exchange::{exchange_reference, ExchangeGrads, ExchangeRun, MoeBackend, Saved};
pub use experts::{seeded_uniform, Activation, ExpertTensors, Experts, SharedExpert};
pub use layer::{
    read_safetensors, ExchangePath, LayerMeta, MoeContext, MoeLayer, MoeLayerConfig, MoeOutput, MoeStats,
    ParamKind, Partitions, SharedMeta, TensorMap,
};
pub use memory::{
    measure_layer_memory, CountingAllocator, HostBlock, HostStore, ImplementationModel, ImplementationTerms,
    LayerShape, MemoryMeasurement, MemoryMeter, MemoryPlan, MemoryReport, MemoryReuse, PaperTerms, Restore,
    Strategy, Term,
};
pub use router::{load_balancing_loss, top_k_host, z_loss, Router, Routing};
