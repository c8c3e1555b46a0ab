//! `MoeBackend` for burn's CubeCL backends (CUDA, ROCm, WGPU), with the generic fused
//! algorithm.
//!
//! This is the correctness path on a GPU: the same schedule and strategies as on the CPU,
//! with plans on the host, offloads as real device → host → device copies, and every step on
//! burn's own stream. Overlapping S, C and R on streams of their own (docs/design-notes.md, "CUDA") belongs in
//! the `mpipemoe-cuda` crate and is not done yet.

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

    /// In issue order: cubecl gives each OS thread its own stream, and on WGPU a tensor that
    /// one thread's stream writes is not fenced against another thread's stream reading it.
    /// Measured on Mesa's software Vulkan driver: with a thread per stream, every case fails
    /// at n = 3; in order, all pass. Overlap on CUDA streams is the `mpipemoe-cuda` crate's work.
    fn step_executor() -> StepExecutor {
        StepExecutor::InOrder
    }
}
