//! Row-level helpers on backend primitives, shared by the fused op and the reference twin.
//!
//! They exist mostly to make zero-row tensors safe: ranks and experts that receive no rows
//! are normal, and some backends cannot multiply or gather an empty matrix.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{FloatDType, Shape, Slice, TensorData, TensorMetadata};

use crate::comm::{Communicator, HostRows, RowExchange};
use crate::error::Result;

/// `[rows, width]` of a 2-D primitive.
pub(crate) fn dims2<B: Backend>(x: &FloatTensor<B>) -> [usize; 2] {
    let d = x.shape().to_vec();
    [d[0], d[1]]
}

/// The float dtype of a primitive.
pub(crate) fn float_dtype<B: Backend>(x: &FloatTensor<B>) -> FloatDType {
    x.dtype().into()
}

/// An int index tensor from host indices.
pub(crate) fn index<B: Backend>(idx: &[usize], device: &B::Device) -> IntTensor<B> {
    let data = TensorData::new(idx.iter().map(|&i| i as i64).collect::<Vec<_>>(), [idx.len()]);
    B::int_from_data(data.convert::<B::IntElem>(), device)
}

/// `[rows, width]` zeros with `x`'s dtype and device.
pub(crate) fn zeros_like_rows<B: Backend>(x: &FloatTensor<B>, rows: usize, width: usize) -> FloatTensor<B> {
    B::float_zeros(
        Shape::new([rows, width]),
        &B::float_device(x),
        float_dtype::<B>(x),
    )
}

/// Rows `idx` of `x`, in that order.
pub(crate) fn gather_rows<B: Backend>(x: FloatTensor<B>, idx: &[usize]) -> FloatTensor<B> {
    let [_, width] = dims2::<B>(&x);
    if idx.is_empty() {
        return zeros_like_rows::<B>(&x, 0, width);
    }
    let device = B::float_device(&x);
    B::float_select(x, 0, index::<B>(idx, &device))
}

/// Rows `start..start + len` of `x` (a view where the backend allows).
pub(crate) fn narrow_rows<B: Backend>(x: FloatTensor<B>, start: usize, len: usize) -> FloatTensor<B> {
    let [_, width] = dims2::<B>(&x);
    B::float_slice(x, &[Slice::from(start..start + len), Slice::from(0..width)])
}

/// Concatenates row blocks of equal width; `like` supplies dtype and device when `parts` is empty.
pub(crate) fn cat_rows<B: Backend>(
    mut parts: Vec<FloatTensor<B>>,
    like: &FloatTensor<B>,
    width: usize,
) -> FloatTensor<B> {
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
