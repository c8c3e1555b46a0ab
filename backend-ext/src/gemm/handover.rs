//! Handing a partition's work from the calling thread's cubecl stream to a lane's own CUDA
//! stream and back, without the host waiting for either.
//!
//! cubecl 0.10 does not expose its `CUstream` (cubecl-cuda `compute/stream.rs`: the streams are
//! private fields of the server, created `NonBlocking`, so the legacy default stream does not
//! order them either), so no CUDA event can be recorded on it or waited for on it. Four words
//! in a cubecl buffer stand in for the events, each written by a one-thread kernel on one side
//! and awaited by a one-thread kernel on the other:
//!
//! - in: a cubecl kernel stores `seq` into word 0 once everything queued before it on the
//!   cubecl stream is done; the first kernel of the lane's section (`wait_flag`, compiled with
//!   the path's kernels) spins until it reads `seq` there;
//! - out: the lane's last kernel (`set_flag`) stores `seq` into word 1 after its work; a cubecl
//!   kernel spins on that word, so every later cubecl op waits for it.
//!
//! Every spin reads memory on each turn (an atomic read: `atomicAdd(p, 0)`, in cubecl-cpp 0.10
//! `dialect.rs` `compile_atomic_load` as in `kernels.cu`). CUDA's stream memory operations
//! (`cuStreamWaitValue32`) would spare the lane's spin, but on the first H100 run (driver 580,
//! CUDA 13.0) every call on a cubecl buffer returned `CUDA_ERROR_INVALID_VALUE`; those buffers
//! come from the stream-ordered pool (`cuMemAllocAsync`, cubecl-cuda `compute/storage/gpu.rs`),
//! which is the likely reason but was not isolated, and a buffer of the lane's own could not be
//! handed to a cubecl kernel.
//!
//! Order of issue matters where two streams share one of the device's hardware queues (CUDA
//! multiplexes streams onto `CUDA_DEVICE_MAX_CONNECTIONS` of them, 8 by default): the signal
//! kernel is issued to the driver before the lane's spin, and cubecl's spin after the lane's
//! store, so every wait in issue order waits only for something issued before it. A section
//! runs on cubecl's device thread (`CublasExperts::on_device_thread`), where a client call runs
//! inline: the signal's launch has reached the driver when it returns (see [`Flags::enter`]).
//!
//! Each spin is bounded: after [`SPIN_BOUND`] turns (minutes) it marks word 2 (cubecl's side) or
//! word 3 (the lane's) and lets its stream go, so a failure of the device between two kernels
//! cannot hang the process ([`Flags::gave_up`] reads the marks); [`Handover::Host`] is the plain
//! form, a host wait on each side.

use burn_cubecl::cubecl;
use cubecl::client::ComputeClient;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cudarc::driver::CudaStream;
use mpipemoe::{MoeError, Result};

use super::kernels::Kernels;

/// How a lane's stream is ordered against the calling thread's cubecl stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Handover {
    /// Flag words written and waited for on the device (module docs): no host wait.
    #[default]
    Device,
    /// The host waits for the cubecl stream before the lane's work (`client.sync`) and for the
    /// lane's stream after it: two host waits per partition step.
    Host,
}

/// Turns of the spinning kernel before it gives up (about a microsecond each: minutes).
pub(crate) const SPIN_BOUND: u32 = 1 << 28;

#[cube(launch_unchecked)]
fn signal_kernel(flags: &mut Array<Atomic<u32>>, seq: u32) {
    if ABSOLUTE_POS == 0 {
        flags[0].store(seq);
    }
}

#[cube(launch_unchecked)]
fn wait_kernel(flags: &mut Array<Atomic<u32>>, seq: u32, bound: u32) {
    if ABSOLUTE_POS == 0 {
        let mut turns = 0u32;
        loop {
            if flags[1].load() == seq {
                break;
            }
            turns += 1;
            if turns >= bound {
                flags[2].store(seq);
                break;
            }
        }
    }
}

fn err(what: &str, e: impl std::fmt::Debug) -> MoeError {
    MoeError::Backend(format!("CUDA expert path, hand-over: {what}: {e:?}"))
}

