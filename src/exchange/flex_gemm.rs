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
//! A product of few rows (an expert's share of a decode step: one to a few tokens) splits its
//! columns over the threads instead, see [`few_rows`]; from two rows against a row-major
//! weight, each run is the streaming kernel of `flex_gemv.rs` rather than a `gemm` call.

use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorData};

use super::flex_gemv;

/// Flex's threshold (burn-flex 0.21 `ops/matmul.rs` `PARALLEL_THRESHOLD`): products of at
/// least this many multiply-adds run on every core.
const PARALLEL_THRESHOLD: usize = 192 * 192 * 192;

/// Products of at most this many rows run as [`few_rows`] does.
const FEW_ROWS: usize = 16;

/// A product of 2 to [`FEW_ROWS`] rows splits its columns over the pool's threads when its
/// `rhs` holds at least this many values (256 KiB).
const SPLIT_VALUES: usize = 1 << 16;

/// A product of one row splits only from this many values of `rhs` (8 MiB): `gemm`'s
/// vector-matrix kernel reads an expert-sized `rhs` faster on one thread than the hand-off
/// to two costs (see [`few_rows`]).
const SPLIT_VALUES_ONE_ROW: usize = 1 << 21;

/// The fewest columns one thread of a split takes.
const MIN_SPLIT_COLUMNS: usize = 64;

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
    let plain = |t: &FlexTensor| t.dtype() == DType::F32 && t.layout().strides().iter().all(|&s| s >= 0);
    // Other dtypes, ranks and flipped (negative-stride) views: Flex's matmul.
    if !(plain(&lhs) && plain(&rhs)) || l.len() != 2 || r.len() != 2 {
        return Flex::float_matmul(lhs, rhs);
    }
    let (m, k, n) = (l[0], l[1], r[1]);
    assert_eq!(k, r[0], "expert matmul: inner dimensions {k} and {} differ", r[0]);
    let mut out = vec![0f32; m * n];
    let operands = Operands::of(&lhs, &rhs, [m, k, n]);
    if m * n > 0 && m <= FEW_ROWS {
        few_rows(&operands, &mut out);
    } else if m * n > 0 {
        let parallelism = match m.saturating_mul(n).saturating_mul(k) >= PARALLEL_THRESHOLD {
            true => gemm::Parallelism::Rayon(0),
            false => gemm::Parallelism::None,
        };
        // SAFETY: `out` holds `m · n` values and is not touched elsewhere meanwhile.
        unsafe { operands.columns(out.as_mut_ptr(), 0..n, parallelism) };
    }
    FlexTensor::from_data(TensorData::new(out, Shape::new([m, n])))
}

/// `out = lhs · rhs` for `m ≤ FEW_ROWS` rows, its columns split over the pool's threads
/// where `rhs` is large: one single-threaded `gemm` call a run of columns, each writing its own
/// columns of `out`.
///
/// A decode step's products have a few rows (an expert's share of one token a row), so their
/// multiply-adds stay under Flex's parallel threshold and ran on one core while the pool
/// waited, though reading `rhs` (an expert's weight, MBs) is their cost. `gemm`'s own
/// `Parallelism::Rayon` for them was uneven, and its vector-matrix kernel (one row) never
/// splits. Measured on this project's 2-vCPU VM (release, 2 threads, median of 200 over 24
/// distinct weights, µs, whole call against the split): 2×512×1536 924 → 569, 3×768×512
/// 491 → 274, 8×512×1536 1,881 → 1,105, 1×512×8192 1,838 → 1,176; but 1×512×1536 372 → 440
/// and 1×768×512 177 → 240, so one row splits only from [`SPLIT_VALUES_ONE_ROW`] on.
///
/// The values are the whole call's bit for bit wherever it was compared (one to sixteen rows,
/// row-major and transposed weights, runs of uneven width: the unit test below).
fn few_rows(operands: &Operands, out: &mut [f32]) {
    use rayon::prelude::*;

    let [m, k, n] = operands.mkn;
    let threshold = if m == 1 {
        SPLIT_VALUES_ONE_ROW
    } else {
        SPLIT_VALUES
    };
    let threads = match k.saturating_mul(n) >= threshold {
        true => rayon::current_num_threads().min(n / MIN_SPLIT_COLUMNS).max(1),
        false => 1,
    };
    // Runs of columns in multiples of 16 (whole SIMD blocks), the last one shorter.
    let run = n.div_ceil(threads).next_multiple_of(16).min(n);
    let out_ptr = Shared(out.as_mut_ptr() as *const f32);
    // Two or more rows against a row-major weight (a batched decode step's, a prefill's:
    // unit column stride) go to the streaming kernel where the CPU has it, with `lhs`'s few
    // rows copied together first. One row stays with `gemm`'s vector-matrix kernel, which
    // the streaming one did not beat in the layer (design notes: "Few-row products ...").
    let streamed =
        (m >= 2 && operands.rhs_strides[1] == 1 && operands.rhs_strides[0] >= 0 && flex_gemv::available())
            .then(|| operands.lhs_rows());
    let columns = |j0: usize| {
        let cols = j0..(j0 + run).min(n);
        // SAFETY: each run writes only its own columns of `out`, so runs on other threads
        // never touch the same values, and nothing else touches `out` meanwhile; `out` is
        // zero on entry; the kernel is available where `streamed` is made, and `rhs` has `k`
        // rows of `n` values `rhs_strides[0]` apart (the caller's operands).
        unsafe {
            match &streamed {
                Some(lhs) => flex_gemv::rows_times_matrix(
                    lhs,
                    [m, k],
                    operands.rhs.0,
                    operands.rhs_strides[0] as usize,
                    out_ptr.as_mut(),
                    n,
                    cols,
                ),
                None => operands.columns(out_ptr.as_mut(), cols, gemm::Parallelism::None),
            }
        }
    };
    match threads {
        1 => columns(0),
        _ => (0..n)
            .step_by(run)
            .collect::<Vec<_>>()
            .into_par_iter()
            .for_each(columns),
    }
}

