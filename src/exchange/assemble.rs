//! Collecting the partitions' row blocks into one full-size tensor (`T_O`, `dT_I`).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::Slice;

use super::rows::{dims2, zeros_like_rows};
use crate::dispatch::{ExchangePlan, PartitionPlan};

/// Collects per-partition row blocks into one `[n_rows, width]` tensor in `T_I` order.
///
/// With one partition the block is the result. With several, each block is written into a
/// preallocated output (in place where the backend owns it uniquely, as NdArray and Flex do),
/// so the full-size tensor never exists twice.
pub(crate) struct RowAssembler<B: Backend> {
    out: Option<FloatTensor<B>>,
    single: bool,
}

impl<B: Backend> RowAssembler<B> {
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
        let [n, width] = dims2::<B>(&rows);
        if n == 0 {
            return;
        }
        let out = self.out.take().expect("preallocated");
        let range = part.send_offset..part.send_offset + n;
        self.out = Some(B::float_slice_assign(
            out,
            &[Slice::from(range), Slice::from(0..width)],
            rows,
        ));
    }

    pub(crate) fn finish(self) -> FloatTensor<B> {
        self.out.expect("every partition placed")
    }
}
