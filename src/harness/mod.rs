//! Not part of the API: the reference-case harness and the memory instrumentation that the
//! `mpipemoe` command-line tool, the tests and the benchmarks share. Nothing here is covered by
//! semantic versioning.

mod choice;
#[cfg(feature = "cubecl")]
mod device_memory;
mod host_plan;
mod kernels;
mod memory;
mod runner_wake;
mod synthetic;

pub use crate::cases::{
    agreement_error, check_case, check_case_through, expected, relative_error, Case, CheckOptions,
    CheckReport, TensorError,
};
pub use crate::memory::alloc::CountingAllocator;
pub use crate::router::topk::{all_finite, group_limited_top_k, group_limited_top_k_reference};
#[cfg(feature = "cubecl")]
pub use device_memory::{DeviceMemoryMeter, DeviceSample};
pub use host_plan::{plan_on_host, BENCH_ROUTERS};
pub use kernels::{kernel_checks, KernelCheck};
pub use memory::{
    measure_layer_memory, measure_layer_memory_with, measure_layer_peak, MemoryMeasurement, PeakMeter,
    RankMemory, TokenSource, WrapComm,
};
pub use runner_wake::{process_cpu_s, quantile, runner_wake_latencies, RunnerKeeper};
pub use synthetic::{write_synthetic_checkpoint, SyntheticCheckpoint, SyntheticFamily};
