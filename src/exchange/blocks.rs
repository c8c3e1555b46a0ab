//! A partition's expert blocks: where each expert's rows lie in a slot buffer, and the
//! builder that fills a slot expert by expert, in the partition arena or in fresh tensors.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::arena::SlotMemory;
use super::products::{Done, ProductBatch, Products, Queued as Ticket};
use super::rows::{cat_rows, narrow_rows};
use super::schedule::Slot;
use super::MoeBackend;
use crate::error::Result;

/// Where the fused exchange builds a pass's partitions: the partition arena's slot buffers
/// (`Some`), or fresh tensors (`None`, the CPU backends).
pub(crate) type Mem<'a, B> = Option<&'a dyn SlotMemory<B>>;

/// Where each expert's rows of one partition lie in a slot buffer: expert `e`'s block starts
/// at `starts[e]`, a multiple of the row alignment, and is padded to the next one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockLayout {
    starts: Vec<usize>,
    rows: Vec<usize>,
    total: usize,
}

impl BlockLayout {
    /// The layout of blocks of `rows_per_expert` rows at multiples of `align` rows.
    pub fn new(rows_per_expert: &[usize], align: usize) -> Self {
        let align = align.max(1);
        let mut starts = Vec::with_capacity(rows_per_expert.len());
        let mut at = 0;
        for &rows in rows_per_expert {
            starts.push(at);
            at += rows.div_ceil(align) * align;
        }
        Self {
            starts,
            rows: rows_per_expert.to_vec(),
            total: at,
        }
    }

    /// Rows of the buffer, padding included.
    pub fn total(&self) -> usize {
        self.total
    }

    /// The first row of expert `e`'s block.
    pub fn start(&self, e: usize) -> usize {
        self.starts[e]
    }

    /// Buffer rows of the expert-major rows `0..sum(rows_per_expert)`, in order.
    pub fn buffer_rows(&self) -> Vec<usize> {
        self.starts
            .iter()
            .zip(&self.rows)
            .flat_map(|(&s, &r)| s..s + r)
            .collect()
    }

    /// Whether the buffer holds the rows without padding (block `e` right after block `e-1`).
    pub fn is_dense(&self) -> bool {
        self.total == self.rows.iter().sum::<usize>()
    }
}

/// The layout of a partition's blocks of `width` columns where `mem` places them (dense
/// without an arena).
pub(crate) fn layout_of<B: Backend>(mem: Mem<'_, B>, rows_per_expert: &[usize], width: usize) -> BlockLayout {
    shared_layout(mem, rows_per_expert, &[width])
}

/// The layout whose blocks start where a view may start in a buffer of each of `widths`
/// columns: the least common multiple of their row alignments. A buffer of one width and a
/// tensor of another made from it row for row (an activation's output) can then both be cut
/// into views at the same starts.
pub(crate) fn shared_layout<B: Backend>(
    mem: Mem<'_, B>,
    rows_per_expert: &[usize],
    widths: &[usize],
) -> BlockLayout {
    let align = match mem {
        Some(m) => widths.iter().map(|&w| m.row_align(w).max(1)).fold(1, lcm),
        None => 1,
    };
    BlockLayout::new(rows_per_expert, align)
}

fn lcm(a: usize, b: usize) -> usize {
    a / gcd(a as u64, b as u64) as usize * b
}

/// The greatest common divisor (of the arena's byte alignment and a row's bytes, say).
pub(crate) fn gcd(a: u64, b: u64) -> u64 {
    match b {
        0 => a,
        _ => gcd(b, a % b),
    }
}

/// Expert `e`'s rows of a partition tensor laid out by `layout`.
pub(crate) fn block<B: MoeBackend>(
    mem: Mem<'_, B>,
    x: &FloatTensor<B>,
    layout: &BlockLayout,
    e: usize,
    rows: usize,
) -> FloatTensor<B> {
    match mem {
        Some(m) => m.rows(x, layout.start(e), rows),
        None => narrow_rows::<B>(x.clone(), layout.start(e), rows),
    }
}

/// One block's GEMM for [`Blocks::gemm_round`]: expert `e`'s `rows` rows of
/// `lhs · rhs (+ u · v) (+ bias)`, where `low_rank` is `(u, v)`, a low-rank adapter's term.
///
/// # Shapes
/// - lhs `[rows, k]`, rhs `[k, cols]`, u `[rows, rank]`, v `[rank, cols]`, bias `[1, cols]`
pub(crate) struct BlockGemm<B: MoeBackend> {
    pub(crate) e: usize,
    pub(crate) rows: usize,
    pub(crate) lhs: FloatTensor<B>,
    pub(crate) rhs: FloatTensor<B>,
    pub(crate) low_rank: Option<(FloatTensor<B>, FloatTensor<B>)>,
    pub(crate) bias: Option<FloatTensor<B>>,
}

/// A block's base product: queued in the batch, or its operands kept for the backend to write
/// it into the arena's buffer itself.
enum Base<B: MoeBackend> {
    Queued(Ticket),
    Direct(FloatTensor<B>, FloatTensor<B>),
}

/// A block's products as queued: the adapter's term and the base product.
struct Queued<B: MoeBackend> {
    e: usize,
    rows: usize,
    extra: Option<Ticket>,
    base: Base<B>,
    bias: Option<FloatTensor<B>>,
}

/// A slot filled expert by expert with GEMM results: written into the arena's buffer, or
/// collected and concatenated.
pub(crate) struct Blocks<'a, B: MoeBackend> {
    mem: Mem<'a, B>,
    /// How the blocks' products multiply.
    products: &'a Products<B>,
    layout: BlockLayout,
    width: usize,
    buffer: Option<FloatTensor<B>>,
    parts: Vec<FloatTensor<B>>,
    like: FloatTensor<B>,
}