/// The two `f32` operands of one product, as `gemm` reads them: where their views start, their
/// strides, and `[m, k, n]`.
struct Operands {
    lhs: Shared<f32>,
    rhs: Shared<f32>,
    lhs_strides: [isize; 2],
    rhs_strides: [isize; 2],
    mkn: [usize; 3],
}

impl Operands {
    /// The views of `lhs` `[m, k]` and `rhs` `[k, n]`, whose strides the caller has checked to
    /// be non-negative. The tensors must outlive the value.
    fn of(lhs: &FlexTensor, rhs: &FlexTensor, mkn: [usize; 3]) -> Self {
        let start = |t: &FlexTensor| Shared(t.storage::<f32>()[t.layout().start_offset()..].as_ptr());
        let strides = |t: &FlexTensor| [t.layout().strides()[0], t.layout().strides()[1]];
        Self {
            lhs: start(lhs),
            rhs: start(rhs),
            lhs_strides: strides(lhs),
            rhs_strides: strides(rhs),
            mkn,
        }
    }

    /// `lhs`'s `[m, k]` values, row-major and contiguous.
    fn lhs_rows(&self) -> Vec<f32> {
        let ([m, k, _], [l0, l1]) = (self.mkn, self.lhs_strides);
        let mut rows = Vec::with_capacity(m * k);
        for i in 0..m {
            for t in 0..k {
                // SAFETY: the view's elements lie inside its storage (`of`'s contract).
                rows.push(unsafe { *self.lhs.0.offset(i as isize * l0 + t as isize * l1) });
            }
        }
        rows
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
        gemm::gemm(
            m,
            cols.len(),
            k,
            out.add(cols.start),
            1,
            n as isize,
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
    }
}

/// A pointer handed to the pool's threads, each of which uses its own disjoint part of what
/// it points to (see [`few_rows`]).
struct Shared<T>(*const T);

impl Shared<f32> {
    fn as_mut(&self) -> *mut f32 {
        self.0 as *mut f32
    }
}

// SAFETY: the threads of `few_rows` read the operands, which nobody writes meanwhile, and
// write disjoint runs of the output's columns.
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

#[cfg(test)]
mod tests {
    use burn::backend::flex::{Flex, FlexTensor};
    use burn::tensor::ops::FloatTensorOps;
    use burn::tensor::TensorData;

    use super::{few_rows, matmul, Operands};

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

    /// Few-row products split over a pool of three threads (uneven runs, a last run short of
    /// a SIMD block) give the whole call's values bit for bit, for row-major and transposed
    /// weights, one row (split from its larger threshold on) to sixteen; and `matmul` takes
    /// that road.
    #[test]
    fn split_columns_give_the_whole_products_values_bit_for_bit() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        pool.install(|| {
            for (m, k, n) in [
                (1, 300, 7003),
                (2, 96, 1000),
                (3, 512, 771),
                (16, 128, 530),
                (5, 40, 100),
            ] {
                let lhs = tensor(m, k, 1);
                for transposed in [false, true] {
                    let rhs = match transposed {
                        false => tensor(k, n, 2),
                        true => Flex::float_transpose(tensor(n, k, 2)),
                    };
                    let want = whole(&lhs, &rhs, [m, k, n]);
                    let mut got = vec![0f32; m * n];
                    few_rows(&Operands::of(&lhs, &rhs, [m, k, n]), &mut got);
                    assert!(got == want, "{m}×{k}×{n}, transposed weight {transposed}");
                    assert!(
                        values(matmul(lhs.clone(), rhs)) == want,
                        "{m}×{k}×{n} through matmul"
                    );
                }
            }
        });
    }
}
