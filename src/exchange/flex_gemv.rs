//! A few rows times a row-major matrix on x86-64 with AVX2 and FMA: the decode step's products
//! (an expert's share of one token, or of a few), which are bound by reading the matrix.
//!
//! `gemm` (the crate Flex calls) runs products of 2 to 16 rows through its general kernel,
//! whose packing costs more than the product when the matrix is an expert's weight and the
//! rows are a few tokens. Here each block of eight matrix rows is read once and added, row
//! after row of `lhs`, into the output's columns, which stay in the L1 cache. Measured in a
//! scratch benchmark on this project's VM (single thread, median of 400 over 24 distinct
//! weights, µs, this kernel against `gemm`): 2×512×1536 341 / 813, 8×512×1536 630 / 1,366,
//! 8×768×512 413 / 899; but 1×768×512 265 / 221, and for one row the layer's decode step was
//! no faster with it (`peer decode`, three alternating runs), so one row stays with `gemm`'s
//! vector-matrix kernel (the caller's choice, `flex_gemm.rs`).
//!
//! Every output value is the same fold in the same order wherever its column falls (a vector
//! lane or the scalar tail, any run of columns): `acc = fma(lhs[i, k], rhs[k, j], acc)` for
//! `k = 0, 1, …` from zero. Splitting columns over threads therefore changes no bit.

use std::ops::Range;

/// Whether this CPU runs [`rows_times_matrix`] (AVX2 and FMA, detected once per call: the
/// check reads a cached word).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[i, j] += Σ_{t ∈ ks} lhs[i, t] · rhs[t, j]` for every row `i < m` and column `j` in
/// `cols`, folded over `t` in order.
///
/// # Shapes
/// - lhs: `[m, k]` contiguous; rhs: `k` rows of row stride `ld_rhs` (unit column stride);
///   out: `[m, n]` row-major; `ks` within `0..k`
///
/// # Safety
/// [`available`] is true; `rhs` points at a matrix with `k` rows of at least `cols.end`
/// values `ld_rhs` apart; `out` points at `m · n` values, `cols.end ≤ n`, and no one else
/// reads or writes `out`'s columns `cols` meanwhile.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rows_times_matrix(
    lhs: &[f32],
    [m, k]: [usize; 2],
    ks: Range<usize>,
    rhs: *const f32,
    ld_rhs: usize,
    out: *mut f32,
    n: usize,
    cols: Range<usize>,
) {
    #[cfg(target_arch = "x86_64")]
    avx2::rows_times_matrix(lhs, [m, k], ks, rhs, ld_rhs, out, n, cols);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (lhs, m, k, ks, rhs, ld_rhs, out, n, cols);
        unreachable!("`available` is false off x86-64, so nothing calls the kernel there");
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// Matrix rows read per pass over the output's columns.
    const BLOCK: usize = 8;

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows_times_matrix(
        lhs: &[f32],
        [m, k]: [usize; 2],
        ks: Range<usize>,
        rhs: *const f32,
        ld_rhs: usize,
        out: *mut f32,
        n: usize,
        cols: Range<usize>,
    ) {
        let vector_end = cols.start + (cols.len() / 8) * 8;
        let mut k0 = ks.start;
        while k0 < ks.end {
            let rows = BLOCK.min(ks.end - k0);
            let row = |t: usize| rhs.add((k0 + t) * ld_rhs);
            let mut j = cols.start;
            while j < vector_end {
                if rows == BLOCK {
                    let w: [__m256; BLOCK] = std::array::from_fn(|t| _mm256_loadu_ps(row(t).add(j)));
                    for i in 0..m {
                        let x = lhs.as_ptr().add(i * k + k0);
                        let at = out.add(i * n + j);
                        let mut acc = _mm256_loadu_ps(at);
                        for (t, w) in w.iter().enumerate() {
                            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&*x.add(t)), *w, acc);
                        }
                        _mm256_storeu_ps(at, acc);
                    }
                } else {
                    for i in 0..m {
                        let x = lhs.as_ptr().add(i * k + k0);
                        let at = out.add(i * n + j);
                        let mut acc = _mm256_loadu_ps(at);
                        for t in 0..rows {
                            let w = _mm256_loadu_ps(row(t).add(j));
                            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&*x.add(t)), w, acc);
                        }
                        _mm256_storeu_ps(at, acc);
                    }
                }
                j += 8;
            }
            // The columns short of a vector: the same fused multiply-adds, one lane at a time.
            for j in vector_end..cols.end {
                for i in 0..m {
                    let x = lhs.as_ptr().add(i * k + k0);
                    let at = out.add(i * n + j);
                    let mut acc = *at;
                    for t in 0..rows {
                        acc = (*x.add(t)).mul_add(*row(t).add(j), acc);
                    }
                    *at = acc;
                }
            }
            k0 += rows;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{available, rows_times_matrix};

    /// Against a float64 product, for row counts 1 to 16, depths and widths that are not
    /// multiples of the block or the vector (and a row stride wider than the columns); and
    /// computed in column runs of uneven width, each over the depth in two calls, bit for bit
    /// the same as in one run.
    #[test]
    fn few_rows_times_a_matrix_match_float64_and_split_runs_change_no_bit() {
        if !available() {
            return;
        }
        for (m, k, n, ld) in [
            (1, 512, 1536, 1536),
            (3, 45, 37, 50),
            (16, 9, 203, 203),
            (2, 7, 5, 5),
        ] {
            let value = |i: usize, salt: usize| (((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0) - 1.0;
            let lhs: Vec<f32> = (0..m * k).map(|i| value(i, 1)).collect();
            let rhs: Vec<f32> = (0..k * ld).map(|i| value(i, 2)).collect();
            let mut whole = vec![0f32; m * n];
            // SAFETY: AVX2 and FMA are there; `rhs` has `k` rows of `ld ≥ n` values; `whole`
            // holds `m · n` zeros.
            unsafe { rows_times_matrix(&lhs, [m, k], 0..k, rhs.as_ptr(), ld, whole.as_mut_ptr(), n, 0..n) };
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|t| lhs[i * k + t] as f64 * rhs[t * ld + j] as f64)
                        .sum();
                    let got = whole[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{m}×{k}×{n} [{i}, {j}]"
                    );
                }
            }
            // Column runs, each folding the depth in two consecutive ranges: the same folds.
            let mut split = vec![0f32; m * n];
            let cuts = [0, n / 3, n / 3 + 1, n];
            for w in cuts.windows(2) {
                for ks in [0..k / 2, k / 2..k] {
                    // SAFETY: as above; the runs are disjoint.
                    unsafe {
                        rows_times_matrix(
                            &lhs,
                            [m, k],
                            ks,
                            rhs.as_ptr(),
                            ld,
                            split.as_mut_ptr(),
                            n,
                            w[0]..w[1],
                        )
                    };
                }
            }
            assert!(split == whole, "{m}×{k}×{n}: runs differ from one run");
        }
    }
}
