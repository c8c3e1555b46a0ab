//! The layer's peak device memory on a CubeCL backend, read from cubecl's device allocator.
//!
//! cubecl's memory manager keeps, per stream, the bytes its live allocations hold
//! (`MemoryUsage::bytes_in_use`) and the bytes it has reserved from the device
//! (`bytes_reserved`), and answers `ComputeClient::memory_usage` for the stream the client is
//! set to (cubecl-runtime 0.10 `client.rs` `memory_usage`; cubecl-cuda 0.10
//! `compute/command.rs` `memory_usage` reads the current stream's `memory_management_gpu`). It
//! keeps no peak. So the meter samples: from [`PeakMeter::start`] to [`PeakMeter::peak`] a
//! thread of its own asks for the rank's stream's usage again as soon as each answer comes,
//! and keeps the most bytes in use it saw, and the most reserved.
//!
//! Each request is served by the device's server between the rank's own requests, in the
//! order they reach it (cubecl-common 0.10 `device/handle/channel.rs`), so a sample falls
//! between the layer's allocations wherever the sampler's request is waiting when one is
//! served: the sampled peak is the true one where the layer's allocations are slower than a
//! round trip, and a lower bound where several come between two samples. The most bytes
//! reserved is an upper bound (the allocator's pages, with their padding). A figure read this
//! way says both, and how many samples it took. On WGPU a usage query first runs the stream's
//! queued work (cubecl-wgpu 0.10 `compute/server.rs` `memory_usage`), so on a slow device the
//! reads are few and the peak falls between them (docs/design-notes.md, "The layer's device
//! memory, read from cubecl's allocator"); cubecl-cuda answers from the allocator alone.
//!
//! The layer's work must be on the rank's own stream: one rank on a device, in issue order
//! (the default at one rank). The threaded executor's workers allocate on streams of their
//! own, which this meter does not read.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use burn_cubecl::cubecl::client::ComputeClient;
use burn_cubecl::cubecl::stream_id::StreamId;
use burn_cubecl::cubecl::Runtime;

use super::memory::PeakMeter;

/// What the sampler of one rank saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceSample {
    /// The most bytes in use at once (live allocations, padding excluded).
    pub peak_in_use: u64,
    /// The most bytes reserved from the device at once.
    pub peak_reserved: u64,
    /// How many times the usage was read.
    pub samples: u64,
}

struct Sampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<DeviceSample>,
}

/// A [`PeakMeter`] that reads a rank's bytes from cubecl's device allocator (see the module
/// docs), for [`measure_layer_peak`](super::measure_layer_peak) on a CubeCL backend.
pub struct DeviceMemoryMeter<R: Runtime> {
    client: ComputeClient<R>,
    running: Mutex<BTreeMap<usize, Sampler>>,
    done: Mutex<BTreeMap<usize, DeviceSample>>,
}

impl<R: Runtime> DeviceMemoryMeter<R> {
    /// A meter of `device`'s allocator.
    pub fn new(device: &R::Device) -> Self {
        Self {
            client: R::client(device),
            running: Mutex::new(BTreeMap::new()),
            done: Mutex::new(BTreeMap::new()),
        }
    }

    /// What `rank`'s last measured pass showed: the sampled peak, the most reserved, and the
    /// number of samples. `None` before a pass.
    pub fn last(&self, rank: usize) -> Option<DeviceSample> {
        lock(&self.done).get(&rank).copied()
    }

    /// The usage of the calling thread's stream.
    fn usage_here(&self) -> DeviceSample {
        let usage = self
            .client
            .memory_usage()
            .expect("the device answers its memory usage");
        DeviceSample {
            peak_in_use: usage.bytes_in_use,
            peak_reserved: usage.bytes_reserved,
            samples: 1,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<R: Runtime> PeakMeter for DeviceMemoryMeter<R> {
    fn start(&self, rank: usize) -> usize {
        let now = self.usage_here();
        let stop = Arc::new(AtomicBool::new(false));
        let mut client = self.client.clone();
        // SAFETY: the client only reads the memory usage of this stream (the rank's), which
        // cubecl's server serves for any stream id; it launches and allocates nothing.
        unsafe { client.set_stream(StreamId::current()) };
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut seen = now;
            loop {
                // One read after the stop as well: the pass's last allocations are in it.
                let last = flag.load(Ordering::Acquire);
                let usage = client
                    .memory_usage()
                    .expect("the device answers its memory usage");
                seen.peak_in_use = seen.peak_in_use.max(usage.bytes_in_use);
                seen.peak_reserved = seen.peak_reserved.max(usage.bytes_reserved);
                seen.samples += 1;
                if last {
                    return seen;
                }
            }
        });
        lock(&self.running).insert(rank, Sampler { stop, thread });
        now.peak_in_use as usize
    }

    fn peak(&self, rank: usize) -> usize {
        let Some(sampler) = lock(&self.running).remove(&rank) else {
            return 0;
        };
        sampler.stop.store(true, Ordering::Release);
        let seen = sampler.thread.join().expect("the sampler thread does not panic");
        lock(&self.done).insert(rank, seen);
        seen.peak_in_use as usize
    }
}
