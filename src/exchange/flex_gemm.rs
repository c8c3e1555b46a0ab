//! The experts' GEMMs on Flex, into an output allocated once.
//!
//! Flex's matmul allocates its output with `FlexTensor::empty`, which zero-fills a byte
//! vector and then copies it whole to re-align it (burn-flex 0.21 `tensor.rs` `empty`:
//! `Bytes::from_bytes_vec(vec![0u8; ..])`, whose `try_enforce_runtime_align` copies any
//! allocation made with byte alignment, cubecl-common 0.10 `bytes/base.rs` lines 254–262 and
//! 400–406): two passes over every product before the GEMM writes it, on the calling thread
//! while the pool waits. The experts' products are most of a MoE model's GEMM output — the
//! weight gradients alone are `n_experts · d_model · 3 · d_hidden` values per layer and step —
//! and those passes were about 8% of a Qwen3-MoE fine-tuning step. Here the output is an
//! `f32` vector zeroed once and handed to Flex without a copy (`TensorData::new` of a
//! `Vec<f32>` keeps the vector's own allocation), and `gemm` — the crate Flex calls, with the
//! same arguments and the same parallelism threshold — writes into it, so the numbers are
//! Flex's own.
//!
//! A product of few rows (an expert's share of a decode step: one to a few tokens, a model's
//! projection of one token per prompt) goes over the threads instead, see [`few_rows`]:
//! against a row-major weight on the streaming kernel of `flex_gemv.rs`, cut by depth.

use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorData};

use super::{flex_dot, flex_gemv};

/// Flex's threshold (burn-flex 0.21 `ops/matmul.rs` `PARALLEL_THRESHOLD`): products of at
/// least this many multiply-adds run on every core.
pub(crate) const PARALLEL_THRESHOLD: usize = 192 * 192 * 192;

/// Products of at most this many rows run as [`few_rows`] does.
pub(crate) const FEW_ROWS: usize = 16;

/// A few-row product is split over the pool's threads when its `rhs` holds at least this
/// many values (256 KiB).
const SPLIT_VALUES: usize = 1 << 16;

/// A one-row product against a transposed `rhs` (the `gemm` road) splits only from this many
/// values of `rhs` (8 MiB): `gemm`'s vector-matrix kernel reads an expert-sized `rhs` faster
/// on one thread than split by columns (see [`few_rows`]).
const SPLIT_VALUES_ONE_ROW: usize = 1 << 21;

/// Products of more rows than this split over the pool by columns ([`pool_columns`]).
const POOL_SPLIT_ROWS: usize = 64;

/// The fewest columns one thread of a column split takes.
const MIN_SPLIT_COLUMNS: usize = 64;

/// The most depth chunks a streamed product is cut into (see [`depth_chunks`]).
const MAX_DEPTH_CHUNKS: usize = 8;

/// The side of [`transpose_block`]'s tiles: 16 values, a cache line of `f32`.
const TILE: usize = 16;

/// The side up to which `gemm` folds a product's depth in blocks of its own (see
/// [`Operands::column_runs`]).
const GEMM_SMALL_SIDE: usize = 64;

/// The fewest values of a transposed weight (512 KiB) whose product goes through a
/// column-major block (see [`Operands::transposed_rhs_for_few_rows`]).
const BLOCK_VALUES: usize = 1 << 17;

/// `lhs · rhs` for two `f32` matrices of any strides (transposed views included); other
/// dtypes and ranks go to Flex's matmul.
///
/// # Shapes
/// - lhs: `[m, k]`, rhs: `[k, n]` → `[m, n]`
///
/// # Panics
/// If the inner dimensions differ (the same contract as `float_matmul`).
pub(crate) fn matmul(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    let (l, r) = (lhs.layout().shape().to_vec(), rhs.layout().shape().to_vec());
    // Other dtypes, ranks and flipped (negative-stride) views: Flex's matmul.
    if !(is_plain(&lhs) && is_plain(&rhs)) {
        return Flex::float_matmul(lhs, rhs);
    }
    let (m, k, n) = (l[0], l[1], r[1]);
    assert_eq!(k, r[0], "expert matmul: inner dimensions {k} and {} differ", r[0]);
    let mut out = vec![0f32; m * n];
    let parallel = m.saturating_mul(n).saturating_mul(k) >= PARALLEL_THRESHOLD;
    // SAFETY: `out` holds `m · n` values and is not touched elsewhere meanwhile; the operands
    // are plain `f32` matrices (checked above).
    unsafe { product_into(&lhs, &rhs, [m, k, n], out.as_mut_ptr(), parallel) };
    FlexTensor::from_data(TensorData::new(out, Shape::new([m, n])))
}

