//! Offloading S1–S3 partitions to pinned host memory, on a copy stream of the rank's own.
//!
//! The offload step runs on the schedule's offload worker, so blocking its host thread until
//! the copy is done costs the other streams nothing and keeps the source tensor alive exactly
//! as long as the copy needs it. Pinned buffers are kept in a pool and reused best-fit across
//! partitions, layers and steps: `cuMemHostAlloc` is slow, and the number of partitions parked
//! at once is bounded by the schedule. The meter counts a buffer while it holds a partition.

use std::sync::{Arc, Mutex};

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::FloatElement;
use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::server::Handle;
use cudarc::driver::{CudaContext, CudaStream, PinnedHostSlice};
use mpipemoe::backend::HostStore;
use mpipemoe::comm::{OffloadPath, Offloaded};
use mpipemoe::memory::MemoryMeter;
use mpipemoe::{MoeError, Result};

use crate::CudaMoe;

/// The pinned offload path of one rank.
#[derive(Debug)]
pub(crate) struct PinnedOffload {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pool: Mutex<Vec<PinnedHostSlice<u8>>>,
}

fn err(what: &str, e: impl std::fmt::Debug) -> MoeError {
    MoeError::Memory(format!("pinned host copy: {what}: {e:?}"))
}

impl PinnedOffload {
    /// A path with its own copy stream in `context`.
    pub(crate) fn new(context: Arc<CudaContext>) -> Result<Self> {
        let stream = context.new_stream().map_err(|e| err("stream", e))?;
        Ok(Self {
            context,
            stream,
            pool: Mutex::new(Vec::new()),
        })
    }

    /// A pinned buffer of at least `bytes`: the smallest pooled one that fits, or a new one.
    fn buffer(&self, bytes: usize) -> Result<PinnedHostSlice<u8>> {
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        let best = pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.len() >= bytes)
            .min_by_key(|(_, b)| b.len())
            .map(|(i, _)| i);
        match best {
            Some(i) => Ok(pool.swap_remove(i)),
            // SAFETY: the buffer is written by the device copy before anything reads it.
            None => unsafe { self.context.alloc_pinned_with_flags::<u8>(bytes, 0) }
                .map_err(|e| err(&format!("{bytes} bytes of pinned host memory"), e)),
        }
    }

    fn give_back(&self, buffer: PinnedHostSlice<u8>) {
        self.pool.lock().unwrap_or_else(|e| e.into_inner()).push(buffer);
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| err("copy stream", e))
    }

    /// A new cubecl buffer on the calling thread's stream holding the first `bytes` bytes of
    /// `host`, copied on this path's stream; returns once the copy is done.
    fn copy_in(
        &self,
        client: &ComputeClient<CudaRuntime>,
        host: &PinnedHostSlice<u8>,
        bytes: usize,
    ) -> Result<Handle> {
        let out = client.empty(bytes.max(1));
        if bytes == 0 {
            return Ok(out);
        }
        let dst = client
            .get_resource(out.clone())
            .map_err(|e| err("resource of the copy's destination", e))?;
        // The copy below runs on this path's own CUDA stream, which cubecl does not order
        // against its streams: the slice `empty` handed out may still be read by a queued
        // kernel of its previous tenant on this thread's cubecl stream (cubecl-cuda
        // `memory_management` reuses a freed slice at once for the next reservation on the
        // same stream). Waiting for that stream first orders the copy after them.
        cubecl::future::block_on(client.sync()).map_err(|e| err("sync", e))?;
        self.context.bind_to_thread().map_err(|e| err("context", e))?;
        let host_bytes = host.as_slice().map_err(|e| err("pinned buffer", e))?;
        // SAFETY: `dst` holds at least `bytes` bytes and `host` as many; the copy is waited for
        // before the buffer is handed on and before `host` goes back to the pool.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                dst.resource().ptr,
                &host_bytes[..bytes],
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| err("host to device copy", e))?;
        self.synchronize()?;
        Ok(out)
    }

    /// A contiguous `shape` tensor of `dtype` on the calling thread's cubecl stream whose bytes
    /// `fill` writes (every one of them, row-major) into a pooled page-locked buffer on the
    /// calling thread; they go to the device on this path's stream (`copy_in`). cubecl's own
    /// upload would hand a pageable copy to its device thread instead (`host_rows.rs`).
    pub(crate) fn upload_with(
        &self,
        client: &ComputeClient<CudaRuntime>,
        device: &CudaDevice,
        shape: Shape,
        dtype: DType,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<CubeTensor<CudaRuntime>> {
        let bytes = shape.num_elements() * dtype.size();
        let mut buffer = self.buffer(bytes.max(1))?;
        let host = buffer.as_mut_slice().map_err(|e| err("pinned buffer", e))?;
        if let Err(e) = fill(&mut host[..bytes]) {
            // No copy has started: the buffer goes back to the pool.
            self.give_back(buffer);
            return Err(e);
        }
        // On a failed copy the buffer is dropped, not pooled: the DMA may still read it.
        let out = self.copy_in(client, &buffer, bytes)?;
        self.give_back(buffer);
        Ok(CubeTensor::new_contiguous(
            client.clone(),
            device.clone(),
            shape,
            out,
            dtype,
        ))
    }
}

