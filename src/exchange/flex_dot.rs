//! A few rows times a transposed matrix on x86-64 with AVX2 and FMA: each output value the dot
//! product of a row of `lhs` and a contiguous row of `rhsᵀ` — attention's scores against the
//! cached keys in a decode step (`q · Kᵀ`, the keys' rows contiguous) and a tied head's `x · Eᵀ`.
//!
//! `gemm` runs these products by packing `rhsᵀ`: a strided gather of every key (or of the whole
//! embedding) into a buffer of its own before the first multiply-add, for one to four rows of
//! output. In a decode step of the 163 M Qwen3-MoE, with the cache appended in place, that
//! packing and its products were 4.6% of the step (BENCHMARKS §13m), reading the cache once to
//! pack it and again to multiply. Here each row of `rhsᵀ` is read once, straight from where it
//! lies, into as many dot products as `lhs` has rows.
//!
//! Every output value is the same fold wherever its column falls (a group of columns or the
//! tail, any run of columns, any number of rows): eight lanes of fused multiply-adds over the
//! depth's whole blocks of eight, `acc[l] = fma(lhs[i, 8b + l], rhsᵀ[j, 8b + l], acc[l])` for
//! `b` in order, the lanes summed in one fixed tree, then the depth's last `k mod 8` terms
//! folded in order. Splitting columns over threads therefore changes no bit.

use std::ops::Range;

/// The most rows of `lhs` [`rows_dot_rows`] takes: the kernel keeps every row's accumulators
/// for a group of columns in registers.
pub(crate) const DOT_ROWS: usize = 4;