/// Whether [`product_into`] takes `t` as an operand: a rank-2 `f32` view without negative
/// strides.
pub(crate) fn is_plain(t: &FlexTensor) -> bool {
    t.dtype() == DType::F32
        && t.layout().shape().num_dims() == 2
        && t.layout().strides().iter().all(|&s| s >= 0)
}

/// `out = lhs · rhs` into `m · n` row-major values: the values [`matmul`] gives, on every
/// core where `parallel` (a product of at most [`FEW_ROWS`] rows always splits as
/// [`few_rows`] does, and has the same values on any pool), else `gemm` on the calling thread
/// alone — for a caller that runs several products side by side on the pool
/// (`exchange/flex_experts.rs`). `gemm` splits a product over threads by blocks of the
/// output, never by depth, so either way each value is the same fold.
///
/// # Safety
/// Both operands are [`is_plain`] with `[m, k]` and `[k, n]`; `out` points at `m · n`
/// initialised values, all of which the call overwrites, that nothing else reads or writes
/// meanwhile.
pub(crate) unsafe fn product_into(
    lhs: &FlexTensor,
    rhs: &FlexTensor,
    [m, k, n]: [usize; 3],
    out: *mut f32,
    parallel: bool,
) {
    if m * n == 0 {
        return;
    }
    let operands = Operands::of(lhs, rhs, [m, k, n]);
    if m <= FEW_ROWS {
        // Every road writes each of `out`'s values (the streaming kernel's folds are fresh).
        let out = std::slice::from_raw_parts_mut(out, m * n);
        few_rows(&operands, out);
    } else if parallel {
        pool_columns(&operands, out);
    } else {
        operands.columns(out, 0..n, gemm::Parallelism::None);
    }
}

/// A product of more than [`POOL_SPLIT_ROWS`] rows over the pool: one run of columns per
/// thread, one single-threaded `gemm` call each; fewer rows take `gemm`'s own split.
///
/// `gemm`'s own split (`Parallelism::Rayon`) hands each block of depth and columns to the
/// pool as a parallel region of its own, two with the packing of `rhs`. Between two regions
/// the idle thread spins for a few microseconds and then sleeps (rayon-core 1.13
/// `sleep/mod.rs`: 32 rounds of `yield_now` before it is sleepy), so in a step of
/// single-threaded ops and products it was woken again for many regions, each wake 50–250 µs
/// on this project's VM (scratch benchmark of `rayon::join` after a pause: median 50–70 µs,
/// p90 up to 240 µs). A model's projections and head ran with the other thread idle for a
/// quarter of their time (`perf`, the 163 M Qwen3-MoE's fine-tuning step). Cut by columns,
/// a product takes one region. Each value is the same fold either way: `gemm` cuts the depth
/// by a block size that depends on `k` alone (gemm-common 0.19 `cache.rs` `kernel_params`)
/// except for products of at most 64 rows and 64 columns, which the row bound keeps out
/// (and [`Operands::column_runs`] never cuts a run that narrow).
///
/// # Safety
/// As [`product_into`]'s.
unsafe fn pool_columns(operands: &Operands, out: *mut f32) {
    let [m, _, n] = operands.mkn;
    let threads = rayon::current_num_threads().min(n / MIN_SPLIT_COLUMNS).max(1);
    match m <= POOL_SPLIT_ROWS || threads == 1 {
        true => operands.columns(out, 0..n, gemm::Parallelism::Rayon(0)),
        false => operands.column_runs(out, threads),
    }
}

