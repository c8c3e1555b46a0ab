//! `MoeBackend` for burn's CubeCL backends (CUDA, ROCm, WGPU), with the generic fused
//! algorithm.
//!
//! This is the correctness path on a GPU: the same schedule and strategies as on the CPU,
//! with plans on the host and offloads as real device → host → device copies. On CUDA the
//! schedule's streams run on threads of their own, which cubecl maps to CUDA streams of their
//! own (see `step_executor`); the `mpipemoe-cuda` crate adds the NCCL path for the rows.

use burn::tensor::backend::{Backend, DeviceOps};
use burn_cubecl::cubecl::server::ComputeServer;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

use std::sync::Arc;

use burn_cubecl::tensor::CubeTensor;

use super::arena::SlotMemory;
use super::cubecl_arena::CubeSlots;
use super::executor::StepExecutor;
use super::streams::{fence, WorkerStreams};
use super::{ExchangeRun, MoeBackend};
use crate::dispatch::{CombineMap, RowMap};
use crate::error::Result;
use crate::pipeline::schedule::Stream;
use burn_cubecl::cubecl::stream_id::StreamId;

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
    /// On CUDA each schedule stream is a CUDA stream of its own (`CubeStreams`), so the
    /// threaded executor is the overlap of S, C and R; the executor itself fences the steps
    /// another stream waits for (cubecl's own cross-stream fences key a buffer to the stream
    /// that allocated it; see `exchange/streams.rs`). WGPU submits every stream to one queue, so threads buy no
    /// overlap there; they are correct there too (the tests run every case through them), and
    /// a config can ask for them. Other runtimes (ROCm) run in order until measured.
    fn step_executor(device: &R::Device) -> StepExecutor {
        StepExecutor::for_cubecl_runtime(R::name(&R::client(device)))
    }

    /// A device stream per schedule stream, derived from the calling thread's stream id (see
    /// `CubeStreams`), fenced with the stream's `sync`.
    fn worker_streams(device: &R::Device) -> Box<dyn WorkerStreams> {
        Box::new(CubeStreams::<Self>::new(device))
    }

    /// Yes: every op launches a kernel, a zero-element one with an empty grid.
    fn issues_kernels() -> bool {
        true
    }

    /// One kernel that sums each target's rows (`exchange/cubecl_combine.rs`); burn's
    /// `select_assign` where the kernel does not read the tensor or there is nothing to sum.
    fn combine_rows(rows: CubeTensor<R>, map: &Arc<RowMap>) -> CubeTensor<R> {
        match super::cubecl_combine::combine(&rows, map) {
            Some(out) => out,
            None => super::row_moves::add_rows::<Self>(rows, map),
        }
    }

    /// One kernel (`exchange/cubecl_combine.rs`); composed where it does not read the
    /// tensors or there is nothing to sum.
    fn combine_weighted(rows: CubeTensor<R>, weights: CubeTensor<R>, map: &Arc<CombineMap>) -> CubeTensor<R> {
        match super::cubecl_combine::combine_weighted(&rows, &weights, map) {
            Some(out) => out,
            None => super::weighted_combine::combine_weighted_composed::<Self>(rows, weights, map),
        }
    }

    /// One kernel for both gradients (`exchange/cubecl_combine.rs`); composed where it does
    /// not read the tensors or there is nothing to sum.
    fn combine_weighted_backward(
        grad: CubeTensor<R>,
        rows: CubeTensor<R>,
        weights: CubeTensor<R>,
        map: &Arc<CombineMap>,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        match super::cubecl_combine::combine_weighted_backward(&grad, &rows, &weights, map) {
            Some(grads) => grads,
            None => {
                super::weighted_combine::combine_weighted_backward_composed::<Self>(grad, rows, weights, map)
            }
        }
    }

    fn allocated_on_current_stream(tensor: &CubeTensor<R>) -> bool {
        tensor.handle.stream == StreamId::current()
    }

    /// The arena's buffers on `like`'s device, for runs in issue order.
    ///
    /// The arena hands a buffer out again as soon as the host holds no tensor of it, and only
    /// to the thread that last had it. On one stream that is safe, because the device runs the
    /// work in the order it was issued. With a stream per schedule stream (the threaded
    /// executor) a slot's buffer is written on one worker's stream and read on another's by
    /// design, so there the partitions come from cubecl's allocator, fenced by the executor
    /// (`exchange/streams.rs`).
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

/// The device streams of the threads that run passes: for a calling thread with cubecl stream
/// id `c`, schedule stream `k` (comm, compute, copy) issues on stream id
/// `2^48 + 4·c + k`, the same for every pass and every layer that thread runs.
///
/// Ids come from the thread: cubecl gives each new OS thread a new id from a global counter
/// (`cubecl-common` `stream_id.rs`, `from_current_thread`) and keeps a stream, with its own
/// memory pools, per id modulo `max_streams` (`cubecl-runtime` `stream/base.rs`,
/// `stream_index`); workers spawned per call would each get a new stream and a cold pool, up
/// to `max_streams` of them. A worker enters its id with cubecl's public
/// `StreamId::executes`. The offset keeps these ids apart from every thread's own (the
/// counter would need 2^48 threads to reach it); ids of different callers may share a device
/// stream modulo `max_streams`, which orders their work more than needed but never less.
pub struct CubeStreams<B: Backend> {
    device: B::Device,
    caller: StreamId,
}

impl<B: Backend> CubeStreams<B> {
    /// The worker streams of the calling thread on `device`.
    pub fn new(device: &B::Device) -> Self {
        Self {
            device: device.clone(),
            caller: StreamId::current(),
        }
    }

    /// The cubecl stream id of schedule stream `stream` for this caller.
    pub fn stream_id(&self, stream: Stream) -> StreamId {
        let k = match stream {
            Stream::Comm => 0,
            Stream::Compute => 1,
            Stream::Copy => 2,
        };
        StreamId {
            value: (1 << 48) + 4 * self.caller.value + k,
        }
    }
}

impl<B: Backend> WorkerStreams for CubeStreams<B> {
    fn run_on(&self, stream: Stream, work: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.stream_id(stream).executes(work)
    }

    /// `sync` of the calling thread's stream: on CUDA an event recorded on the stream and
    /// waited for on the host (`cubecl-cuda` `compute/command.rs`, `sync`); on WGPU the
    /// stream's queued tasks submitted and waited for (`cubecl-wgpu` `compute/server.rs`,
    /// `sync`).
    fn fence(&self) -> Result<()> {
        fence::<B>(&self.device)
    }

    fn current_stream_id(&self) -> Option<u64> {
        Some(StreamId::current().value)
    }
}
