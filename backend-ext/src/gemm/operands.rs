//! Where a section's operands lie: device addresses read before the hand-over, the experts'
//! per-slot addresses, scratch buffers, and the bf16 copies the bf16 precision multiplies.

use std::collections::HashMap;
use std::sync::Mutex;

use burn::tensor::DType;
use burn_cubecl::cubecl;
use burn_cubecl::tensor::CubeTensor;
use cubecl::client::ComputeClient;
use cubecl::cuda::CudaRuntime;
use cubecl::server::Handle;
use cudarc::driver::CudaStream;
use mpipemoe::backend::{ExpertGroups, PassStore};
use mpipemoe::{Activation, MoeError, Result};

use super::err;
use super::kernels::Kernels;
use crate::CudaMoe;

/// The device addresses of one section's tensors, read before the hand-over: `get_resource`
/// aligns the calling thread's cubecl stream with each tensor's writers (cubecl-cuda
/// `compute/server.rs` `get_resource` → `command`), and that alignment must be queued before the
/// signal that the lane's stream waits for. Every tensor and scratch buffer whose address is
/// taken is held here until the section is queued: a buffer dropped earlier would go back to
/// cubecl's pool, and a later scratch of the same section could take its memory.
pub(crate) struct Addresses<'a> {
    pub(crate) client: &'a ComputeClient<CudaRuntime>,
    held: Vec<Handle>,
}

impl<'a> Addresses<'a> {
    pub(crate) fn new(client: &'a ComputeClient<CudaRuntime>) -> Self {
        Self {
            client,
            held: Vec::new(),
        }
    }

    /// The address of `t`'s first element (the caller reads it at the strides it checked).
    pub(crate) fn of(&mut self, t: &CubeTensor<CudaRuntime>) -> Result<u64> {
        let resource = self
            .client
            .get_resource(t.handle.clone())
            .map_err(|e| err("device address", e))?;
        self.held.push(t.handle.clone());
        Ok(resource.resource().ptr)
    }

    /// A scratch buffer of `bytes` on the calling thread's stream: its address.
    pub(crate) fn scratch(&mut self, bytes: usize) -> Result<u64> {
        let (handle, at) = self.kept_scratch(bytes)?;
        self.held.push(handle);
        Ok(at)
    }

    /// A buffer of `bytes` on the calling thread's stream that the caller keeps past the
    /// section (the pass's bf16 weights): its handle and address.
    pub(crate) fn kept_scratch(&self, bytes: usize) -> Result<(Handle, u64)> {
        let handle = self.client.empty(bytes.max(4));
        let resource = self
            .client
            .get_resource(handle.clone())
            .map_err(|e| err("scratch address", e))?;
        Ok((handle, resource.resource().ptr))
    }
}

/// `t` contiguous, f32, on the path's GPU.
pub(crate) fn ready(
    t: CubeTensor<CudaRuntime>,
    ordinal: usize,
    what: &str,
) -> Result<CubeTensor<CudaRuntime>> {
    if t.dtype != DType::F32 {
        return Err(MoeError::Backend(format!(
            "CUDA expert path: {what} is {:?}; the cuBLAS path runs f32 tensors",
            t.dtype
        )));
    }
    if t.device.index != ordinal {
        return Err(MoeError::Backend(format!(
            "CUDA expert path: {what} is on GPU {}, the path on GPU {ordinal}",
            t.device.index
        )));
    }
    Ok(burn_cubecl::kernel::into_contiguous(t))
}

/// The widths of one layer's experts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub(crate) d_model: usize,
    pub(crate) d_inner: usize,
    pub(crate) d_hidden: usize,
}

impl Dims {
    pub(crate) fn of(groups: &ExpertGroups<CudaMoe<f32>>, act: Activation) -> Self {
        let w_in = groups.groups[0].w_in.meta.shape().to_vec();
        let d_hidden = groups.groups[0].w_out.meta.shape()[1];
        debug_assert_eq!(act.d_inner(d_hidden), w_in[2]);
        Self {
            d_model: w_in[1],
            d_inner: w_in[2],
            d_hidden,
        }
    }
}