/// `out = lhs · rhs` for `m ≤ FEW_ROWS` rows (a decode step's products: an expert's share of
/// one token a row, a projection of one token per prompt), over the pool's threads where
/// `rhs` is large.
///
/// These products are bound by reading `rhs` (an expert's or a projection's weight, MBs),
/// yet their multiply-adds stay under Flex's parallel threshold, so Flex ran them on one core
/// while the pool waited. Against a row-major `rhs` (unit column stride: every weight a
/// model lays out at load) they run on the streaming kernel of `flex_gemv.rs`, cut by depth
/// into [`depth_chunks`]: each thread reads whole consecutive rows of `rhs`, one contiguous
/// stretch of memory, into a partial product of its own, and the partials are added in chunk
/// order. Cut by columns instead, each thread reads part of every row, and two threads read
/// no faster than about 1.3 times one on this project's VM; cut by depth, they read
/// 1.5–1.6 times as fast (scratch benchmark of one decode step's 73 products, 105 MB of
/// weights, 2 threads, against a plain two-thread read of the same bytes at 1.7–1.9 times).
/// The chunks depend on the shape alone, never on the thread count, so the values are the
/// same on any pool, one thread included.
///
/// Against a transposed `rhs` (a backward's, a tied head's `Eᵀ`, attention's `Kᵀ`), the
/// contiguous stretches are columns. Up to [`flex_dot::DOT_ROWS`] rows each column is dotted
/// with the rows where it lies ([`dotted_rows`]); with more, the product splits by column runs
/// over the threads, one single-threaded `gemm` call each, giving the whole call's values bit
/// for bit. One row split there only from [`SPLIT_VALUES_ONE_ROW`] on (measured, µs, 2
/// threads, whole call against the split: 1×512×8192 1,838 → 1,176, but 1×512×1536 372 → 440).
pub(crate) fn few_rows(operands: &Operands, out: &mut [f32]) {
    let [m, _, _] = operands.mkn;
    let row_major = operands.rhs_strides[1] == 1;
    let column_major = operands.rhs_strides[0] == 1 && m <= flex_dot::DOT_ROWS;
    match (row_major, column_major, flex_gemv::available()) {
        (true, _, true) => streamed_rows(operands, out),
        (false, true, true) => dotted_rows(operands, out),
        _ => split_columns(operands, out),
    }
}

/// [`few_rows`] against a transposed `rhs` of at most [`flex_dot::DOT_ROWS`] rows (attention's
/// `q · Kᵀ` in a decode step, a tied head's `x · Eᵀ`): each column of `rhs` is a contiguous
/// run, dotted with every row of `lhs` (`flex_dot.rs`), runs of columns over the pool's
/// threads where `rhs` is large. Each value is one fold, so the values are the same on any
/// pool.
fn dotted_rows(operands: &Operands, out: &mut [f32]) {
    use rayon::prelude::*;

    let [m, k, n] = operands.mkn;
    let lhs = operands.lhs_rows();
    let threads = column_threads(k, n, SPLIT_VALUES);
    let run = n.div_ceil(threads).next_multiple_of(16).min(n).max(1);
    let out_ptr = Shared(out.as_mut_ptr() as *const f32);
    let work = |j0: usize| {
        // SAFETY: each run writes only its own columns of `out` (`m · n` values, this call's
        // alone); the kernel is available (the caller's check) and takes `m ≤ DOT_ROWS` rows;
        // `rhs`'s columns are `k` contiguous values `rhs_strides[1]` apart.
        unsafe {
            flex_dot::rows_dot_rows(
                &lhs,
                [m, k],
                operands.rhs.0,
                operands.rhs_strides[1] as usize,
                out_ptr.as_mut(),
                n,
                j0..(j0 + run).min(n),
            )
        }
    };
    match threads {
        1 => work(0),
        _ => (0..n)
            .step_by(run)
            .collect::<Vec<_>>()
            .into_par_iter()
            .for_each(work),
    }
}

/// How a streamed product of depth `k` and width `n` is cut by depth: `(chunks, rows per
/// chunk)`, rows a multiple of the kernel's block of 8. One chunk below [`SPLIT_VALUES`],
/// else up to [`MAX_DEPTH_CHUNKS`], each of at least 8 rows: a function of the shape only.
fn depth_chunks(k: usize, n: usize) -> (usize, usize) {
    if k.saturating_mul(n) < SPLIT_VALUES || k <= 8 {
        return (1, k);
    }
    let rows = k.div_ceil(MAX_DEPTH_CHUNKS).next_multiple_of(8);
    (k.div_ceil(rows), rows)
}

