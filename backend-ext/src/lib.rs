//! # mpipemoe-cuda
//!
//! The CUDA half of mpipemoe (docs/design-notes.md, "CUDA"), behind the `cuda` feature so that the workspace
//! builds and tests on machines without a GPU or a CUDA toolkit.
//!
//! What is here:
//! - [`CudaMoe`]: burn's CUDA backend without fusion, on which `mpipemoe`'s layer runs (its
//!   `cubecl` feature implements `MoeBackend` for every CubeCL backend with the generic fused
//!   algorithm: same schedule and strategies as on the CPU, on burn's stream).
//! - [`cuda_available`]: a clear error instead of a panic on machines without a driver.
//! - [`Nccl`]: ranks over NCCL, as processes (torchrun's `RANK` / `WORLD_SIZE` / `LOCAL_RANK`,
//!   rank 0 handing out the NCCL id on `MASTER_ADDR` at `MPIPEMOE_RENDEZVOUS_PORT`, or
//!   `MASTER_PORT + 1` since torchrun's own store holds `MASTER_PORT`: [`bootstrap`]) or as
//!   threads of one process over its GPUs ([`Nccl::run_local`]). The layer's rows move by
//!   one NCCL group of `ncclSend` / `ncclRecv` on device pointers, posted by the same
//!   `mpipemoe::comm::post_all_to_all_v` the CPU twin is tested with; only counts pass
//!   through the host.
//! - The overlap: the layer's `MoeBackend` for CubeCL runs the schedule with a worker per
//!   stream on CUDA, each on a CUDA stream of its own (the same for every pass), fenced after
//!   every step by the executor (the rule in `mpipemoe`'s docs/design-notes.md, "Tensors that
//!   cross streams").
//! - [`nccl_available`]: whether NCCL can be loaded, so a caller runs its single-GPU work and
//!   reports NCCL as unavailable instead of cudarc panicking.
//! - [`CublasExperts`]: the experts' GEMMs on cuBLAS (batched where experts have the same
//!   rows, grouped otherwise, at the layer's
//!   `gemm_precision`: IEEE f32, TF32 or bf16) with their activations in fused kernels, on a
//!   stream of its own ordered against cubecl's without host waits; [`with_cublas`] adds it to
//!   a communicator's paths, and where the communicator has none of its own (thread ranks, one
//!   rank), the rows' all-to-all through host bytes and the S1–S3 offload with page-locked
//!   copies on a copy stream, off cubecl's device thread (`CublasExperts::adding_to`).
//! - [`Breakdown`]: where a timed cuBLAS path's sections spent their time, piece by piece
//!   (`CublasOptions::timed`, `CublasExperts::breakdown`), for the benchmark.
//! - [`Census`] and [`CallCounts`]: every CUDA driver and runtime call of the process counted
//!   through CUPTI's callbacks, by name and kind (host waits, launches, polls, frees), so the
//!   benchmark counts a step's host waits and launches instead of reading them from the code;
//!   with [`Spent`], the time each thread spent inside the driver's calls.
//! - [`group`]: the waits on NCCL (a group's end, a non-blocking initialisation, split or
//!   finalize), bounded by the timeout, aborting the communicator on every error path.
//! - [`check_plan`]: what `examples/gpu_check.rs` checks, single-GPU checks first.
//! - `examples/gpu_check.rs` and `examples/gpu_bench.rs`, run by `scripts/gpu/`.
//!
//! Everything here compiles in CI (`cargo clippy -p mpipemoe-cuda --features cuda`); the
//! posting logic, the TCP rendezvous and the GPU check's plan are tested on the CPU, and lent
//! H100 and H200 cards have run every reference case through the one-GPU paths (the cuBLAS
//! path, cubecl's, NCCL's rows in a one-rank group, the pinned offload). S1–S3 offload to
//! pinned host memory on a copy stream of the rank's own. Nothing with two or more GPUs has run.

#![warn(missing_docs)]

/// Whether this build has CUDA support compiled in.
pub const CUDA_COMPILED: bool = cfg!(feature = "cuda");

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod batches;
pub mod bootstrap;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod breakdown;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod calls;
#[cfg(feature = "cuda")]
mod census;
pub mod check_plan;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod gemm;
pub mod group;
#[cfg(feature = "cuda")]
mod host_rows;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(feature = "cuda")]
mod offload;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod payload;
#[cfg(feature = "cuda")]
mod rows;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod spans;

pub use breakdown::{Breakdown, PieceTime};
pub use calls::{CallCounts, CallKind, Spent};
#[cfg(feature = "cuda")]
pub use census::Census;
#[cfg(feature = "cuda")]
pub use driver::{cuda_available, nccl_available, CudaError};
#[cfg(feature = "cuda")]
pub use gemm::{with_cublas, CublasCalls, CublasExperts, CublasOptions, Handover};
#[cfg(feature = "cuda")]
pub use nccl::Nccl;

/// burn's CUDA backend without fusion (the extension trait is implemented for it directly),
/// with float element `F`.
#[cfg(feature = "cuda")]
pub type CudaMoe<F = f32> = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, F, i32, u8>;

/// burn's default CUDA backend: fusion around [`CudaMoe`]. The layer's exchange and the cuBLAS
/// path run on the inner backend (their inputs resolved, their outputs registered back).
#[cfg(feature = "cuda")]
pub type CudaMoeFusion<F = f32> = burn_fusion::Fusion<CudaMoe<F>>;