impl<'a, B: MoeBackend> Blocks<'a, B> {
    /// An empty slot for blocks of `rows_per_expert` rows and `width` columns; `like` gives
    /// the dtype and device.
    ///
    /// # Errors
    /// [`MoeError::Memory`](crate::MoeError::Memory) if the arena cannot size the buffer.
    pub(crate) fn new(
        mem: Mem<'a, B>,
        slot: Slot,
        rows_per_expert: &[usize],
        width: usize,
        like: &FloatTensor<B>,
        products: &'a Products<B>,
    ) -> Result<Self> {
        Self::with_layout(
            mem,
            slot,
            layout_of(mem, rows_per_expert, width),
            width,
            like,
            products,
        )
    }

    /// [`Blocks::new`] at a given layout (one from [`shared_layout`], say).
    ///
    /// # Errors
    /// [`MoeError::Memory`](crate::MoeError::Memory) if the arena cannot size the buffer.
    pub(crate) fn with_layout(
        mem: Mem<'a, B>,
        slot: Slot,
        layout: BlockLayout,
        width: usize,
        like: &FloatTensor<B>,
        products: &'a Products<B>,
    ) -> Result<Self> {
        let buffer = match mem {
            Some(m) => Some(m.buffer(slot, layout.total(), width)?),
            None => None,
        };
        Ok(Self {
            mem,
            products,
            layout,
            width,
            buffer,
            parts: Vec::new(),
            like: like.clone(),
        })
    }

    /// Blocks in tensors of their own, kept in no slot (`T_M` recomputed in the backward):
    /// `width` columns, multiplied as `products` multiplies.
    pub(crate) fn loose(width: usize, like: &FloatTensor<B>, products: &'a Products<B>) -> Self {
        Self {
            mem: None,
            products,
            layout: BlockLayout::new(&[], 1),
            width,
            buffer: None,
            parts: Vec::new(),
            like: like.clone(),
        }
    }

    /// The blocks of `jobs` (in expert order, experts without rows left out), their products
    /// queued in `batch` after the caller's own, so that a device library runs them all in
    /// one call. Returns the blocks, in the jobs' order, and the batch's results for the
    /// caller's products.
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if a device library fails.
    pub(crate) fn gemm_round(
        &mut self,
        mut batch: ProductBatch<'_, B>,
        jobs: Vec<BlockGemm<B>>,
    ) -> Result<(Vec<FloatTensor<B>>, Done<B>)> {
        // The backend's own product writes straight into the arena's buffer; a library's (and
        // any product without an arena) is a tensor of its own.
        let direct = self.buffer.is_some() && !self.products.through_library();
        let queued: Vec<Queued<B>> = jobs
            .into_iter()
            .map(|job| {
                let extra = job.low_rank.map(|(u, v)| batch.push(u, v));
                let base = match direct {
                    true => Base::Direct(job.lhs, job.rhs),
                    false => Base::Queued(batch.push(job.lhs, job.rhs)),
                };
                Queued {
                    e: job.e,
                    rows: job.rows,
                    extra,
                    base,
                    bias: job.bias,
                }
            })
            .collect();
        let mut done = batch.run()?;
        let mut blocks = Vec::with_capacity(queued.len());
        for q in queued {
            let extra = done.take_some(q.extra);
            let block = match (self.mem, &self.buffer, q.base) {
                (Some(m), Some(buffer), Base::Direct(lhs, rhs)) => {
                    let out = m.rows(buffer, self.layout.start(q.e), q.rows);
                    m.gemm_into(&out, lhs, rhs, q.bias)?;
                    if let Some(extra) = extra {
                        m.add_into(&out, extra);
                    }
                    out
                }
                (mem, buffer, Base::Queued(base)) => {
                    let mut z = done.take(base);
                    for term in extra.into_iter().chain(q.bias) {
                        z = B::float_add(z, term);
                    }
                    match (mem, buffer) {
                        (Some(m), Some(buffer)) => {
                            let start = self.layout.start(q.e);
                            let into: Vec<usize> = (start..start + q.rows).collect();
                            let from: Vec<usize> = (0..q.rows).collect();
                            m.copy_rows(buffer, &into, z, &from);
                            m.rows(buffer, start, q.rows)
                        }
                        _ => {
                            self.parts.push(z.clone());
                            z
                        }
                    }
                }
                (_, _, Base::Direct(..)) => unreachable!("a direct product is kept for the arena only"),
            };
            blocks.push(block);
        }
        Ok((blocks, done))
    }

    /// Where the blocks lie in the slot's buffer.
    pub(crate) fn layout(&self) -> &BlockLayout {
        &self.layout
    }

    /// The arena's buffer the blocks are written into (`None` without an arena).
    pub(crate) fn buffer(&self) -> Option<&FloatTensor<B>> {
        self.buffer.as_ref()
    }

    /// The filled slot: the arena's buffer, or the blocks concatenated.
    pub(crate) fn finish(self) -> FloatTensor<B> {
        match self.buffer {
            Some(buffer) => buffer,
            None => cat_rows::<B>(self.parts, &self.like, self.width),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_start_at_multiples_of_the_alignment_and_never_overlap() {
        let layout = BlockLayout::new(&[3, 0, 8, 1], 4);
        assert_eq!((0..4).map(|e| layout.start(e)).collect::<Vec<_>>(), [0, 4, 4, 12]);
        assert_eq!(layout.total(), 16);
        assert_eq!(layout.buffer_rows(), [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        assert!(!layout.is_dense());
        let dense = BlockLayout::new(&[3, 0, 8, 1], 1);
        assert!(dense.is_dense());
        assert_eq!(dense.buffer_rows(), (0..12).collect::<Vec<_>>());
    }
}
