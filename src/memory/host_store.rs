//! Where offloaded partitions wait for the backward pass.

use std::sync::{Arc, Mutex};

use burn::tensor::{DType, Shape, TensorData};
use memmap2::MmapMut;

use super::MemoryMeter;
use crate::error::{MoeError, Result};

/// The host side of offloading (strategies S1–S3).
///
/// On CUDA this is pinned host memory filled by the copy stream. On the CPU each offloaded
/// tensor is copied into an anonymous memory mapping, outside the global allocator: the
/// "device" tensor is freed, a counting allocator sees exactly the device bytes, and the
/// [`MemoryMeter`] counts the host bytes. Each offloaded tensor becomes a [`HostBlock`] that
/// frees itself (and its count) when the backward pass takes it back or when the graph that
/// holds it is dropped.
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

    /// Copies `data` into host memory (the offload).
    ///
    /// # Errors
    /// [`MoeError::Memory`] if the operating system refuses the mapping.
    pub fn offload(&self, data: TensorData) -> Result<HostBlock> {
        let bytes = data.as_bytes();
        let mut map = MmapMut::map_anon(bytes.len().max(1))
            .map_err(|e| MoeError::Memory(format!("cannot map {} bytes of host memory: {e}", bytes.len())))?;
        map[..bytes.len()].copy_from_slice(bytes);
        self.meter.host_alloc(bytes.len());
        Ok(HostBlock {
            inner: Arc::new(BlockInner {
                map: Mutex::new(Some(map)),
                bytes: bytes.len(),
                shape: data.shape.clone(),
                dtype: data.dtype,
                meter: self.meter.clone(),
            }),
        })
    }
}

/// One offloaded tensor. Cloning shares the block.
#[derive(Debug, Clone)]
pub struct HostBlock {
    inner: Arc<BlockInner>,
}

#[derive(Debug)]
struct BlockInner {
    map: Mutex<Option<MmapMut>>,
    bytes: usize,
    shape: Shape,
    dtype: DType,
    meter: MemoryMeter,
}

impl HostBlock {
    /// Copies the data back out of host memory and frees the block (the prefetch). Returns
    /// `None` if it was already taken.
    pub fn take(&self) -> Option<TensorData> {
        let map = crate::sync::lock(&self.inner.map).take()?;
        self.inner.meter.host_free(self.inner.bytes);
        let bytes = map[..self.inner.bytes].to_vec();
        Some(TensorData::from_bytes_vec(
            bytes,
            self.inner.shape.clone(),
            self.inner.dtype,
        ))
    }

    /// Size of the block in bytes.
    pub fn bytes(&self) -> usize {
        self.inner.bytes
    }
}

impl Drop for BlockInner {
    fn drop(&mut self) {
        if self.map.get_mut().map(|m| m.is_some()).unwrap_or(false) {
            self.meter.host_free(self.bytes);
        }
    }
}
