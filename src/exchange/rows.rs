//! Row-level helpers on backend primitives, shared by the fused op and the reference twin.
//!
//! They exist mostly to make zero-row tensors safe: ranks and experts that receive no rows
//! are normal, and some backends cannot multiply or gather an empty matrix.
//!
//! # No kernel on zero elements
//!
//! A tensor of zero rows is made with `float_empty`, which allocates and launches nothing:
//! every helper below routes an empty result through `zeros_like_rows`, and [`issue`] holds
//! the zero fill and the row write to it in debug builds. On a CubeCL backend every op that writes a tensor launches a kernel, even over zero
//! elements: the grid is then `CubeCount::Static(0, 0, 0)` (cubecl-core 0.10 `lib.rs`,
//! `calculate_cube_count_elemwise` returns it for `num_elems == 0`), cubecl-runtime 0.10's
//! client launches it without asking `CubeCount::is_empty` (`client.rs`, `launch_inner`),
//! cubecl-cuda hands the grid to `cuLaunchKernel`, which refuses a zero dimension, and keeps
//! the error on the stream (`compute/server.rs`, `launch` → `launch_checked`) until the
//! stream's next `sync` fails the pass. WGPU and the CPU backends take a zero grid as a
//! no-op, so without the check no test here could see it.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{ElementConversion, FloatDType, Shape, Slice, TensorData, TensorMetadata};

use super::MoeBackend;
use crate::comm::{Communicator, HostRows, RowExchange};
use crate::error::Result;

/// Holds an op the exchange is about to issue to the rule of the module docs: on a backend
/// that launches device kernels ([`MoeBackend::issues_kernels`]), never over zero elements.
/// A debug assertion at the two ops that may meet an empty block, the zero fill and the row
/// write: every helper below routes an empty result through `zeros_like_rows`' no-kernel
/// branch, so it fires only where that branch or a caller's skip of empty blocks is lost.
#[track_caller]
pub(crate) fn issue<B: MoeBackend>(op: &str, elements: usize) {
    debug_assert!(
        elements > 0 || !B::issues_kernels(),
        "`{op}` over zero elements would launch a kernel with an empty grid, which CUDA \
         rejects: make empty tensors with `float_empty` (exchange/rows.rs)"
    );
}

/// `[rows, width]` of a 2-D primitive.
pub(crate) fn dims2<B: Backend>(x: &FloatTensor<B>) -> [usize; 2] {
    let d = x.shape().to_vec();
    [d[0], d[1]]
}

/// The float dtype of a primitive.
pub(crate) fn float_dtype<B: Backend>(x: &FloatTensor<B>) -> FloatDType {
    x.dtype().into()
}

/// An int index tensor from host indices, written in the backend's integer type in one pass:
/// through `i64` and burn's `convert` it was two passes and two allocations (the conversion
/// allocates again where the types differ in size, as `i64` and the CubeCL and Flex backends'
/// `i32` do), on the host between the routing read and the dispatch.
pub(crate) fn index<B: Backend>(idx: &[usize], device: &B::Device) -> IntTensor<B> {
    let data = TensorData::new(
        idx.iter()
            .map(|&i| (i as i64).elem::<B::IntElem>())
            .collect::<Vec<_>>(),
        [idx.len()],
    );
    B::int_from_data(data, device)
}

/// `[rows, width]` zeros with `x`'s dtype and device; without a kernel where that is no
/// element (module docs).
pub(crate) fn zeros_like_rows<B: MoeBackend>(
    x: &FloatTensor<B>,
    rows: usize,
    width: usize,
) -> FloatTensor<B> {
    let shape = Shape::new([rows, width]);
    let (device, dtype) = (B::float_device(x), float_dtype::<B>(x));
    if rows * width == 0 {
        return B::float_empty(shape, &device, dtype);
    }
    issue::<B>("float_zeros", rows * width);
    B::float_zeros(shape, &device, dtype)
}

/// Rows `idx` of `x`, in that order.
pub(crate) fn gather_rows<B: MoeBackend>(x: FloatTensor<B>, idx: &[usize]) -> FloatTensor<B> {
    let [_, width] = dims2::<B>(&x);
    if idx.len() * width == 0 {
        return zeros_like_rows::<B>(&x, idx.len(), width);
    }
    let device = B::float_device(&x);
    B::float_select(x, 0, index::<B>(idx, &device))
}

/// Rows `start..start + len` of `x`: a view where the backend allows, a copy otherwise (on a
/// CubeCL backend, where the start is not at the device's binding alignment), and an empty
/// tensor for no rows.
pub(crate) fn narrow_rows<B: MoeBackend>(x: FloatTensor<B>, start: usize, len: usize) -> FloatTensor<B> {
    let [_, width] = dims2::<B>(&x);
    if len * width == 0 {
        return zeros_like_rows::<B>(&x, len, width);
    }
    B::float_slice(x, &[Slice::from(start..start + len), Slice::from(0..width)])
}

/// Concatenates row blocks of equal width, leaving out empty ones; `like` supplies dtype and
/// device when no block has rows.
pub(crate) fn cat_rows<B: MoeBackend>(
    parts: Vec<FloatTensor<B>>,
    like: &FloatTensor<B>,
    width: usize,
) -> FloatTensor<B> {
    let mut parts: Vec<FloatTensor<B>> = parts.into_iter().filter(|p| dims2::<B>(p)[0] > 0).collect();
    match parts.len() {
        0 => zeros_like_rows::<B>(like, 0, width),
        1 => parts.pop().expect("one part"),
        _ => B::float_cat(parts, 0),
    }
}