/// [`few_rows`] on the streaming kernel: depth chunk `c` is folded from zero into `out`
/// (`c = 0`) or into partial `c`, each chunk's columns split further into runs where the pool
/// has more threads than chunks; then `out += partial_1 + partial_2 + …`, added in that order.
/// On one thread the chunks run in order, each folded in one scratch buffer and added into
/// `out` by its own last block of depth: the same sums in the same order, without a buffer per
/// chunk (which were zeroed, written and read back: 2.6 MB a decode step of the 163 M
/// Qwen3-MoE) or a pass to add them.
fn streamed_rows(operands: &Operands, out: &mut [f32]) {
    use rayon::prelude::*;

    let [m, k, n] = operands.mkn;
    if k == 0 {
        out.fill(0.0);
        return;
    }
    let lhs = operands.lhs_rows();
    let (chunks, rows) = depth_chunks(k, n);
    // Chunk `c`'s columns `cols`, folded from zero into `dst` (`m · n` values, row-major), its
    // result added into `finish` instead where one is given.
    let fold = |c: usize, cols: std::ops::Range<usize>, dst: *mut f32, finish: Option<*mut f32>| {
        // SAFETY: the kernel is available (the caller's check); `rhs` has `k` rows of `n`
        // values `rhs_strides[0]` apart; `dst` holds `m · n` values whose columns `cols` no
        // one else touches meanwhile (each caller below says why).
        unsafe {
            flex_gemv::rows_times_matrix(
                &lhs,
                [m, k],
                c * rows..((c + 1) * rows).min(k),
                operands.rhs.0,
                operands.rhs_strides[0] as usize,
                dst,
                n,
                cols,
                true,
                finish,
            )
        }
    };
    if chunks == 1 || rayon::current_num_threads() == 1 {
        // `out` and the scratch buffer are this call's alone, and the folds run one by one.
        fold(0, 0..n, out.as_mut_ptr(), None);
        if chunks > 1 {
            // Each later chunk folds its partial sums in the scratch buffer and adds its result
            // into `out` from its last block (`out += partial_c`, as `add_partials` adds).
            let mut scratch = vec![0f32; m * n];
            for c in 1..chunks {
                fold(c, 0..n, scratch.as_mut_ptr(), Some(out.as_mut_ptr()));
            }
        }
        return;
    }
    let mut partials = Vec::<f32>::with_capacity((chunks - 1) * m * n);
    let runs = rayon::current_num_threads()
        .div_ceil(chunks)
        .min(n / MIN_SPLIT_COLUMNS)
        .max(1);
    // Runs of columns in multiples of 16 (whole SIMD blocks), the last one shorter.
    let run = n.div_ceil(runs).next_multiple_of(16).min(n);
    let (out_ptr, partials_ptr) = (
        Shared(out.as_mut_ptr() as *const f32),
        Shared(partials.as_mut_ptr() as *const f32),
    );
    (0..chunks)
        .flat_map(|c| (0..n).step_by(run).map(move |j0| (c, j0)))
        .collect::<Vec<_>>()
        .into_par_iter()
        .for_each(|(c, j0)| {
            // Each (chunk, run) writes only its own columns of its own buffer (`out` for chunk
            // 0, partial `c` otherwise, each `m · n` values), so no two touch the same values.
            // SAFETY: both buffers hold what the offsets reach.
            let dst = unsafe {
                match c {
                    0 => out_ptr.as_mut(),
                    _ => partials_ptr.as_mut().add((c - 1) * m * n),
                }
            };
            fold(c, j0..(j0 + run).min(n), dst, None)
        });
    // SAFETY: the runs cover every column of every partial, each written by a fresh fold.
    unsafe { partials.set_len((chunks - 1) * m * n) };
    flex_gemv::add_partials(out, &partials);
}

/// [`few_rows`] on `gemm`: runs of columns over the pool's threads where `rhs` is large, one
/// single-threaded `gemm` call each, writing its own columns of `out`.
fn split_columns(operands: &Operands, out: &mut [f32]) {
    let [m, k, n] = operands.mkn;
    let threshold = if m == 1 {
        SPLIT_VALUES_ONE_ROW
    } else {
        SPLIT_VALUES
    };
    // SAFETY: `out` holds the product's `m · n` values and is only this call's.
    unsafe { operands.column_runs(out.as_mut_ptr(), column_threads(k, n, threshold)) }
}

/// The threads a few-row product of depth `k` and width `n` splits its columns over: the
/// pool's, at most one per [`MIN_SPLIT_COLUMNS`] columns, from `threshold` values of `rhs` on.
fn column_threads(k: usize, n: usize, threshold: usize) -> usize {
    match k.saturating_mul(n) >= threshold {
        true => rayon::current_num_threads().min(n / MIN_SPLIT_COLUMNS).max(1),
        false => 1,
    }
}

/// The two `f32` operands of one product, as `gemm` reads them: where their views start, their
/// strides, and `[m, k, n]`.
pub(crate) struct Operands {
    lhs: Shared<f32>,
    rhs: Shared<f32>,
    lhs_strides: [isize; 2],
    rhs_strides: [isize; 2],
    mkn: [usize; 3],
}

impl Operands {
    /// The operands at `lhs` and `rhs` with the strides given (non-negative; the caller keeps
    /// the storages alive and the views inside them): one product of a batch.
    pub(crate) fn at(
        (lhs, lhs_strides): (*const f32, [isize; 2]),
        (rhs, rhs_strides): (*const f32, [isize; 2]),
        mkn: [usize; 3],
    ) -> Self {
        Self {
            lhs: Shared(lhs),
            rhs: Shared(rhs),
            lhs_strides,
            rhs_strides,
            mkn,
        }
    }

