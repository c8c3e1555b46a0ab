//! # mpipemoe-cuda
//!
//! The CUDA half of mpipemoe: `MoeBackend` for burn's CUDA backend with the exchange op's
//! dispatch, expert GEMMs and combine on streams of its own (DESIGN §6). Everything lives behind
//! the `cuda` feature, so that the workspace builds and tests on machines without a GPU or a
//! CUDA toolkit.
//!
//! Without the feature this crate only reports that CUDA support was not compiled in.

#![warn(missing_docs)]

/// Whether this build has CUDA support compiled in.
pub const CUDA_COMPILED: bool = cfg!(feature = "cuda");

#[cfg(feature = "cuda")]
mod driver;

#[cfg(feature = "cuda")]
pub use driver::{cuda_available, CudaError};
