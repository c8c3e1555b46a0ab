//! The executors of a [`Schedule`]: in issue order on the calling thread, or one worker thread
//! per stream, each running its steps in issue order and waiting, before each, for the steps on
//! other streams it depends on.
//!
//! On the CPU the streams share the cores, so the threaded executor buys no speed (the CPU
//! backends run in order by default); what it gives is the GPU's concurrency, exercised by the
//! CPU tests that select it: a step of one partition really runs while steps of other
//! partitions run on the other streams, so a missing dependency shows up as a wrong result or a
//! detected hazard here rather than on a GPU.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use super::schedule::{Schedule, Span, Step, Stream};
use super::streams::{NoStreams, StepHold, WorkerStreams};
use crate::error::{MoeError, Result};

/// How the generic fused exchange runs a schedule's steps on a backend.
///
/// Each backend has a default ([`MoeBackend::step_executor`](crate::MoeBackend::step_executor));
/// `MoeLayerConfig::executor` overrides it, which is how tests run the threaded executor on
/// the CPU and how a regression on a device has a way back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StepExecutor {
    /// A thread per stream (the calling thread takes the compute stream), with real waits
    /// between streams ([`execute`]): for backends
    /// whose streams run concurrently, and on the CPU backends (which finish each op on the
    /// calling thread) to exercise that concurrency in tests.
    StreamThreads,
    /// Every step on the calling thread, in issue order ([`execute_in_order`]): right for
    /// asynchronous device backends whose per-thread queues are not ordered against each
    /// other. cubecl gives each OS thread its own stream; on WGPU a tensor written on one
    /// thread's stream and read on another's is not fenced, so the threaded executor would
    /// read rows that are not written yet.
    InOrder,
}

impl StepExecutor {
    /// The executor for a CubeCL runtime, by the name cubecl gives it (`Runtime::name`): a
    /// worker per stream on CUDA, where the streams run concurrently; in issue order on every
    /// other runtime (WGPU submits every stream to one queue; ROCm is not measured yet).
    /// Correctness on CUDA rests on the executor's own fences, after every step another stream
    /// waits for ([`execute_on`]), not on cubecl's cross-stream events, which key a buffer to
    /// the stream that allocated it (`exchange/streams.rs`).
    pub fn for_cubecl_runtime(name: &str) -> Self {
        if name == "cuda" {
            StepExecutor::StreamThreads
        } else {
            StepExecutor::InOrder
        }
    }

    /// Runs `schedule` with this executor.
    pub fn run(
        self,
        schedule: &Schedule,
        run: &(dyn Fn(usize, &Step) -> Result<()> + Sync),
    ) -> Result<Vec<Span>> {
        self.run_on(&NoStreams, schedule, &|index, step| {
            run(index, step).map(|()| StepHold::new())
        })
    }

    /// Runs `schedule` with this executor on `streams`: the threaded executor runs each
    /// schedule stream's worker on its device stream and fences the steps other streams wait
    /// for (see [`execute_on`]); in order, every step runs on the calling thread's stream and
    /// what it holds is dropped at once.
    pub fn run_on(
        self,
        streams: &dyn WorkerStreams,
        schedule: &Schedule,
        run: &(dyn Fn(usize, &Step) -> Result<StepHold> + Sync),
    ) -> Result<Vec<Span>> {
        match self {
            StepExecutor::StreamThreads => execute_on(streams, schedule, run),
            StepExecutor::InOrder => execute_in_order(schedule, &|index, step| run(index, step).map(drop)),
        }
    }
}

/// Runs every step of `schedule` on the calling thread in issue order, which respects every
/// dependency (a step only depends on steps issued before it). Stops at the first error.
pub fn execute_in_order(
    schedule: &Schedule,
    run: &(dyn Fn(usize, &Step) -> Result<()> + Sync),
) -> Result<Vec<Span>> {
    let mut spans = Vec::with_capacity(schedule.steps.len());
    for (index, step) in schedule.steps.iter().enumerate() {
        debug_assert!(
            step.deps.iter().all(|&d| d < index),
            "a step depends on a later step"
        );
        let start = 2 * index as u64;
        catch_unwind(AssertUnwindSafe(|| run(index, step)))
            .unwrap_or_else(|payload| Err(panic_error(payload, step)))?;
        spans.push(Span {
            start,
            end: start + 1,
        });
    }
    Ok(spans)
}

#[derive(Debug)]
struct Progress {
    done: Vec<bool>,
    failed: bool,
}