    /// The views of `lhs` `[m, k]` and `rhs` `[k, n]`, whose strides the caller has checked to
    /// be non-negative. The tensors must outlive the value.
    fn of(lhs: &FlexTensor, rhs: &FlexTensor, mkn: [usize; 3]) -> Self {
        let view = |t: &FlexTensor| {
            let start = t.storage::<f32>()[t.layout().start_offset()..].as_ptr();
            (start, [t.layout().strides()[0], t.layout().strides()[1]])
        };
        Self::at(view(lhs), view(rhs), mkn)
    }

    /// `lhs`'s `[m, k]` values, row-major and contiguous: the view itself where it is laid out
    /// so (a decode step's rows always are), else a copy.
    fn lhs_rows(&self) -> std::borrow::Cow<'_, [f32]> {
        let ([m, k, _], [l0, l1]) = (self.mkn, self.lhs_strides);
        if (l1 == 1 || k <= 1) && (l0 == k as isize || m <= 1) {
            // SAFETY: the view's `m · k` elements lie inside its storage, row after row
            // (`of`'s contract), and the tensor outlives `self`.
            return std::borrow::Cow::Borrowed(unsafe { std::slice::from_raw_parts(self.lhs.0, m * k) });
        }
        let mut rows = Vec::with_capacity(m * k);
        for i in 0..m {
            for t in 0..k {
                // SAFETY: the view's elements lie inside its storage (`of`'s contract).
                rows.push(unsafe { *self.lhs.0.offset(i as isize * l0 + t as isize * l1) });
            }
        }
        std::borrow::Cow::Owned(rows)
    }

    /// `out[.., cols] = lhs · rhs[.., cols]`: one `gemm` call over a run of the output's
    /// columns (all of them for the whole product), `out` row-major `[m, n]`.
    ///
    /// # Safety
    /// `out` points at `m · n` values that no one else reads or writes in `cols` meanwhile;
    /// the tensors `self` was made of are alive; `cols` lies within `0..n`. The operands'
    /// views lie inside their storages (Flex's layouts say where; the starts are their
    /// offsets), and `read_dst` is false, so `out` is only written.
    unsafe fn columns(&self, out: *mut f32, cols: std::ops::Range<usize>, parallelism: gemm::Parallelism) {
        let ([m, k, n], [l0, l1], [r0, r1]) = (self.mkn, self.lhs_strides, self.rhs_strides);
        let width = cols.len();
        // Through a column-major block of the run (then laid into `out`), or straight into
        // `out`'s rows.
        let mut block = match self.transposed_rhs_for_few_rows(width) {
            true => Some(Vec::<f32>::with_capacity(m * width)),
            false => None,
        };
        let (dst, dst_cs, dst_rs) = match &mut block {
            Some(block) => (block.as_mut_ptr(), m as isize, 1),
            None => (out.add(cols.start), 1, n as isize),
        };
        gemm::gemm(
            m,
            width,
            k,
            dst,
            dst_cs,
            dst_rs,
            false,
            self.lhs.0,
            l1,
            l0,
            self.rhs.0.offset(cols.start as isize * r1),
            r1,
            r0,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
        if let Some(mut block) = block {
            // SAFETY: with `read_dst` false `gemm` wrote every one of the `m · width` values.
            block.set_len(m * width);
            transpose_block(&block, [m, width], out.add(cols.start), n);
        }
    }

    /// Whether a run of `width` columns goes through a column-major block
    /// ([`columns`](Self::columns)): `rhs` is a transposed row-major matrix (a backward's
    /// `g · wᵀ`, a tied head's `Eᵀ`) of at least [`BLOCK_VALUES`] in the run, and the run
    /// has at least twice as many columns as the product has rows, from two rows on.
    ///
    /// `gemm` lays out its work by the output: a row-major output makes it compute the
    /// transposed product, whose left operand is then `rhs`ᵀ — the row-major weight itself,
    /// which it packs into column panels by a strided gather of all `k · width` values
    /// (gemm-common 0.19 `gemm.rs`, `do_pack_lhs` and `pack_lhs`: any left operand without
    /// unit row stride). For an expert's few rows that gather took longer than the
    /// multiply-adds: 19% of a Qwen3-MoE fine-tuning step went to `pack_lhs`, most of it in
    /// the experts' `g · wᵀ` products (`perf`, this project's VM). A column-major output
    /// keeps the orientation: the packed operand is `lhs`, `m · k` values, and `rhs` is read
    /// in place with unit row stride (`gemm` packs such a right operand only beyond 128
    /// register blocks of rows). Laying the block into `out` costs about half a nanosecond a
    /// value. Measured single-threaded (µs, this project's VM, AVX-512 kernels; in brackets
    /// AVX2's): 64×1536×512 970 → 505 (983 → 825), 64×512×768 538 → 242, 128×512×1536
    /// 1,374 → 925, 256×1536×512 2,170 → 1,959 (3,319 → 3,309), 8×512×8192 3,565 → 1,116
    /// (1,997 → 1,005); at 512×1536×512, where the weight's gather is spread over as many
    /// rows, 3,879 → 4,096, so that is left to `gemm`; so is a weight small enough to stay in
    /// the core's caches, whose gather is cheap (20×64×256: 5.3 → 7.7, 64×128×512: 44 → 51,
    /// but 64×256×512: 109 → 86). A single row keeps `gemm`'s vector-matrix kernel. Each value is the same fold either way: the microkernel folds
    /// the depth in order into one accumulator per value, in blocks that depend on `k` and on
    /// whether both sides of the output are at most 64, which does not change with the
    /// orientation.
    fn transposed_rhs_for_few_rows(&self, width: usize) -> bool {
        let ([m, k, _], [r0, r1]) = (self.mkn, self.rhs_strides);
        m >= 2 && r0 == 1 && r1 != 1 && 2 * m <= width && k.saturating_mul(width) >= BLOCK_VALUES
    }

    /// The product cut into at most `threads` runs of columns (a multiple of 16 wide, the last
    /// one shorter, each more than [`GEMM_SMALL_SIDE`] wide), one single-threaded `gemm` call
    /// each over the pool, each writing only its own columns of `out`: the whole call's values,
    /// as `gemm` cuts only output blocks and folds the depth in the same blocks for every run.
    /// A product of at most 64 rows and 64 columns is folded in blocks of 512 (gemm-common 0.19
    /// `gemm.rs`, the small-size `KernelParams`), any other in blocks from `k` and the caches
    /// alone, so a run that narrow would change the bits of a deeper product of few rows: runs
    /// are at least 80 columns wide, and a last run of 64 or fewer joins the one before it.
    ///
    /// # Safety
    /// As [`columns`](Self::columns) for all of `0..n`.
    unsafe fn column_runs(&self, out: *mut f32, threads: usize) {
        use rayon::prelude::*;

        let n = self.mkn[2];
        let run = n
            .div_ceil(threads.max(1))
            .next_multiple_of(16)
            .max(GEMM_SMALL_SIDE + 16)
            .min(n);
        let mut starts: Vec<usize> = (0..n).step_by(run).collect();
        if starts.len() > 1 && n - starts[starts.len() - 1] <= GEMM_SMALL_SIDE {
            starts.pop();
        }
        let runs: Vec<std::ops::Range<usize>> = starts
            .iter()
            .enumerate()
            .map(|(i, &j0)| j0..starts.get(i + 1).copied().unwrap_or(n))
            .collect();
        let out = Shared(out as *const f32);
        // SAFETY (each call): each run writes only its own columns of `out`, which nothing
        // else touches meanwhile.
        let columns = |cols: std::ops::Range<usize>| unsafe {
            self.columns(out.as_mut(), cols, gemm::Parallelism::None)
        };
        match runs.len() {
            1 => columns(0..n),
            _ => runs.into_par_iter().with_max_len(1).for_each(columns),
        }
    }
}

