//! A lane: the CUDA stream, cuBLAS handle and small device buffers that the expert path uses for
//! the work of one cubecl stream (one per calling thread, or per worker stream of the threaded
//! executor), so that sections of different cubecl streams never share a sequence of flags.

use std::sync::Arc;

use burn_cubecl::cubecl;
use cubecl::client::ComputeClient;
use cubecl::cuda::CudaRuntime;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{result as driver, sys, CudaContext, CudaStream};
use mpipemoe::{GemmPrecision, MoeError, Result};

use super::handover::{Flags, Handover};
use super::kernels::Kernels;
use super::stopwatch::{self, Stopwatch};
use crate::breakdown::Breakdown;

fn err(what: &str, e: impl std::fmt::Debug) -> MoeError {
    MoeError::Backend(format!("CUDA expert path: {what}: {e:?}"))
}

/// Device memory of a lane's own, allocated and freed in its stream's order. It holds the
/// stream, so that the stream outlives the last free queued on it (the first H100 runs ended
/// every process in a segfault when a lane's cuBLAS handle, dropped first, took the last
/// reference to the stream and the buffers' frees went to a destroyed stream).
#[derive(Debug)]
pub(crate) struct DeviceBuf {
    ptr: u64,
    bytes: usize,
    stream: Arc<CudaStream>,
}

impl DeviceBuf {
    fn empty(stream: &Arc<CudaStream>) -> Self {
        Self {
            ptr: 0,
            bytes: 0,
            stream: stream.clone(),
        }
    }

    /// At least `bytes`, reallocated (stream-ordered: the old memory is freed after the work
    /// queued before) where smaller; `fill` then writes the 32-bit pattern into every word.
    fn at_least(&mut self, bytes: usize, fill: Option<u32>) -> Result<u64> {
        if bytes <= self.bytes {
            return Ok(self.ptr);
        }
        let size = bytes.next_power_of_two().max(256);
        self.release();
        // SAFETY: a stream-ordered allocation on the lane's stream, freed on it (`release`).
        self.ptr =
            unsafe { driver::malloc_async(self.stream.cu_stream(), size) }.map_err(|e| err("allocate", e))?;
        self.bytes = size;
        if let Some(word) = fill {
            // SAFETY: `size` bytes at `ptr` were just allocated on this stream.
            unsafe { sys::cuMemsetD32Async(self.ptr, word, size / 4, self.stream.cu_stream()) }
                .result()
                .map_err(|e| err("fill", e))?;
        }
        Ok(self.ptr)
    }

    fn release(&mut self) {
        if self.bytes > 0 {
            // SAFETY: allocated on this stream and not freed before; work queued before that
            // reads it completes first (stream order).
            let _ = self.stream.context().bind_to_thread();
            let _ = unsafe { driver::free_async(self.ptr, self.stream.cu_stream()) };
            self.bytes = 0;
            self.ptr = 0;
        }
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        self.release();
    }
}

/// The bits of 1.0f32, for the ones vector of the bias gradients.
const ONE: u32 = 0x3f80_0000;

/// Two bf16 1.0s in one word.
const ONE_BF16_PAIR: u32 = 0x3f80_3f80;

/// One cubecl stream's lane.
#[derive(Debug)]
pub(crate) struct Lane {
    pub(crate) stream: Arc<CudaStream>,
    blas: CudaBlas,
    flags: Option<Flags>,
    handover: Handover,
    table: DeviceBuf,
    ones: DeviceBuf,
    ones_bf16: DeviceBuf,
    /// The precisions at which cuBLAS refused each kind of call on this lane (then the next
    /// kind is taken: batched → grouped → looped), by [`Call`] and precision.
    refused: [[bool; 3]; 2],
    /// The marks of a timed path (`CublasOptions::timed`); none otherwise.
    stopwatch: Option<Stopwatch>,
}

/// The cuBLAS calls that a lane may find refused at a precision (`cublasGemmEx`, the last
/// resort, is never refused without an error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    /// `cublasGemmGroupedBatchedEx`.
    Grouped,
    /// `cublasGemmBatchedEx` and `cublasGemmStridedBatchedEx`.
    Batched,
}