/// Runs every step of `schedule` with `run`, each stream on a thread of its own (the compute
/// stream on the calling thread), and returns when all have finished, with the span of every
/// step. The first error (or panic) of any step
/// stops the other workers at their next wait and is returned. No device streams: see
/// [`execute_on`].
pub fn execute(schedule: &Schedule, run: &(dyn Fn(usize, &Step) -> Result<()> + Sync)) -> Result<Vec<Span>> {
    execute_on(&NoStreams, schedule, &|index, step| {
        run(index, step).map(|()| StepHold::new())
    })
}

/// [`execute`] on device streams: each worker issues on its schedule stream's device stream
/// ([`WorkerStreams::run_on`]). After a step that a step on another stream waits for (a
/// dependency of some step: the schedule's dependencies are those across streams), the worker
/// fences its stream before the step counts as done, so the waiting step reads finished
/// writes. What a step returned ([`StepHold`]) is dropped only after a fence of its stream, so
/// no buffer it read goes back to a pool while its kernels may still read it: at once for an
/// awaited step, at the stream's next fence for the others. The calling thread's stream is
/// fenced before the workers start (they read what it wrote), and a worker fences its stream
/// once more when it ends if anything was issued after its last fence, on success or error,
/// so nothing a pass issued is still running when this returns. The rule behind it is in
/// [`WorkerStreams`]' module docs (`exchange/streams.rs`).
///
/// A step nothing on another stream waits for is the last use of its stream's work in the
/// pass or is followed on its stream by one that is fenced, so its fence would be a host wait
/// that orders nothing; in the S → C → R schedules those are the combines of the last two
/// partitions (their outputs go to the caller, whose read the end fence orders), and the end
/// fence of a worker whose last step was fenced is one too. Skipping them takes the host waits
/// of a forward at n = 2 from 9 to 6 (`tests/schedule.rs` counts them).
///
/// The entry fence covers the calling thread's stream only: what the workers read must have
/// no writes pending on any other thread's stream (the precondition of
/// [`MoeBackend::exchange_forward`](crate::MoeBackend::exchange_forward)).
pub fn execute_on(
    streams: &dyn WorkerStreams,
    schedule: &Schedule,
    run: &(dyn Fn(usize, &Step) -> Result<StepHold> + Sync),
) -> Result<Vec<Span>> {
    let n = schedule.steps.len();
    let progress = Mutex::new(Progress {
        done: vec![false; n],
        failed: false,
    });
    let wake = Condvar::new();
    let clock = AtomicU64::new(0);
    let spans: Mutex<Vec<Span>> = Mutex::new(vec![Span { start: 0, end: 0 }; n]);
    let enter_worker = inherit_allocation_tag();
    // The steps some step on another stream waits for: each is fenced before it counts as done.
    let mut awaited = vec![false; n];
    for &d in schedule.steps.iter().flat_map(|step| &step.deps) {
        awaited[d] = true;
    }
    // The workers read what the calling thread's stream wrote (T_I, the experts, dT_O).
    streams.fence()?;

    let steps = |stream: Stream, unfenced: &mut Unfenced| -> Result<()> {
        for index in schedule.stream_order(stream) {
            let step = &schedule.steps[index];
            {
                let mut p = lock_progress(&progress);
                while !p.failed && !step.deps.iter().all(|&d| p.done[d]) {
                    p = wake.wait(p).unwrap_or_else(|e| e.into_inner());
                }
                if p.failed {
                    return Ok(());
                }
            }
            let start = clock.fetch_add(1, Ordering::SeqCst);
            unfenced.issued = true;
            let result = catch_unwind(AssertUnwindSafe(|| run(index, step)))
                .unwrap_or_else(|payload| Err(panic_error(payload, step)))
                .and_then(|hold| {
                    unfenced.holds.push(hold);
                    // An awaited step's writes are finished before a step on another stream
                    // may read them; every read before it, on this stream, is finished before
                    // what those steps held may be reused.
                    match awaited[index] {
                        true => unfenced.fence(streams),
                        false => Ok(()),
                    }
                });
            let end = clock.fetch_add(1, Ordering::SeqCst);
            crate::sync::lock(&spans)[index] = Span { start, end };
            let mut p = lock_progress(&progress);
            match result {
                Ok(()) => p.done[index] = true,
                Err(e) => {
                    p.failed = true;
                    wake.notify_all();
                    return Err(e);
                }
            }
            wake.notify_all();
        }
        Ok(())
    };
    let worker = |stream: Stream| -> Result<()> {
        enter_worker();
        streams.run_on(stream, &mut || {
            let mut unfenced = Unfenced::default();
            let outcome = steps(stream, &mut unfenced);
            // Whatever happened, nothing this worker issued may still run after the pass.
            let fenced = match unfenced.issued {
                true => unfenced.fence(streams),
                false => Ok(()),
            };
            outcome.and(fenced)
        })
    };

    let streams: Vec<Stream> = Stream::ALL
        .into_iter()
        .filter(|&s| schedule.steps.iter().any(|step| step.stream() == s))
        .collect();
    // The compute stream's worker is the calling thread, which would otherwise wait in the
    // join: one thread fewer to start each pass, and the experts computed where the caller
    // computes everything else (on the CPU, its thread pool, whose threads keep gemm's
    // packing buffers between passes: a worker started for each pass made its own, an
    // allocation of about an L2 cache a pass that held for the pass, `tests/memory.rs`).
    let (inline, spawned): (Vec<Stream>, Vec<Stream>) = streams.iter().partition(|&&s| s == Stream::Compute);
    let results: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = spawned
            .iter()
            .map(|&s| {
                std::thread::Builder::new()
                    .name(format!("moe-{s:?}").to_lowercase())
                    .spawn_scoped(scope, move || worker(s))
            })
            .collect();
        if handles.iter().any(|h| h.is_err()) {
            // The started workers may wait for steps of the missing one: stop them.
            lock_progress(&progress).failed = true;
            wake.notify_all();
        }
        // A panic here outside a step (the steps' own are caught) would leave the scope
        // waiting for workers that wait for this stream: stop them first.
        let own = inline.iter().map(|&s| {
            catch_unwind(AssertUnwindSafe(|| worker(s))).unwrap_or_else(|_| {
                lock_progress(&progress).failed = true;
                wake.notify_all();
                Err(MoeError::Backend("the exchange's compute stream panicked".into()))
            })
        });
        let own: Vec<Result<()>> = own.collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(MoeError::Backend(
                        "a stream worker of the exchange panicked".into(),
                    ))
                }),
                Err(e) => Err(MoeError::Backend(format!("cannot start a stream worker: {e}"))),
            })
            .chain(own)
            .collect()
    });
    // A root cause over a peer's echo, as LocalGroup does.
    let mut errors: Vec<MoeError> = results.into_iter().filter_map(|r| r.err()).collect();
    if let Some(pos) = errors.iter().position(|e| !e.is_peer_failure()) {
        return Err(errors.swap_remove(pos));
    }
    if let Some(e) = errors.pop() {
        return Err(e);
    }
    Ok(crate::sync::into_inner(spans))
}

