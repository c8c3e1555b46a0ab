//! `MoeBackend` for burn's CubeCL backends (CUDA, ROCm, WGPU), with the generic fused
//! algorithm.
//!
//! This is the correctness path on a GPU: the same schedule and strategies as on the CPU,
//! with plans on the host and offloads as real device → host → device copies. On CUDA the
//! schedule's streams run on threads of their own, which cubecl maps to CUDA streams of their
//! own (see `step_executor`); the `mpipemoe-cuda` crate adds the NCCL path for the rows.

use burn::tensor::backend::DeviceOps;
use burn_cubecl::cubecl::server::ComputeServer;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use super::executor::StepExecutor;
use super::MoeBackend;

impl<R, F, I, BT> MoeBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    R::Server: ComputeServer,
    R::Device: DeviceOps,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    super::backend::fused_exchange!();

    /// A worker per stream on CUDA, in issue order elsewhere.
    ///
    /// cubecl gives each OS thread its own stream. cubecl-cuda keeps them in a `MultiStream`
    /// that fences a binding written on one stream before another stream uses it (an event
    /// recorded on the writer, waited on by the reader), so there the threaded executor is the
    /// overlap of S, C and R. WGPU's scheduler does not fence across streams: measured on
    /// Mesa's software Vulkan driver, with a thread per stream every case fails at n = 3, in
    /// order all pass. Other runtimes (ROCm) run in order until measured.
    fn step_executor(device: &R::Device) -> StepExecutor {
        StepExecutor::for_cubecl_runtime(R::name(&R::client(device)))
    }
}
