//! The partition arena on CubeCL devices: one buffer per slot, views at aligned offsets, the
//! GEMMs writing into them and one kernel placing received rows.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use burn::tensor::DType;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::calculate_cube_count_elemwise;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::cubecl::server::Handle;
use burn_cubecl::kernel::matmul::{matmul, MatmulStrategy};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use super::arena::{buffer_of, ArenaCounters, SlotMemory};
use super::blocks::gcd;
use super::schedule::Slot;
use crate::error::{MoeError, Result};

/// One device's slot buffers for one dtype.
pub(crate) struct CubeSlots<R: CubeRuntime> {
    client: ComputeClient<R>,
    device: R::Device,
    dtype: DType,
    /// The byte multiple at which a binding may start on this device.
    align: u64,
    buffers: Mutex<HashMap<Slot, Held>>,
    counters: Arc<ArenaCounters>,
}

/// A slot's buffer, its size in bytes, and the thread that last had it.
struct Held {
    handle: Handle,
    bytes: u64,
    /// cubecl gives each OS thread a stream of its own, and the device orders work only
    /// within a stream: a buffer last used from another thread may still have work queued on
    /// that thread's stream, so only the same thread reuses it.
    thread: ThreadId,
}

impl<R: CubeRuntime> CubeSlots<R> {
    pub(crate) fn new(like: &CubeTensor<R>, counters: Arc<ArenaCounters>) -> Self {
        let align = like.client.properties().memory.alignment.max(1);
        Self {
            client: like.client.clone(),
            device: like.device.clone(),
            dtype: like.dtype,
            align,
            buffers: Mutex::new(HashMap::new()),
            counters,
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Slot, Held>> {
        crate::sync::lock(&self.buffers)
    }

    fn elem(&self) -> u64 {
        self.dtype.size() as u64
    }

    /// `handle` trimmed to its first `bytes` (rounded up to the binding alignment, which
    /// the buffer's size already is).
    fn trimmed(&self, handle: Handle, held: u64, bytes: u64) -> Handle {
        let used = bytes.div_ceil(self.align) * self.align;
        match held.saturating_sub(used) {
            0 => handle,
            cut => handle.offset_end(cut),
        }
    }

    fn tensor(&self, handle: Handle, rows: usize, width: usize) -> CubeTensor<R> {
        CubeTensor::new_contiguous(
            self.client.clone(),
            self.device.clone(),
            [rows, width].into(),
            handle,
            self.dtype,
        )
    }
}

impl<R, B> SlotMemory<B> for CubeSlots<R>
where
    R: CubeRuntime,
    B: burn::tensor::backend::Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    fn row_align(&self, width: usize) -> usize {
        let row = (width as u64 * self.elem()).max(1);
        (self.align / gcd(self.align, row)) as usize
    }

    fn buffer(&self, slot: Slot, rows: usize, width: usize) -> Result<CubeTensor<R>> {
        let bytes = (rows as u64)
            .checked_mul(width as u64)
            .and_then(|n| n.checked_mul(self.elem()))
            .ok_or_else(|| MoeError::Memory(format!("a [{rows}, {width}] partition buffer overflows")))?;
        if bytes == 0 {
            return Ok(self.tensor(self.client.empty(0), rows, width));
        }
        let slot = buffer_of(slot);
        let thread = std::thread::current().id();
        let mut buffers = self.lock();
        // Reused only when the arena's own reference is the last one (`can_mut`: a tensor
        // that a strategy kept for backward still lives in the old buffer) and on the stream
        // that last used it (see `Held::thread`).
        let reusable = |h: &Held| h.handle.can_mut() && h.thread == thread;
        if let Some(held) = buffers.get(&slot) {
            if held.bytes >= bytes && reusable(held) {
                self.counters.reused();
                let handle = self.trimmed(held.handle.clone(), held.bytes, bytes);
                return Ok(self.tensor(handle, rows, width));
            }
        }
        // A new buffer replaces the slot's old one, which is too small, still held, or last
        // used on another stream; so a slot grows to the largest partition it has seen.
        let size = bytes.div_ceil(self.align) * self.align;
        let replaced = buffers.get(&slot).map_or(0, |h| h.bytes);
        let handle = self.client.empty(size as usize);
        self.counters.allocated(size, replaced);
        buffers.insert(
            slot,
            Held {
                handle: handle.clone(),
                bytes: size,
                thread,
            },
        );
        Ok(self.tensor(self.trimmed(handle, size, bytes), rows, width))
    }

    fn rows(&self, buffer: &CubeTensor<R>, start: usize, len: usize) -> CubeTensor<R> {
        let width = buffer.meta.shape()[1];
        let row = width as u64 * self.elem();
        let begin = start as u64 * row;
        let span = (len as u64 * row).div_ceil(self.align) * self.align;
        let whole = buffer.handle.size_in_used();
        let handle = buffer.handle.clone().offset_start(begin);
        let handle = match whole.saturating_sub(begin + span) {
            0 => handle,
            cut => handle.offset_end(cut),
        };
        self.tensor(handle, len, width)
    }

    fn gemm_into(
        &self,
        out: &CubeTensor<R>,
        lhs: CubeTensor<R>,
        rhs: CubeTensor<R>,
        bias: Option<CubeTensor<R>>,
    ) -> Result<()> {
        matmul(lhs, rhs, Some(out.clone()), MatmulStrategy::default(), self.dtype)
            .map_err(|e| MoeError::Backend(format!("the expert GEMM into the partition arena: {e:?}")))?;
        if let Some(bias) = bias {
            add_in_place(out, bias);
        }
        Ok(())
    }

    fn add_into(&self, out: &CubeTensor<R>, addend: CubeTensor<R>) {
        add_in_place(out, addend);
    }

    fn copy_rows(&self, dst: &CubeTensor<R>, dst_rows: &[usize], src: CubeTensor<R>, src_rows: &[usize]) {
        assert_eq!(
            dst_rows.len(),
            src_rows.len(),
            "copy_rows: index lists differ in length"
        );
        if dst_rows.is_empty() {
            return;
        }
        let width = dst.meta.shape()[1];
        let dst_idx = self.indices(dst_rows);
        let src_idx = self.indices(src_rows);
        let units = dst_rows.len() * width;
        let cube_dim = CubeDim::new(&self.client, units);
        let cube_count = calculate_cube_count_elemwise(&self.client, units, cube_dim);
        // Safety: every index is below its tensor's row count (the layout and the plan's
        // permutation say so; see `dispatch` in `fused/moves.rs`), and the kernel bounds its units.
        unsafe {
            copy_rows_kernel::launch_unchecked(
                &self.client,
                cube_count,
                cube_dim,
                src.into_tensor_arg(),
                ArrayArg::from_raw_parts(src_idx, src_rows.len()),
                dst.clone().into_tensor_arg(),
                ArrayArg::from_raw_parts(dst_idx, dst_rows.len()),
                width,
                self.dtype.into(),
            )
        }
    }
}

impl<R: CubeRuntime> CubeSlots<R> {
    fn indices(&self, rows: &[usize]) -> Handle {
        let idx: Vec<u32> = rows
            .iter()
            .map(|&r| u32::try_from(r).expect("a partition's row index fits in u32"))
            .collect();
        self.client.create_from_slice(u32::as_bytes(&idx))
    }
}

/// `out += addend` for a `[rows, width]` block and an addend of the same shape (an adapter's
/// term) or `[1, width]` (a bias row, added to every row), of any row strides.
fn add_in_place<R: CubeRuntime>(out: &CubeTensor<R>, addend: CubeTensor<R>) {
    let [rows, width] = [out.meta.shape()[0], out.meta.shape()[1]];
    let addend_rows = addend.meta.shape()[0];
    assert!(
        addend.meta.shape()[1] == width && (addend_rows == rows || addend_rows == 1),
        "add_in_place: an addend of {:?} for a block of [{rows}, {width}]",
        addend.meta.shape()
    );
    let units = rows * width;
    if units == 0 {
        return;
    }
    let client = out.client.clone();
    let cube_dim = CubeDim::new(&client, units);
    let cube_count = calculate_cube_count_elemwise(&client, units, cube_dim);
    let dtype = out.dtype;
    // Safety: the kernel bounds its units by `rows * width`, and reads the addend's row
    // `r % addend_rows`, which it has.
    unsafe {
        add_kernel::launch_unchecked(
            &client,
            cube_count,
            cube_dim,
            out.clone().into_tensor_arg(),
            addend.into_tensor_arg(),
            rows,
            width,
            dtype.into(),
        )
    }
}

#[cube(launch_unchecked)]
fn add_kernel<T: Numeric>(
    output: &mut Tensor<T>,
    addend: &Tensor<T>,
    rows: usize,
    width: usize,
    #[define(T)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= rows * width {
        terminate!();
    }
    let r = ABSOLUTE_POS / width;
    let c = ABSOLUTE_POS % width;
    let at = r * output.stride(0) + c * output.stride(1);
    // A one-row addend (a bias) is added to every row.
    let src = (r % addend.shape(0)) * addend.stride(0) + c * addend.stride(1);
    output[at] = output[at] + addend[src];
}

#[cube(launch_unchecked)]
fn copy_rows_kernel<T: Numeric>(
    input: &Tensor<T>,
    src_rows: &Array<u32>,
    output: &mut Tensor<T>,
    dst_rows: &Array<u32>,
    width: usize,
    #[define(T)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= src_rows.len() * width {
        terminate!();
    }
    let k = ABSOLUTE_POS / width;
    let c = ABSOLUTE_POS % width;
    let s = src_rows[k] as usize;
    let d = dst_rows[k] as usize;
    output[d * output.stride(0) + c * output.stride(1)] = input[s * input.stride(0) + c * input.stride(1)];
}
