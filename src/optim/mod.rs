//! Optimizers whose update runs in one pass over each parameter.
//!
//! burn's AdamW updates a parameter with about fifteen element-wise tensor ops, each reading
//! and writing a tensor the parameter's size; on the CPU backends each op also allocates its
//! output and runs on one thread. On a 163 M-parameter model that step took 1.35 s of a 3.9 s
//! fine-tuning step (BENCHMARKS.md §13). [`AdamW`] computes the same update, with the same
//! state record as burn's (`burn::optim::AdamWState`), through a backend kernel
//! ([`OptimizerKernels::adamw_update`]): one parallel pass in place on Flex, and on every other
//! backend the composed ops (which burn's fusion fuses on the GPU backends).

mod adamw;
#[cfg(feature = "cubecl")]
mod cubecl_adamw;
#[cfg(feature = "flex")]
mod flex_adamw;
mod kernels;

pub use adamw::{AdamW, AdamWConfig};
pub use kernels::{adamw_update_composed, AdamWCoefficients, AdamWTensors, OptimizerKernels};
