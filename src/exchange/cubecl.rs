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

use std::sync::Arc;

use burn_cubecl::tensor::CubeTensor;

use super::arena::SlotMemory;
use super::cubecl_arena::CubeSlots;
use super::executor::StepExecutor;
use super::{ExchangeRun, MoeBackend};

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

    /// The arena's buffers on `like`'s device, for runs in issue order.
    ///
    /// The arena hands a buffer out again as soon as the host holds no tensor of it. On one
    /// stream that is safe, because the device runs the work in the order it was issued. With
    /// a stream per schedule stream (CUDA's threaded executor) the last reader of a buffer
    /// may still be queued on another stream, and cubecl 0.10 gives no event to wait for it
    /// before the next writer, so there the partitions come from cubecl's allocator as before.
    fn slot_memory(run: &ExchangeRun, like: &CubeTensor<R>) -> Option<Arc<dyn SlotMemory<Self>>> {
        let arena = run.arena.as_ref()?;
        if run.executor_for::<Self>(&like.device) != StepExecutor::InOrder {
            return None;
        }
        let key = format!(
            "{}/{:?}/{:?}",
            std::any::type_name::<Self>(),
            like.device,
            like.dtype
        );
        let slots = arena.entry(key, |counters| CubeSlots::<R>::new(like, counters));
        Some(slots)
    }
}