/// A lane's flag words in a cubecl buffer (`[signal, done, cubecl gave up, lane gave up]`), and
/// the sequence number of its last section.
#[derive(Debug)]
pub(crate) struct Flags {
    handle: Handle,
    ptr: u64,
    seq: u32,
}

impl Flags {
    /// Four zeroed words on the calling thread's cubecl stream.
    pub(crate) fn new(client: &ComputeClient<CudaRuntime>) -> Result<Self> {
        let handle = client.create_from_slice(u32::as_bytes(&[0u32; 4]));
        let resource = client
            .get_resource(handle.clone())
            .map_err(|e| err("flag words", e))?;
        let ptr = resource.resource().ptr;
        Ok(Self { handle, ptr, seq: 0 })
    }

    /// The flag words as a cubecl kernel argument.
    fn arg(&self) -> ArrayArg<CudaRuntime> {
        // SAFETY: the buffer holds four u32 words and the kernels touch words 0 to 2.
        unsafe { ArrayArg::from_raw_parts(self.handle.clone(), 4) }
    }

    /// The in-half: every op queued on the cubecl stream so far completes before the lane's
    /// stream runs on. Returns the section's number.
    pub(crate) fn enter(
        &mut self,
        client: &ComputeClient<CudaRuntime>,
        lane: &CudaStream,
        kernels: &Kernels,
    ) -> Result<u32> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        // SAFETY: one unit stores one word of the four-word buffer.
        unsafe {
            signal_kernel::launch_unchecked(
                client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                self.arg(),
                seq,
            )
        };
        // The signal is in the driver's queue already, so the lane's wait below is issued after
        // it (module docs): a section runs on cubecl's device thread, where a launch runs
        // inline (cubecl-runtime 0.10 `client.rs` `launch_inner` → `device.submit`, which
        // cubecl-common 0.10 `device/handle/channel.rs` `send` runs at once on the runner
        // thread) and calls `cuLaunchKernel` before returning (cubecl-cuda 0.10
        // `compute/context.rs` `execute_task`).
        //
        // No `client.flush()` here, as there was before sections ran on the device thread. In
        // cubecl-cuda 0.10 a flush (`compute/server.rs` `flush`) rotates the stream's drop
        // queue, and `PendingDropQueue::flush` (cubecl-runtime `memory_management/drop_queue/
        // queue.rs`) first synchronises the fence of the previous flush on the host
        // (`cuEventSynchronize`, `compute/sync/fence.rs` `wait_sync`). That was a host wait in
        // every section, for the device to reach the previous section's start: the host could
        // never run more than one section ahead of the device.
        kernels.wait_flag(lane, self.ptr, seq, SPIN_BOUND, self.ptr + 12)?;
        Ok(seq)
    }

    /// The out-half: every later op on the cubecl stream waits for the lane's work so far.
    /// When the lane's store cannot be queued, no spinning kernel is launched either.
    pub(crate) fn leave(
        &self,
        client: &ComputeClient<CudaRuntime>,
        lane: &CudaStream,
        kernels: &Kernels,
        seq: u32,
    ) -> Result<()> {
        kernels.set_flag(lane, self.ptr + 4, seq)?;
        // SAFETY: one unit reads word 1 and may store word 2 of the four-word buffer; it ends
        // after at most `SPIN_BOUND` turns.
        unsafe {
            wait_kernel::launch_unchecked(
                client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(1),
                self.arg(),
                seq,
                SPIN_BOUND,
            )
        };
        Ok(())
    }

    /// The section whose spin gave up waiting, if one did, on either side (a host read: only
    /// for checks).
    pub(crate) fn gave_up(&self, client: &ComputeClient<CudaRuntime>) -> Result<Option<u32>> {
        let bytes = client
            .read_one(self.handle.clone())
            .map_err(|e| err("read the flag words", e))?;
        let words = u32::from_bytes(&bytes);
        Ok(words[2..4].iter().copied().find(|&w| w != 0))
    }
}