/// Address of row `row` of a `width`-wide buffer of `bytes`-byte elements at `base`.
pub(crate) fn row_at(base: u64, row: usize, width: usize, bytes: usize) -> u64 {
    base + (row * width * bytes) as u64
}

/// Rows before each slot's block in a dense scratch buffer.
pub(crate) fn dense_starts(rows: &[usize]) -> Vec<usize> {
    rows.iter()
        .scan(0, |at, &r| {
            let start = *at;
            *at += r;
            Some(start)
        })
        .collect()
}

/// f32 spans converted to bf16 at the start of a section (the bf16 precision): every copy in
/// one scratch buffer, each at a 256-byte boundary.
#[derive(Debug, Default)]
pub(crate) struct Halves {
    spans: Vec<(u64, u64, usize)>,
}

impl Halves {
    /// bf16 copies of each `(address, floats)`, returned in order, one conversion per
    /// distinct span however many entries read it (`spans.rs`); none where `half` is false
    /// (then the addresses come back as they are).
    pub(crate) fn plan(
        at: &mut Addresses<'_>,
        half: bool,
        list: &[(u64, usize)],
    ) -> Result<(Self, Vec<u64>)> {
        if !half {
            return Ok((Self::default(), list.iter().map(|&(a, _)| a).collect()));
        }
        let (spans, index) = crate::spans::distinct(list);
        let (offsets, total) = Self::layout(&spans);
        let base = at.scratch(total)?;
        let (halves, copies) = Self::at(base, &offsets, &spans);
        Ok((halves, index.into_iter().map(|i| copies[i]).collect()))
    }

    /// Each copy's offset in one buffer, and the buffer's bytes.
    fn layout(list: &[(u64, usize)]) -> (Vec<usize>, usize) {
        let offsets: Vec<usize> = list
            .iter()
            .scan(0usize, |at, &(_, n)| {
                let start = *at;
                *at += (n * 2).div_ceil(256) * 256;
                Some(start)
            })
            .collect();
        let total = list.iter().map(|&(_, n)| (n * 2).div_ceil(256) * 256).sum();
        (offsets, total)
    }

    /// The conversions of `list` into the buffer at `base`, and the copies' addresses.
    fn at(base: u64, offsets: &[usize], list: &[(u64, usize)]) -> (Self, Vec<u64>) {
        let copies: Vec<u64> = offsets.iter().map(|&o| base + o as u64).collect();
        let spans = list
            .iter()
            .zip(&copies)
            .map(|(&(src, n), &dst)| (src, dst, n))
            .collect();
        (Self { spans }, copies)
    }

    /// Whether there is nothing to convert.
    pub(crate) fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Queues the conversions on the lane's stream.
    pub(crate) fn convert(&self, kernels: &Kernels, stream: &CudaStream) -> Result<()> {
        kernels.to_bf16(stream, &self.spans)
    }
}

/// The bf16 copies of one pass's (or one step's) expert matrices (the bf16 precision), kept in
/// the pass's store (`ExpertGroups::pass`), or the step's (`ExpertGroups::step`) where the
/// path keeps them across the step: made by the first section of each lane that needs them,
/// then read by every later partition of the pass (and the backward's, for the step's). The weights do not change within a pass, and
/// converting them for each of the `n` partitions, forward and backward, cost `2n` passes over
/// every expert's weights a step where the forward's and the backward's one each suffice.
///
/// Kept per lane: a lane's later sections run after its first on its own stream, while another
/// lane's stream is not ordered after it. Kept for the addresses converted: a pass whose
/// weights were copied to be contiguous has new addresses in each section, and converts again.
/// Used on cubecl's device thread only (inside a section's `exclusive`), so holding the lock
/// through the buffer's allocation waits on no other thread.
#[derive(Default)]
pub(crate) struct PassHalves {
    by_lane: Mutex<HashMap<usize, Converted>>,
}