/// Expert `e`'s matrix of a stacked `[n_experts, rows, cols]` weight, as `[rows, cols]`.
pub(crate) fn expert_matrix<B: Backend>(w: &FloatTensor<B>, e: usize) -> FloatTensor<B> {
    let d = w.shape().to_vec();
    let m = B::float_slice(
        w.clone(),
        &[Slice::from(e..e + 1), Slice::from(0..d[1]), Slice::from(0..d[2])],
    );
    B::float_reshape(m, Shape::new([d[1], d[2]]))
}

/// Expert `e`'s row of a stacked `[n_experts, cols]` bias, as `[1, cols]`.
pub(crate) fn expert_row<B: Backend>(b: &FloatTensor<B>, e: usize) -> FloatTensor<B> {
    let d = b.shape().to_vec();
    B::float_slice(b.clone(), &[Slice::from(e..e + 1), Slice::from(0..d[1])])
}

/// The uneven all-to-all of a `[rows, width]` primitive over `comm`.
///
/// `send_per_rank[dst]` rows of `x` (in order) go to `dst`; the result holds
/// `recv_per_rank[src]` rows from each `src`, in source order. Where the communicator is the
/// identity (one rank) it moves nothing.
pub(crate) fn all_to_all_rows<B: Backend>(
    comm: &dyn Communicator,
    x: FloatTensor<B>,
    send_per_rank: &[usize],
    recv_per_rank: &[usize],
) -> Result<FloatTensor<B>> {
    if comm.is_identity() {
        return Ok(x);
    }
    // A communicator with a path of its own for this backend (NCCL on device pointers) moves
    // the rows without the host.
    if let Some(path) = comm.row_paths().and_then(|p| p.get::<B>()) {
        return path.all_to_all(comm, x, send_per_rank, recv_per_rank);
    }
    // Otherwise host bytes, posted by the same logic a device transport uses.
    RowExchange::<B>::all_to_all(&HostRows, comm, x, send_per_rank, recv_per_rank)
}

impl<B: MoeBackend> crate::experts::ExpertTensors<B> {
    /// Expert `i`'s first matrix (the backend's [`MoeBackend::expert_matrix`]).
    /// `[d_model, d_inner]`
    pub(crate) fn w_in_of(&self, i: usize) -> FloatTensor<B> {
        B::expert_matrix(&self.w_in, i)
    }

    /// Expert `i`'s second matrix. `[d_hidden, d_model]`
    pub(crate) fn w_out_of(&self, i: usize) -> FloatTensor<B> {
        B::expert_matrix(&self.w_out, i)
    }

    /// Expert `i`'s first bias, where the experts have one. `[1, d_inner]`
    pub(crate) fn b_in_of(&self, i: usize) -> Option<FloatTensor<B>> {
        self.b_in.as_ref().map(|b| expert_row::<B>(b, i))
    }

    /// Expert `i`'s second bias, where the experts have one. `[1, d_model]`
    pub(crate) fn b_out_of(&self, i: usize) -> Option<FloatTensor<B>> {
        self.b_out.as_ref().map(|b| expert_row::<B>(b, i))
    }

    /// Expert `i`'s adapter on the first matrix, where the experts have one.
    pub(crate) fn lora_in_of(&self, i: usize) -> Option<LowRank<B>> {
        self.lora_in.as_ref().map(|l| LowRank::of(l, i))
    }

    /// Expert `i`'s adapter on the second matrix, where the experts have one.
    pub(crate) fn lora_out_of(&self, i: usize) -> Option<LowRank<B>> {
        self.lora_out.as_ref().map(|l| LowRank::of(l, i))
    }
}

/// One expert's low-rank adapter on one of its matrices `w [rows, cols]`: the expert runs
/// `x · w + scale · (x · a) · b`.
///
/// # Shapes
/// - a: `[rows, rank]`, b: `[rank, cols]`
#[derive(Debug, Clone)]
pub(crate) struct LowRank<B: Backend> {
    pub a: FloatTensor<B>,
    pub b: FloatTensor<B>,
    pub scale: f64,
}

impl<B: MoeBackend> LowRank<B> {
    fn of(l: &crate::experts::LowRankTensors<B>, i: usize) -> Self {
        Self {
            a: B::expert_matrix(&l.a, i),
            b: B::expert_matrix(&l.b, i),
            scale: l.scale,
        }
    }

    /// `scale · p`, for `p = x · a` (the adapter's side input, the `[n_rows, rank]` factor of
    /// its term) or `p = g · bᵀ` (the gradient flowing back into that factor).
    /// A scale of 1 (PEFT's default, and every adapter inside the exchange, which folds its
    /// scale into `b`: `exchange/adapter_scales.rs`) launches nothing.
    pub(crate) fn scaled(&self, p: FloatTensor<B>) -> FloatTensor<B> {
        match self.scale == 1.0 {
            true => p,
            false => B::float_mul_scalar(p, (self.scale as f32).into()),
        }
    }
}