/// A worker's steps since its stream's last fence: whether any ran, and what they held.
#[derive(Default)]
struct Unfenced {
    issued: bool,
    holds: Vec<StepHold>,
}

impl Unfenced {
    /// Fences the calling thread's stream, then lets go of what the steps before it held.
    fn fence(&mut self, streams: &dyn WorkerStreams) -> Result<()> {
        streams.fence()?;
        self.issued = false;
        self.holds.clear();
        Ok(())
    }
}

/// What a stream worker runs first: with the test kit, it takes over the counting
/// allocator's tag of the thread that started the exchange, so that the worker's allocations
/// count against that rank (the kit's `CountingAllocator` measures each rank's own peak with
/// ranks as threads). Without the test kit there is no tag and the
/// hook does nothing.
fn inherit_allocation_tag() -> impl Fn() + Sync {
    #[cfg(feature = "testkit")]
    {
        use crate::memory::alloc::CountingAllocator;
        let tag = CountingAllocator::thread_tag();
        move || CountingAllocator::set_thread_tag(tag)
    }
    #[cfg(not(feature = "testkit"))]
    {
        || {}
    }
}

/// A panic inside a step: the [`MoeError`] it carries (a collective that failed in a
/// backward), or its message.
fn panic_error(payload: Box<dyn std::any::Any + Send>, step: &Step) -> MoeError {
    match payload.downcast::<MoeError>() {
        Ok(e) => *e,
        Err(payload) => {
            let message = crate::sync::panic_message(payload.as_ref());
            MoeError::Backend(format!("exchange step {:?} panicked: {message}", step.op))
        }
    }
}

fn lock_progress(m: &Mutex<Progress>) -> std::sync::MutexGuard<'_, Progress> {
    crate::sync::lock(m)
}
