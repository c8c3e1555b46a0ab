//! Collecting the partitions' row blocks into one full-size tensor (`T_O`, `dT_I`).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::Slice;

use super::rows::{dims2, zeros_like_rows};
use super::MoeBackend;
use crate::dispatch::{ExchangePlan, PartitionPlan};

/// `dst[start..start + rows.len()] = rows`, with burn's `slice_assign`: the default of
/// [`MoeBackend::assign_rows`].
///
/// # Shapes
/// - dst: `[n_rows, width]`, rows: `[len, width]`; returns `[n_rows, width]`
pub(crate) fn slice_assign_rows<B: Backend>(
    dst: FloatTensor<B>,
    start: usize,
    rows: FloatTensor<B>,
) -> FloatTensor<B> {
    let [n, width] = dims2::<B>(&rows);
    B::float_slice_assign(dst, &[Slice::from(start..start + n), Slice::from(0..width)], rows)
}

/// Collects per-partition row blocks into one `[n_rows, width]` tensor in `T_I` order.
///
/// With one partition the block is the result. With several, each block is written into a
/// preallocated output with [`MoeBackend::assign_rows`] (in place on Flex, whose own
/// `slice_assign` copies the whole destination), so the full-size tensor never exists twice.
pub(crate) struct RowAssembler<B: Backend> {
    out: Option<FloatTensor<B>>,
    single: bool,
}

impl<B: MoeBackend> RowAssembler<B> {
    pub(crate) fn new(like: &FloatTensor<B>, plan: &ExchangePlan) -> Self {
        let [_, width] = dims2::<B>(like);
        let single = plan.n_partitions() == 1;
        Self {
            out: (!single).then(|| zeros_like_rows::<B>(like, plan.send_rows(), width)),
            single,
        }
    }

    pub(crate) fn place(&mut self, part: &PartitionPlan, rows: FloatTensor<B>) {
        if self.single {
            self.out = Some(rows);
            return;
        }
        let [n, _] = dims2::<B>(&rows);
        if n == 0 {
            return;
        }
        let out = self.out.take().expect("preallocated");
        self.out = Some(B::assign_rows(out, part.send_offset, rows));
    }

    pub(crate) fn finish(self) -> FloatTensor<B> {
        self.out.expect("every partition placed")
    }
}