impl Lane {
    /// A lane on a new stream of `context`, for the calling thread's cubecl stream; `timed`,
    /// it marks its sections' pieces (see [`mark`](Self::mark)).
    pub(crate) fn new(context: &Arc<CudaContext>, handover: Handover, timed: bool) -> Result<Self> {
        context.bind_to_thread().map_err(|e| err("context", e))?;
        let stream = context.new_stream().map_err(|e| err("stream", e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| err("cuBLAS handle", e))?;
        Ok(Self {
            table: DeviceBuf::empty(&stream),
            ones: DeviceBuf::empty(&stream),
            ones_bf16: DeviceBuf::empty(&stream),
            stream,
            blas,
            flags: None,
            handover,
            refused: [[false; 3]; 2],
            stopwatch: timed.then(|| Stopwatch::new(context)),
        })
    }

    /// Where the lane is timed, marks its stream's position as the end of `piece` (a section's
    /// first mark, [`open_marks`](Self::open_marks), is its start); otherwise nothing.
    pub(crate) fn mark(&mut self, piece: &'static str) -> Result<()> {
        match &mut self.stopwatch {
            Some(watch) => watch.mark(&self.stream, piece),
            None => Ok(()),
        }
    }

    /// Where the lane is timed, marks the start of a section.
    pub(crate) fn open_marks(&mut self) -> Result<()> {
        self.mark(stopwatch::START)
    }

    /// Where the lane is timed, ends the section's marks.
    pub(crate) fn close_marks(&mut self) -> Result<()> {
        match &mut self.stopwatch {
            Some(watch) => watch.close(),
            None => Ok(()),
        }
    }

    /// The pieces of the sections marked since the last call (empty where the lane is not
    /// timed); waits for their events.
    pub(crate) fn take_breakdown(&mut self) -> Result<Breakdown> {
        match &mut self.stopwatch {
            Some(watch) => watch.take(),
            None => Ok(Breakdown::default()),
        }
    }

    pub(crate) fn handle(&self) -> cudarc::cublas::sys::cublasHandle_t {
        *self.blas.handle()
    }

    /// Sets each `(address, floats)` span to zero, in the lane's stream order.
    pub(crate) fn zero(&self, spans: &[(u64, usize)]) -> Result<()> {
        for &(at, floats) in spans {
            // SAFETY: each span lies in a live buffer of the section (the caller's running sums).
            unsafe { sys::cuMemsetD32Async(at, 0, floats, self.stream.cu_stream()) }
                .result()
                .map_err(|e| err("zero", e))?;
        }
        Ok(())
    }

    /// Room for `pointers` device pointers of the grouped and batched calls' tables.
    pub(crate) fn table(&mut self, pointers: usize) -> Result<u64> {
        self.table.at_least(pointers * 8, None)
    }

    /// A device vector of at least `n` ones, f32 or (`bf16`) bf16.
    pub(crate) fn ones(&mut self, n: usize, bf16: bool) -> Result<u64> {
        match bf16 {
            false => self.ones.at_least(n * 4, Some(ONE)),
            // Two bf16 ones per word.
            true => self.ones_bf16.at_least(n.div_ceil(2) * 4, Some(ONE_BF16_PAIR)),
        }
    }

    fn precision_index(precision: GemmPrecision) -> usize {
        GemmPrecision::ALL
            .iter()
            .position(|&p| p == precision)
            .unwrap_or(0)
    }

    /// Whether cuBLAS refused `call` at `precision` on this lane before.
    pub(crate) fn refused(&self, call: Call, precision: GemmPrecision) -> bool {
        self.refused[call as usize][Self::precision_index(precision)]
    }

    /// Remembers that cuBLAS refused `call` at `precision`, so that later roles skip it.
    pub(crate) fn refuse(&mut self, call: Call, precision: GemmPrecision) {
        self.refused[call as usize][Self::precision_index(precision)] = true;
    }

    /// Orders the lane's stream after everything queued so far on the calling thread's
    /// cubecl stream. Returns the section, to hand to [`leave`](Self::leave).
    pub(crate) fn enter(
        &mut self,
        client: &ComputeClient<CudaRuntime>,
        kernels: &Kernels,
    ) -> Result<Option<u32>> {
        match self.handover {
            Handover::Host => {
                cubecl::future::block_on(client.sync()).map_err(|e| err("sync", e))?;
                Ok(None)
            }
            Handover::Device => {
                if self.flags.is_none() {
                    self.flags = Some(Flags::new(client)?);
                }
                let flags = self.flags.as_mut().expect("made above");
                flags.enter(client, &self.stream, kernels).map(Some)
            }
        }
    }

    /// Orders every later op of the calling thread's cubecl stream after the lane's work.
    pub(crate) fn leave(
        &mut self,
        client: &ComputeClient<CudaRuntime>,
        kernels: &Kernels,
        section: Option<u32>,
    ) -> Result<()> {
        match (section, &self.flags) {
            (Some(seq), Some(flags)) => flags.leave(client, &self.stream, kernels, seq),
            _ => self.stream.synchronize().map_err(|e| err("synchronize", e)),
        }
    }

    /// Whether a spinning kernel of this lane gave up (a host read; for checks and benches).
    pub(crate) fn gave_up(&self, client: &ComputeClient<CudaRuntime>) -> Result<Option<u32>> {
        match &self.flags {
            Some(flags) => flags.gave_up(client),
            None => Ok(None),
        }
    }
}
