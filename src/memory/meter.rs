//! Counting the bytes the exchange op parks on the host.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Counts host-store bytes (current and peak) for one layer.
///
/// On the CPU the host store lives in the same RAM as "device" tensors, so a process-wide
/// allocator count includes it; subtracting [`MemoryReport::host_peak_bytes`] is what makes
/// the device and host figures separate.
#[derive(Debug, Clone, Default)]
pub struct MemoryMeter {
    inner: Arc<MeterInner>,
}

#[derive(Debug, Default)]
struct MeterInner {
    host_current: AtomicUsize,
    host_peak: AtomicUsize,
    offloads: AtomicUsize,
}

/// A snapshot of a [`MemoryMeter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct MemoryReport {
    /// Bytes in the host store now.
    pub host_bytes: usize,
    /// Most bytes held in the host store since the last reset.
    pub host_peak_bytes: usize,
    /// Number of blocks offloaded since the last reset.
    pub offloads: usize,
}

impl MemoryMeter {
    /// A fresh meter.
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one offloaded block of `bytes` now held in host memory: for an offload path
    /// (`comm::OffloadPath`) that holds host memory of its own, such as pinned memory on CUDA.
    pub fn host_alloc(&self, bytes: usize) {
        let now = self.inner.host_current.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.inner.host_peak.fetch_max(now, Ordering::SeqCst);
        self.inner.offloads.fetch_add(1, Ordering::SeqCst);
    }

    /// Counts `bytes` of an offloaded block given back (restored or dropped).
    pub fn host_free(&self, bytes: usize) {
        self.inner.host_current.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// The current figures.
    pub fn report(&self) -> MemoryReport {
        MemoryReport {
            host_bytes: self.inner.host_current.load(Ordering::SeqCst),
            host_peak_bytes: self.inner.host_peak.load(Ordering::SeqCst),
            offloads: self.inner.offloads.load(Ordering::SeqCst),
        }
    }

    /// Starts a new measurement: the peak restarts from the current level.
    pub fn reset_peak(&self) {
        let now = self.inner.host_current.load(Ordering::SeqCst);
        self.inner.host_peak.store(now, Ordering::SeqCst);
        self.inner.offloads.store(0, Ordering::SeqCst);
    }
}
