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
//! - [`Nccl`]: multi-process ranks over NCCL (torchrun-style environment, file rendezvous).
//! - `examples/gpu_check.rs` and `examples/gpu_bench.rs`, run by `scripts/gpu/`.
//!
//! Not done yet: the exchange op on streams of its own (cuBLAS GEMMs, NCCL all-to-all on
//! device pointers, pinned-memory offload, ordered by events) that overlaps S, C and R. It
//! needs a GPU to write and test.

#![warn(missing_docs)]

/// Whether this build has CUDA support compiled in.
pub const CUDA_COMPILED: bool = cfg!(feature = "cuda");

#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod nccl;

#[cfg(feature = "cuda")]
pub use driver::{cuda_available, CudaError};
#[cfg(feature = "cuda")]
pub use nccl::Nccl;

/// burn's CUDA backend without fusion (the extension trait is implemented for it directly),
/// with float element `F`.
#[cfg(feature = "cuda")]
pub type CudaMoe<F = f32> = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, F, i32, u8>;