/// One partition in pinned host memory.
struct Parked {
    owner: Arc<PinnedOffload>,
    buffer: Mutex<Option<PinnedHostSlice<u8>>>,
    bytes: usize,
    shape: Shape,
    dtype: DType,
    client: ComputeClient<CudaRuntime>,
    device: CudaDevice,
    meter: MemoryMeter,
}

impl std::fmt::Debug for Parked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parked")
            .field("bytes", &self.bytes)
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        // A partition whose backward never ran (the graph was dropped) gives its buffer back.
        if let Some(buffer) = self.buffer.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            self.meter.host_free(self.bytes);
            self.owner.give_back(buffer);
        }
    }
}

/// The path as registered for the CUDA backend: shares one pool between f32, bf16 and f16.
#[derive(Debug, Clone)]
pub(crate) struct PinnedPath(pub(crate) Arc<PinnedOffload>);

impl<F: FloatElement> OffloadPath<CudaMoe<F>> for PinnedPath {
    fn offload(
        &self,
        x: CubeTensor<CudaRuntime>,
        host: &HostStore,
    ) -> Result<Arc<dyn Offloaded<CudaMoe<F>>>> {
        let x = burn_cubecl::kernel::into_contiguous(x);
        let shape = x.meta.shape().clone();
        let bytes = shape.num_elements() * x.dtype.size();
        let client = x.client.clone();
        let mut buffer = self.0.buffer(bytes.max(1))?;
        if bytes > 0 {
            let src = client
                .get_resource(x.handle.clone())
                .map_err(|e| err("resource of the partition", e))?;
            // The partition's writers may still run on cubecl's streams.
            cubecl::future::block_on(client.sync()).map_err(|e| err("sync", e))?;
            self.0.context.bind_to_thread().map_err(|e| err("context", e))?;
            let host_bytes = buffer.as_mut_slice().map_err(|e| err("pinned buffer", e))?;
            // SAFETY: `src` holds `bytes` bytes and stays alive (and unwritten: the partition
            // is only read after this) until the copy stream is synchronised below.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut host_bytes[..bytes],
                    src.resource().ptr,
                    self.0.stream.cu_stream(),
                )
            }
            .map_err(|e| err("device to host copy", e))?;
            self.0.synchronize()?;
        }
        host.meter().host_alloc(bytes);
        Ok(Arc::new(Parked {
            owner: self.0.clone(),
            buffer: Mutex::new(Some(buffer)),
            bytes,
            shape,
            dtype: x.dtype,
            client,
            device: x.device.clone(),
            meter: host.meter().clone(),
        }))
    }
}

impl<F: FloatElement> Offloaded<CudaMoe<F>> for Parked {
    fn restore(&self) -> Result<CubeTensor<CudaRuntime>> {
        let buffer = self
            .buffer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| MoeError::Backend("an offloaded partition was restored twice".into()))?;
        let copied = self.owner.copy_in(&self.client, &buffer, self.bytes).map(|out| {
            CubeTensor::new_contiguous(
                self.client.clone(),
                self.device.clone(),
                self.shape.clone(),
                out,
                self.dtype,
            )
        });
        self.meter.host_free(self.bytes);
        // A failed copy may have left the DMA reading the buffer: it is freed, not pooled.
        if copied.is_ok() {
            self.owner.give_back(buffer);
        }
        copied
    }
}
