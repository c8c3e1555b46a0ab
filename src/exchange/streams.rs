//! The device streams the threaded executor's workers issue on, and the fence between them.
//!
//! # The rule for tensors that cross streams
//!
//! A tensor written on a stream is created on that stream, or handed to another stream only
//! after an explicit fence: here a worker synchronises its stream after each step that a step
//! on another stream waits for, before the step counts as done, and before anything a step
//! read is let go (at the stream's next fence, for a step nothing else waits for). Nothing
//! relies on the runtime's own cross-stream bookkeeping, because in cubecl 0.10 that
//! bookkeeping keys a buffer to the stream that *allocated* it, at the cursor of its allocation
//! (`cubecl-runtime` `stream/event.rs`, `update_shared_bindings`: bindings whose `handle.stream`
//! is the current stream are skipped, and a stream that synced with the allocating stream once
//! after the allocation is never fenced again), so a write from another stream, or a later
//! write on the allocating one, is not waited for. On WGPU the same holds for its task
//! scheduler (`stream/scheduler.rs`, `align_streams` flushes only the streams the bindings were
//! allocated on).
//!
//! Memory has the same hazard in the other direction: a buffer goes back to the pool of the
//! stream that allocated it when its last handle drops (each cubecl-cuda stream owns its memory
//! management, `cubecl-cuda` `compute/stream.rs` `create_stream`), and that stream may hand it
//! out again at once while a kernel queued on another stream still reads it. So what a step
//! read is kept until its stream's fence ([`StepHold`]). The same holds for the caller after a
//! pass: what the exchange hands back (`T_O`, `dT_I`, the expert gradients) is allocated on the
//! calling thread's stream, because the caller drops it with its own reads still queued, and
//! the worker-allocated tensors the caller read to build it are let go only after a fence of
//! the caller's stream. (Two threads' streams can share a pool: ids map to streams modulo
//! `max_streams`. Seen on WGPU with two ranks before this: wrong expert gradients in about
//! half the runs.)

use std::any::Any;

use burn::tensor::backend::Backend;

use crate::error::{MoeError, Result};
use crate::pipeline::schedule::Stream;

/// What a step hands back to the executor: values its queued device work may still read. The
/// threaded executor drops them only after the step's stream is fenced; the in-order executor
/// at once, since one stream orders every read before any later reuse.
pub type StepHold = Vec<Box<dyn Any + Send>>;

/// The device streams of one rank, as the threaded executor's workers use them.
///
/// A backend hands one out per pass ([`MoeBackend::worker_streams`](crate::MoeBackend::worker_streams)),
/// built on the calling thread, so it can name the same device streams for every pass of every
/// layer that thread runs: a stream's memory pool is then reused rather than a new stream (and a
/// new pool) made per call.
pub trait WorkerStreams: Sync {
    /// Runs `work` on the calling thread with its device work issued on schedule stream
    /// `stream`'s device stream.
    fn run_on(&self, stream: Stream, work: &mut dyn FnMut() -> Result<()>) -> Result<()>;

    /// Blocks until the device has finished everything issued on the calling thread's stream.
    fn fence(&self) -> Result<()>;

    /// The runtime's id of the calling thread's current stream, where the backend has streams
    /// (for tests and traces); `None` on host backends.
    fn current_stream_id(&self) -> Option<u64> {
        None
    }
}

/// The streams of a backend without stream ids of its own: work runs on the worker's thread
/// as it is, and the fence is the backend's `sync` (a no-op on the CPU backends, which finish
/// each op on the calling thread).
#[derive(Debug)]
pub struct SyncStreams<B: Backend> {
    device: B::Device,
}

impl<B: Backend> SyncStreams<B> {
    /// The streams of `device`.
    pub fn new(device: &B::Device) -> Self {
        Self {
            device: device.clone(),
        }
    }
}

impl<B: Backend> WorkerStreams for SyncStreams<B> {
    fn run_on(&self, _stream: Stream, work: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        work()
    }

    fn fence(&self) -> Result<()> {
        fence::<B>(&self.device)
    }
}

/// `B::sync(device)` as the crate's error: waits for the calling thread's stream.
pub(crate) fn fence<B: Backend>(device: &B::Device) -> Result<()> {
    B::sync(device).map_err(|e| MoeError::Backend(format!("stream fence: {e:?}")))
}

/// Streams for the executor's own tests and for callers with no device: no fence, no ids.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoStreams;

impl WorkerStreams for NoStreams {
    fn run_on(&self, _stream: Stream, work: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        work()
    }

    fn fence(&self) -> Result<()> {
        Ok(())
    }
}