/// `out[i · n + j] = block[j · m + i]`: a column-major `[m, width]` block laid into the rows
/// of a row-major output `n` values apart, in tiles of [`TILE`]² so that both sides are read
/// and written a cache line at a time.
///
/// # Safety
/// `out` points at the first of the block's columns in an output of rows `n ≥ width` values
/// long, `m` of them, whose `width` columns from there no one else reads or writes meanwhile.
unsafe fn transpose_block(block: &[f32], [m, width]: [usize; 2], out: *mut f32, n: usize) {
    debug_assert!(block.len() == m * width && width <= n);
    for i0 in (0..m).step_by(TILE) {
        for j0 in (0..width).step_by(TILE) {
            for i in i0..(i0 + TILE).min(m) {
                let row = out.add(i * n);
                for j in j0..(j0 + TILE).min(width) {
                    *row.add(j) = *block.get_unchecked(j * m + i);
                }
            }
        }
    }
}

/// A pointer handed to the pool's threads, each of which uses its own disjoint part of what
/// it points to (see [`few_rows`]).
#[derive(Clone, Copy)]
pub(crate) struct Shared<T>(pub(crate) *const T);

impl Shared<f32> {
    fn as_mut(&self) -> *mut f32 {
        self.0 as *mut f32
    }

    /// The pointer (a method, so that a closure captures the whole `Shared`, which is `Sync`,
    /// rather than its field).
    pub(crate) fn get(self) -> *const f32 {
        self.0
    }
}