struct Converted {
    /// The f32 spans converted, `(address, floats)`.
    sources: Vec<(u64, usize)>,
    /// Where their copies are.
    copies: Vec<u64>,
    /// The buffer of the copies, held for the pass.
    _buffer: Handle,
}

impl PassHalves {
    /// The copies of `list` for `lane`: made now (and the conversions to queue returned) the
    /// first time, found afterwards (nothing to queue).
    pub(crate) fn copies(
        &self,
        at: &Addresses<'_>,
        lane: usize,
        list: &[(u64, usize)],
    ) -> Result<(Halves, Vec<u64>)> {
        let mut by_lane = self.by_lane.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(done) = by_lane.get(&lane).filter(|d| d.sources == list) {
            return Ok((Halves::default(), done.copies.clone()));
        }
        let (offsets, total) = Halves::layout(list);
        let (buffer, base) = at.kept_scratch(total)?;
        let (halves, copies) = Halves::at(base, &offsets, list);
        by_lane.insert(
            lane,
            Converted {
                sources: list.to_vec(),
                copies: copies.clone(),
                _buffer: buffer,
            },
        );
        Ok((halves, copies))
    }
}

/// Where every slot's experts lie: per slot `[w_in, b_in, w_out, b_out]` (0 for no bias) in f32,
/// and the two matrices as the products read them (`w_in`, `w_out`: bf16 copies under the bf16
/// precision, the f32 tensors otherwise).
pub(crate) struct ExpertOperands {
    pub(crate) slots: Vec<[u64; 4]>,
    pub(crate) matrices: Vec<[u64; 2]>,
    pub(crate) halves: Halves,
}

impl ExpertOperands {
    /// The addresses of every group's contiguous stacked tensors (copies made contiguous are
    /// held by `at`), and where `half` their bf16 copies: those `store` keeps for `lane` (the
    /// pass's or the step's, [`PassHalves`]), planned here where this is the lane's first
    /// section of that pass or step.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        groups: &ExpertGroups<CudaMoe<f32>>,
        store: &PassStore,
        at: &mut Addresses<'_>,
        ordinal: usize,
        dims: Dims,
        half: bool,
        lane: usize,
    ) -> Result<Self> {
        let Dims {
            d_model: dm,
            d_inner: di,
            d_hidden: dh,
        } = dims;
        let mut address = |t: Option<CubeTensor<CudaRuntime>>, what: &str| -> Result<u64> {
            match t {
                None => Ok(0),
                Some(t) => {
                    let t = ready(t, ordinal, what)?;
                    at.of(&t)
                }
            }
        };
        let mut bases = Vec::new();
        for g in &groups.groups {
            let n = g.w_in.meta.shape()[0];
            bases.push((
                n,
                [
                    address(Some(g.w_in.clone()), "w_in")?,
                    address(g.b_in.clone(), "b_in")?,
                    address(Some(g.w_out.clone()), "w_out")?,
                    address(g.b_out.clone(), "b_out")?,
                ],
            ));
        }
        let list: Vec<(u64, usize)> = bases
            .iter()
            .flat_map(|&(n, b)| [(b[0], n * dm * di), (b[2], n * dh * dm)])
            .collect();
        let (halves, copies) = match half {
            true => store
                .get_or_make(|| Ok(PassHalves::default()))?
                .copies(at, lane, &list)?,
            false => Halves::plan(at, false, &list)?,
        };
        let bytes = if half { 2 } else { 4 };
        let strides = [dm * di, di, dh * dm, dm];
        let (mut slots, mut matrices) = (Vec::new(), Vec::new());
        for (g, &(n, base)) in bases.iter().enumerate() {
            for i in 0..n {
                slots.push(std::array::from_fn(|p| match base[p] {
                    0 => 0,
                    b => b + (i * strides[p] * 4) as u64,
                }));
                matrices.push([
                    copies[2 * g] + (i * strides[0] * bytes) as u64,
                    copies[2 * g + 1] + (i * strides[2] * bytes) as u64,
                ]);
            }
        }
        Ok(Self {
            slots,
            matrices,
            halves,
        })
    }
}
