//! Where offloaded partitions wait for the backward pass.

use std::sync::{Arc, Mutex};

use burn::tensor::TensorData;

use super::MemoryMeter;

/// The host side of offloading (strategies S1–S3).
///
/// On CUDA this is pinned host memory filled by the copy stream; on the CPU it is an ordinary
/// heap copy, which frees the "device" tensor and is counted by the [`MemoryMeter`] as host
/// bytes. Each offloaded tensor becomes a [`HostBlock`] that frees itself (and its count) when
/// the backward pass takes it back or when the graph that holds it is dropped.
#[derive(Debug, Clone, Default)]
pub struct HostStore {
    meter: MemoryMeter,
}

impl HostStore {
    /// A store that reports to `meter`.
    pub fn new(meter: MemoryMeter) -> Self {
        Self { meter }
    }

    /// The meter this store reports to.
    pub fn meter(&self) -> &MemoryMeter {
        &self.meter
    }

    /// Moves `data` into the store.
    pub fn offload(&self, data: TensorData) -> HostBlock {
        let bytes = data.as_bytes().len();
        self.meter.host_alloc(bytes);
        HostBlock {
            inner: Arc::new(BlockInner {
                data: Mutex::new(Some(data)),
                bytes,
                meter: self.meter.clone(),
            }),
        }
    }
}

/// One offloaded tensor. Cloning shares the block.
#[derive(Debug, Clone)]
pub struct HostBlock {
    inner: Arc<BlockInner>,
}

#[derive(Debug)]
struct BlockInner {
    data: Mutex<Option<TensorData>>,
    bytes: usize,
    meter: MemoryMeter,
}

impl HostBlock {
    /// Takes the data back out of the store (the prefetch). Returns `None` if it was taken.
    pub fn take(&self) -> Option<TensorData> {
        let data = self.inner.data.lock().unwrap_or_else(|e| e.into_inner()).take();
        if data.is_some() {
            self.inner.meter.host_free(self.inner.bytes);
        }
        data
    }

    /// Size of the block in bytes.
    pub fn bytes(&self) -> usize {
        self.inner.bytes
    }
}

impl Drop for BlockInner {
    fn drop(&mut self) {
        if self.data.get_mut().map(|d| d.is_some()).unwrap_or(false) {
            self.meter.host_free(self.bytes);
        }
    }
}
