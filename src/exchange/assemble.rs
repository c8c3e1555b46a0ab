//! Collecting the partitions' row blocks into one full-size tensor (`T_O`, `dT_I`).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Slice, TensorMetadata};

use super::rows::{dims2, float_dtype, issue};
use super::MoeBackend;
use crate::dispatch::{ExchangePlan, PartitionPlan};

/// `dst[start..start + rows.len()] = rows`, with burn's `slice_assign`: the default of
/// [`MoeBackend::assign_rows`].
///
/// # Shapes
/// - dst: `[n_rows, width]`, rows: `[len, width]`; returns `[n_rows, width]`
pub(crate) fn slice_assign_rows<B: MoeBackend>(
    dst: FloatTensor<B>,
    start: usize,
    rows: FloatTensor<B>,
) -> FloatTensor<B> {
    let [n, width] = dims2::<B>(&rows);
    issue::<B>("float_slice_assign", n * width);
    B::float_slice_assign(dst, &[Slice::from(start..start + n), Slice::from(0..width)], rows)
}

/// [`MoeBackend::assign_along`]'s default and reference: burn's `slice_assign` over the range
/// `start..start + len` of dimension `dim`, every other dimension whole.
///
/// # Shapes
/// - dst: `[.., n, ..]`, value: the same dims but `len` at `dim`; returns `dst`'s shape
pub(crate) fn slice_assign_along<B: MoeBackend>(
    dst: FloatTensor<B>,
    dim: usize,
    start: usize,
    value: FloatTensor<B>,
) -> FloatTensor<B> {
    let (dims, len) = (dst.shape().to_vec(), value.shape().to_vec()[dim]);
    let slices: Vec<Slice> = dims
        .iter()
        .enumerate()
        .map(|(i, &n)| match i == dim {
            true => Slice::from(start..start + len),
            false => Slice::from(0..n),
        })
        .collect();
    B::float_slice_assign(dst, &slices, value)
}

/// Collects per-partition row blocks into one `[n_rows, width]` tensor in `T_I` order.
///
/// With one partition in issue order the block is the result. Otherwise each block is written
/// into a full-size output with [`MoeBackend::assign_rows`] (in place on Flex, whose own
/// `slice_assign` copies the whole destination), so the full-size tensor never exists twice.
///
/// Where the result goes back to a caller whose streams the blocks did not come from (the
/// threaded executor), the output is allocated by the calling thread, on its stream, before the
/// workers start, and every block is written from the comm worker, whose writes the executor
/// fences before it returns: the tensor handed back then lives in the caller's memory pool, so
/// when the caller drops it (with reads of it still queued on its stream) no worker stream can
/// hand its memory out again (the rule in `exchange/streams.rs`). A debug check at every write
/// holds the backend to it: the destination was allocated on the writing stream, or handed
/// over fenced.
pub(crate) struct RowAssembler<B: Backend> {
    out: Option<FloatTensor<B>>,
    /// The blocks are written from fenced worker streams into a caller-allocated output.
    fenced: bool,
}

impl<B: MoeBackend> RowAssembler<B> {
    /// An assembler for `plan`'s rows of `like`'s width; `fenced` where the blocks come from
    /// the threaded executor's workers.
    pub(crate) fn new(like: &FloatTensor<B>, plan: &ExchangePlan, fenced: bool) -> Self {
        let [_, width] = dims2::<B>(like);
        let single = plan.n_partitions() == 1 && !fenced;
        // Written whole before it is read: the partitions are contiguous in `T_I` and tile
        // it (`ExchangePlan::new`: each starts where the one before it ends), and `place`
        // writes every row of each. So no zero fill (a launch and a pass over the tensor on
        // a GPU, each way of every step).
        let buffer = || {
            let shape = burn::tensor::Shape::new([plan.send_rows(), width]);
            B::write_buffer(shape, &B::float_device(like), float_dtype::<B>(like))
        };
        Self {
            out: (!single).then(buffer),
            fenced,
        }
    }

    pub(crate) fn place(&mut self, part: &PartitionPlan, rows: FloatTensor<B>) {
        let Some(out) = self.out.take() else {
            self.out = Some(rows);
            return;
        };
        let [n, _] = dims2::<B>(&rows);
        if n == 0 {
            self.out = Some(out);
            return;
        }
        debug_assert!(
            self.fenced || B::allocated_on_current_stream(&out),
            "the assembled rows are written on a stream other than the one that allocated them, unfenced"
        );
        self.out = Some(B::assign_rows(out, part.send_offset, rows));
    }

    /// The assembled tensor, on the calling thread: it must live on that thread's stream
    /// (allocated there before the workers started, or by in-order steps on it), because the
    /// caller drops it with its own reads still queued (the rule in `exchange/streams.rs`).
    /// The debug check holds every executor to it, the threaded one included, whose writes
    /// `place` accepts as fenced.
    pub(crate) fn finish(self) -> FloatTensor<B> {
        let out = self.out.expect("every partition placed");
        debug_assert!(
            B::allocated_on_current_stream(&out),
            "the assembled rows go back to the caller from a stream other than the caller's"
        );
        out
    }
}