// SAFETY: the threads of `few_rows` (and of `flex_heads.rs`, one head each) read the operands,
// which nobody writes meanwhile, and write disjoint runs of the output's columns.
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

#[cfg(test)]
mod tests {
    use burn::backend::flex::{Flex, FlexTensor};
    use burn::tensor::ops::FloatTensorOps;
    use burn::tensor::TensorData;

    use super::{few_rows, flex_dot, matmul, Operands};

    fn tensor(rows: usize, cols: usize, seed: usize) -> FlexTensor {
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| (((i + seed) * 7919) % 1013) as f32 / 97.0 - 5.0)
            .collect();
        FlexTensor::from_data(TensorData::new(values, [rows, cols]))
    }

    /// The values of a fresh (contiguous, offset 0) product.
    fn values(t: FlexTensor) -> Vec<f32> {
        t.storage::<f32>().to_vec()
    }

    /// The whole `gemm` call the plain path makes, for comparison.
    fn whole(lhs: &FlexTensor, rhs: &FlexTensor, [m, k, n]: [usize; 3]) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        // SAFETY: `out` holds `m · n` values; the tensors are alive.
        unsafe { Operands::of(lhs, rhs, [m, k, n]).columns(out.as_mut_ptr(), 0..n, gemm::Parallelism::None) };
        out
    }

    /// `lhs · rhs` in float64 and the sum of its terms' magnitudes (the scale of a float32
    /// fold's rounding), row-major `[m, n]`.
    fn float64(lhs: &FlexTensor, rhs: &FlexTensor, [m, k, n]: [usize; 3]) -> Vec<(f64, f64)> {
        let at = |t: &FlexTensor, i: usize, j: usize| {
            let (l, st) = (t.layout(), t.layout().strides());
            t.storage::<f32>()[l.start_offset() + i * st[0] as usize + j * st[1] as usize] as f64
        };
        (0..m * n)
            .map(|ij| {
                let terms = (0..k).map(|t| at(lhs, ij / n, t) * at(rhs, t, ij % n));
                terms.fold((0.0, 0.0), |(s, a), x| (s + x, a + x.abs()))
            })
            .collect()
    }

    /// Products of many rows through `matmul` on pools of one, two and three threads, split by
    /// columns where they are large and have more than `POOL_SPLIT_ROWS` rows: bit for bit the
    /// whole single-threaded call's values (deep enough that `gemm` folds the depth in
    /// blocks; 64 rows by 130 columns would fold it otherwise in runs of 64 columns or
    /// fewer), plain and transposed operands.
    #[test]
    fn many_row_products_split_by_columns_give_the_whole_calls_bits() {
        let pools = [1, 2, 3].map(|t| rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap());
        for (m, k, n) in [(200, 1300, 300), (65, 900, 770), (64, 1300, 130), (130, 40, 1030)] {
            for (lhs_t, rhs_t) in [(false, false), (true, true)] {
                let lhs = match lhs_t {
                    false => tensor(m, k, 3),
                    true => Flex::float_transpose(tensor(k, m, 3)),
                };
                let rhs = match rhs_t {
                    false => tensor(k, n, 4),
                    true => Flex::float_transpose(tensor(n, k, 4)),
                };
                let want = whole(&lhs, &rhs, [m, k, n]);
                for pool in &pools {
                    let got = pool.install(|| values(matmul(lhs.clone(), rhs.clone())));
                    assert!(
                        got == want,
                        "{m}×{k}×{n} (transposed {lhs_t}) on {} threads",
                        pool.current_num_threads()
                    );
                }
            }
        }
    }

    /// Products against a transposed weight through a column-major block
    /// (`Operands::transposed_rhs_for_few_rows`): bit for bit Flex's own matmul, which lets
    /// `gemm` compute them through a row-major output, whole and in runs of columns wider than
    /// 64 (edge tiles of the block in both directions; some runs through the block, some on
    /// `gemm`'s own road); and the rule keeps `gemm`'s own orientation for a row-major weight,
    /// a single row, more rows than half the columns and a weight under `BLOCK_VALUES`.
    #[test]
    fn transposed_weight_products_through_a_column_major_block_give_flexs_own_bits() {
        for (m, k, n) in [
            (2, 300, 1000),
            (17, 1400, 100),
            (30, 700, 515),
            (64, 1536, 512),
            (100, 300, 1030),
            (256, 300, 600),
        ] {
            let lhs = tensor(m, k, 5);
            let rhs = Flex::float_transpose(tensor(n, k, 6));
            let operands = Operands::of(&lhs, &rhs, [m, k, n]);
            assert!(
                operands.transposed_rhs_for_few_rows(n),
                "{m}×{k}×{n} takes the block"
            );
            let want = values(Flex::float_matmul(lhs.clone(), rhs.clone()).to_contiguous());
            let mut got = vec![f32::NAN; m * n];
            // SAFETY: `got` holds `m · n` values; the tensors are alive.
            unsafe { operands.columns(got.as_mut_ptr(), 0..n, gemm::Parallelism::None) };
            assert!(got == want, "{m}×{k}×{n}: not Flex's bits");
            let run = n / 4..n - 3;
            let mut part: Vec<f32> = want
                .iter()
                .enumerate()
                .map(|(i, &v)| if run.contains(&(i % n)) { f32::NAN } else { v })
                .collect();
            // SAFETY: as above; the run lies within `0..n`.
            unsafe { operands.columns(part.as_mut_ptr(), run.clone(), gemm::Parallelism::None) };
            assert!(part == want, "{m}×{k}×{n}: the run {run:?} differs");
        }
        let takes = |m: usize, k: usize, transposed: bool| {
            let n = 600;
            let rhs = match transposed {
                false => tensor(k, n, 2),
                true => Flex::float_transpose(tensor(n, k, 2)),
            };
            Operands::of(&tensor(m, k, 1), &rhs, [m, k, n]).transposed_rhs_for_few_rows(n)
        };
        assert!(takes(300, 256, true) && !takes(301, 256, true) && !takes(1, 256, true));
        assert!(!takes(50, 256, false) && !takes(50, 200, true));
    }

    /// Few-row products on pools of one and three threads (uneven column runs, a last run
    /// short of a SIMD block, depths cut into chunks and not): against a row-major weight
    /// (the streaming kernel, cut by depth) the same values on both pools and within float
    /// rounding of a float64 product; against a transposed one (the dot kernel up to four rows,
    /// `gemm` above, split by columns) one whole call's values bit for bit; and `matmul` takes
    /// that road.
    #[test]
    fn few_row_products_are_the_same_on_any_pool_and_match_float64() {
        let pools = [1, 3].map(|t| rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap());
        for (m, k, n) in [
            (1, 300, 7003),
            (1, 512, 1536),
            (2, 96, 1000),
            (3, 512, 771),
            (16, 128, 530),
            (5, 40, 100),
            (4, 1400, 130),
            (4, 1400, 200),
        ] {
            let lhs = tensor(m, k, 1);
            for transposed in [false, true] {
                let rhs = match transposed {
                    false => tensor(k, n, 2),
                    true => Flex::float_transpose(tensor(n, k, 2)),
                };
                let on = |pool: &rayon::ThreadPool| {
                    pool.install(|| {
                        let mut got = vec![0f32; m * n];
                        few_rows(&Operands::of(&lhs, &rhs, [m, k, n]), &mut got);
                        got
                    })
                };
                let (one, three) = (on(&pools[0]), on(&pools[1]));
                assert!(one == three, "{m}×{k}×{n}, transposed {transposed}: pools differ");
                let exact = float64(&lhs, &rhs, [m, k, n]);
                for (i, (&got, &(want, scale))) in three.iter().zip(&exact).enumerate() {
                    assert!(
                        (got as f64 - want).abs() <= 1e-6 * scale,
                        "{m}×{k}×{n}, transposed {transposed}, [{i}]: {got} against {want}"
                    );
                }
                if transposed && m <= flex_dot::DOT_ROWS {
                    // The dot kernel's own values over every column in one call.
                    let operands = Operands::of(&lhs, &rhs, [m, k, n]);
                    let mut once = vec![f32::NAN; m * n];
                    // SAFETY: AVX2 is there (the road was taken); `rhs`'s columns are `k`
                    // contiguous values `rhs_strides[1]` apart; `once` holds `m · n` values.
                    unsafe {
                        flex_dot::rows_dot_rows(
                            &operands.lhs_rows(),
                            [m, k],
                            operands.rhs.0,
                            operands.rhs_strides[1] as usize,
                            once.as_mut_ptr(),
                            n,
                            0..n,
                        )
                    };
                    assert!(three == once, "{m}×{k}×{n}: not the dot kernel's one call");
                } else if transposed {
                    assert!(
                        three == whole(&lhs, &rhs, [m, k, n]),
                        "{m}×{k}×{n}: not the whole call's"
                    );
                }
                let routed = pools[1].install(|| values(matmul(lhs.clone(), rhs.clone())));
                assert!(routed == three, "{m}×{k}×{n} through matmul");
            }
        }
    }
}