/// `out[i, j] = Σ_t lhs[i, t] · rhs_t[j, t]` for every row `i < m` and column `j` in `cols`,
/// folded as the module says.
///
/// # Shapes
/// - lhs: `[m, k]` contiguous, `1 ≤ m ≤ DOT_ROWS`; rhs_t: `n` rows of `k` contiguous values,
///   `ld` apart; out: `[m, n]` row-major; `cols` within `0..n`
///
/// # Safety
/// [`available`](super::flex_gemv::available) is true; `rhs_t` points at `cols.end` rows of at
/// least `k` values `ld` apart; `out` points at `m · n` values, and no one else reads or writes
/// `out`'s columns `cols` meanwhile.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn rows_dot_rows(
    lhs: &[f32],
    [m, k]: [usize; 2],
    rhs_t: *const f32,
    ld: usize,
    out: *mut f32,
    n: usize,
    cols: Range<usize>,
) {
    assert!(
        (1..=DOT_ROWS).contains(&m) && lhs.len() >= m * k,
        "{m} rows of {k} for the dot kernel"
    );
    #[cfg(target_arch = "x86_64")]
    {
        let x = lhs.as_ptr();
        match m {
            1 => avx2::dots::<1, 4>(x, k, rhs_t, ld, out, n, cols),
            2 => avx2::dots::<2, 4>(x, k, rhs_t, ld, out, n, cols),
            3 => avx2::dots::<3, 2>(x, k, rhs_t, ld, out, n, cols),
            _ => avx2::dots::<4, 2>(x, k, rhs_t, ld, out, n, cols),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (lhs, k, rhs_t, ld, out, n, cols);
        unreachable!("`available` is false off x86-64, so nothing calls the kernel there");
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// `M` rows against `G` columns at a time (`M · G` chains of multiply-adds side by side,
    /// each column's values loaded once for every row), the columns short of a group one at a
    /// time, with the same fold.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dots<const M: usize, const G: usize>(
        x: *const f32,
        k: usize,
        rhs_t: *const f32,
        ld: usize,
        out: *mut f32,
        n: usize,
        cols: Range<usize>,
    ) {
        let whole = k / 8 * 8;
        let mut j = cols.start;
        while j + G <= cols.end {
            let r: [*const f32; G] = std::array::from_fn(|g| rhs_t.add((j + g) * ld));
            let mut acc = [[_mm256_setzero_ps(); G]; M];
            let mut t = 0;
            while t < whole {
                let w: [__m256; G] = std::array::from_fn(|g| _mm256_loadu_ps(r[g].add(t)));
                for (i, acc) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(i * k + t));
                    for g in 0..G {
                        acc[g] = _mm256_fmadd_ps(xv, w[g], acc[g]);
                    }
                }
                t += 8;
            }
            for (i, acc) in acc.iter().enumerate() {
                for g in 0..G {
                    *out.add(i * n + j + g) = finish(acc[g], x.add(i * k), r[g], whole, k);
                }
            }
            j += G;
        }
        if j < cols.end {
            dots::<M, 1>(x, k, rhs_t, ld, out, n, j..cols.end);
        }
    }

    /// The lanes summed in a fixed tree, `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`,
    /// then the depth's last terms `whole..k` folded in order.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn finish(acc: __m256, x: *const f32, r: *const f32, whole: usize, k: usize) -> f32 {
        let halves = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
        let mut sum = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
        for t in whole..k {
            sum = (*x.add(t)).mul_add(*r.add(t), sum);
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::{rows_dot_rows, DOT_ROWS};
    use crate::exchange::flex_gemv::available;

    /// Against a float64 product for every row count, depths with and without a tail of the
    /// block (and shorter than one block), widths with and without a tail of the group, a row
    /// stride wider than the depth; and computed in uneven runs of columns and each row alone,
    /// bit for bit the same as in one call.
    #[test]
    fn few_rows_dotted_with_rows_match_float64_and_runs_change_no_bit() {
        if !available() {
            return;
        }
        for (k, n, ld) in [(64, 301, 64), (512, 37, 520), (13, 9, 13), (5, 3, 7), (8, 1, 8)] {
            for m in 1..=DOT_ROWS {
                let value =
                    |i: usize, salt: usize| (((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0) - 1.0;
                let lhs: Vec<f32> = (0..m * k).map(|i| value(i, 1)).collect();
                let rhs_t: Vec<f32> = (0..n * ld).map(|i| value(i, 2)).collect();
                let mut whole = vec![f32::NAN; m * n];
                // SAFETY: AVX2 and FMA are there; `rhs_t` has `n` rows of `ld ≥ k` values;
                // `whole` holds `m · n` values.
                unsafe { rows_dot_rows(&lhs, [m, k], rhs_t.as_ptr(), ld, whole.as_mut_ptr(), n, 0..n) };
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|t| lhs[i * k + t] as f64 * rhs_t[j * ld + t] as f64)
                            .sum();
                        let got = whole[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{m}×{k}×{n} [{i}, {j}]: {got} against {want}"
                        );
                    }
                }
                let mut split = vec![f32::NAN; m * n];
                let cuts = [0, n / 3, n / 3 + 1, n];
                for w in cuts.windows(2) {
                    // SAFETY: as above; the runs are disjoint.
                    unsafe {
                        rows_dot_rows(
                            &lhs,
                            [m, k],
                            rhs_t.as_ptr(),
                            ld,
                            split.as_mut_ptr(),
                            n,
                            w[0]..w[1],
                        )
                    };
                }
                assert!(split == whole, "{m}×{k}×{n}: runs differ from one call");
                for i in 0..m {
                    let mut alone = vec![f32::NAN; n];
                    // SAFETY: as above, one row of `lhs`.
                    unsafe {
                        rows_dot_rows(
                            &lhs[i * k..(i + 1) * k],
                            [1, k],
                            rhs_t.as_ptr(),
                            ld,
                            alone.as_mut_ptr(),
                            n,
                            0..n,
                        )
                    };
                    assert!(
                        alone[..] == whole[i * n..(i + 1) * n],
                        "{m}×{k}×{n}: row {i} alone differs"
                    );
                }
            }
        }
    }
}
