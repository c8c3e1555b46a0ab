//! A few rows times a row-major matrix on x86-64 with AVX2 and FMA: the decode step's products
//! (an expert's share of one token, or of a few; a projection of one token per prompt), which
//! are bound by reading the matrix.
//!
//! `gemm` (the crate Flex calls) runs products of 2 to 16 rows through its general kernel,
//! whose packing costs more than the product when the matrix is an expert's weight and the
//! rows are a few tokens. Here each block of eight matrix rows is read once and added, row
//! after row of `lhs`, into the output's columns, which stay in the L1 cache. Measured in a
//! scratch benchmark on this project's VM (single thread, median of 400 over 24 distinct
//! weights, µs, this kernel against `gemm`): 2×512×1536 341 / 813, 8×512×1536 630 / 1,366,
//! 8×768×512 413 / 899. One row has a kernel of its own (`avx2_one_row`), faster than both
//! `gemm`'s vector-matrix kernel and the general one here on a decode step's products. Where
//! the CPU has AVX-512, the columns filling its vectors go to `flex_gemv_avx512` instead.
//!
//! Every output value is the same fold in the same order wherever its column falls (a vector
//! lane or the scalar tail, any run of columns, one row or many): `acc = fma(lhs[i, k],
//! rhs[k, j], acc)` for `k` over the range asked, in order, from what `out` holds. Splitting
//! columns over threads therefore changes no bit, and folding a depth range in two
//! consecutive calls is the same as in one.

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
/// `cols`, folded over `t` in order; with `fresh`, `out[i, j] = Σ …`, the fold starting from
/// zero (bit for bit what it gives on an `out` of zeros) and `out`'s values in `cols` only
/// written, so that the caller need not zero them first. With `finish`, the fold's result is
/// added into `finish[i, j]` (`finish += Σ …`, one rounding, as [`add_partials`] adds it)
/// instead of stored in `out`, which then holds only the fold's partial sums before its last
/// block of depth: a chunk of depth added into the product at once, without a pass of its own.
///
/// # Shapes
/// - lhs: `[m, k]` contiguous; rhs: `k` rows of row stride `ld_rhs` (unit column stride);
///   out: `[m, n]` row-major; `ks` within `0..k`
///
/// # Safety
/// [`available`] is true; `rhs` points at a matrix with `k` rows of at least `cols.end`
/// values `ld_rhs` apart; `out` (and `finish`, where given) point at `m · n` values,
/// `cols.end ≤ n`, and no one else reads or writes their columns `cols` meanwhile.
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
    fresh: bool,
    finish: Option<*mut f32>,
) {
    #[cfg(target_arch = "x86_64")]
    {
        // The columns filling vectors of sixteen on AVX-512 where the CPU has it (the same
        // folds: one row on a kernel of its own, as on AVX2), the rest here.
        let wide = super::flex_gemv_avx512::available();
        let cols = match (m, wide) {
            (1, true) => {
                let end = super::flex_gemv_avx512::one_row(
                    lhs.as_ptr(),
                    ks.clone(),
                    rhs,
                    ld_rhs,
                    [out, finish.unwrap_or(std::ptr::null_mut())],
                    cols.clone(),
                    fresh,
                );
                end..cols.end
            }
            (_, true) => {
                let end = super::flex_gemv_avx512::whole_vectors(
                    lhs,
                    [m, k],
                    ks.clone(),
                    rhs,
                    ld_rhs,
                    out,
                    n,
                    cols.clone(),
                    fresh,
                    finish,
                );
                end..cols.end
            }
            (_, false) => cols,
        };
        if !cols.is_empty() {
            avx2::rows_times_matrix(lhs, [m, k], ks, rhs, ld_rhs, out, n, cols, fresh, finish);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (lhs, m, k, ks, rhs, ld_rhs, out, n, cols, fresh, finish);
        unreachable!("`available` is false off x86-64, so nothing calls the kernel there");
    }
}

/// `out[j] = ((out[j] + partials[0][j]) + partials[1][j]) + …`: the depth chunks' partial
/// products added into the first chunk's, in chunk order, each value's sum the same whether a
/// vector lane or the scalar tail adds it. One pass over `out` for every partial (the
/// compiler's own loop, a partial at a time, was SSE and read `out` once per partial: 1% of a
/// decode step, most of it the head's seven partials of 8,192 values).
///
/// # Shapes
/// - out: `[len]`; partials: `[n_partials · len]`
pub(crate) fn add_partials(out: &mut [f32], partials: &[f32]) {
    let len = out.len();
    if len == 0 || partials.is_empty() {
        return;
    }
    assert_eq!(partials.len() % len, 0, "partials of {len} values each");
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: AVX2 is there (`available`); the lengths were checked above.
        return unsafe { avx2_sums::add_partials(out, partials) };
    }
    for (j, o) in out.iter_mut().enumerate() {
        for partial in partials.chunks_exact(len) {
            *o += partial[j];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2_sums {
    use std::arch::x86_64::*;

    /// [`add_partials`](super::add_partials) eight values a step.
    ///
    /// # Safety
    /// AVX2 is available; `partials.len()` is a multiple of `out.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn add_partials(out: &mut [f32], partials: &[f32]) {
        let len = out.len();
        let count = partials.len() / len;
        let vector_end = len / 8 * 8;
        let (o, p) = (out.as_mut_ptr(), partials.as_ptr());
        let mut j = 0;
        while j < vector_end {
            let mut acc = _mm256_loadu_ps(o.add(j));
            for c in 0..count {
                acc = _mm256_add_ps(acc, _mm256_loadu_ps(p.add(c * len + j)));
            }
            _mm256_storeu_ps(o.add(j), acc);
            j += 8;
        }
        for j in vector_end..len {
            for c in 0..count {
                *o.add(j) += *p.add(c * len + j);
            }
        }
    }
}

/// Eight values of `out` at `$at`, or zeros where the fold is fresh and this is its first
/// block (`$zero`): the accumulators both kernels start a block from.
#[cfg(target_arch = "x86_64")]
macro_rules! load_or_zero {
    ($zero:expr, $at:expr) => {
        if $zero {
            _mm256_setzero_ps()
        } else {
            _mm256_loadu_ps($at)
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::avx2_one_row::one_row;

    /// Matrix rows read per pass over the output's columns.
    pub(super) const BLOCK: usize = 8;

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
        fresh: bool,
        finish: Option<*mut f32>,
    ) {
        if m == 1 {
            return one_row(
                lhs.as_ptr(),
                ks,
                rhs,
                ld_rhs,
                [out, finish.unwrap_or(std::ptr::null_mut())],
                cols,
                fresh,
            );
        }
        let vector_end = cols.start + (cols.len() / 8) * 8;
        let mut k0 = ks.start;
        while k0 < ks.end {
            let rows = BLOCK.min(ks.end - k0);
            // The first block of a fresh fold starts from zero instead of what `out` holds.
            let zero = fresh && k0 == ks.start;
            // The last block of a finished fold adds its result into `finish`.
            let finish = finish.filter(|_| k0 + rows >= ks.end);
            macro_rules! store {
                ($offset:expr, $acc:expr) => {
                    match finish {
                        Some(f) => _mm256_storeu_ps(
                            f.add($offset),
                            _mm256_add_ps(_mm256_loadu_ps(f.add($offset)), $acc),
                        ),
                        None => _mm256_storeu_ps(out.add($offset), $acc),
                    }
                };
            }
            let row = |t: usize| rhs.add((k0 + t) * ld_rhs);
            let mut j = cols.start;
            while j < vector_end {
                if rows == BLOCK {
                    let w: [__m256; BLOCK] = std::array::from_fn(|t| _mm256_loadu_ps(row(t).add(j)));
                    for i in 0..m {
                        let x = lhs.as_ptr().add(i * k + k0);
                        let mut acc = load_or_zero!(zero, out.add(i * n + j));
                        for (t, w) in w.iter().enumerate() {
                            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&*x.add(t)), *w, acc);
                        }
                        store!(i * n + j, acc);
                    }
                } else {
                    for i in 0..m {
                        let x = lhs.as_ptr().add(i * k + k0);
                        let mut acc = load_or_zero!(zero, out.add(i * n + j));
                        for t in 0..rows {
                            let w = _mm256_loadu_ps(row(t).add(j));
                            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&*x.add(t)), w, acc);
                        }
                        store!(i * n + j, acc);
                    }
                }
                j += 8;
            }
            // The columns short of a vector: the same fused multiply-adds, one lane at a time.
            for j in vector_end..cols.end {
                for i in 0..m {
                    let x = lhs.as_ptr().add(i * k + k0);
                    let at = out.add(i * n + j);
                    let mut acc = if zero { 0.0 } else { *at };
                    for t in 0..rows {
                        acc = (*x.add(t)).mul_add(*row(t).add(j), acc);
                    }
                    match finish {
                        Some(f) => *f.add(i * n + j) += acc,
                        None => *at = acc,
                    }
                }
            }
            k0 += rows;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2_one_row {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::avx2::BLOCK;

    /// [`rows_times_matrix`](super::rows_times_matrix) for one row: the block's eight input
    /// values broadcast once per block rather than once per column step, and two output
    /// vectors per step (two independent chains of fused multiply-adds). The same fold per
    /// output value as the general kernel, so the same bits. Scratch benchmark of one decode
    /// step's products (105 MB of weights, one thread, six alternating runs, medians, ms):
    /// this 10.7, the general kernel 13.2, `gemm` 12.5.
    ///
    /// # Safety
    /// As [`rows_times_matrix`](super::rows_times_matrix) with `m = 1`: `x` holds the row;
    /// `finish` is that call's `finish`, null for none.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn one_row(
        x: *const f32,
        ks: Range<usize>,
        rhs: *const f32,
        ld_rhs: usize,
        [out, finish]: [*mut f32; 2],
        cols: Range<usize>,
        fresh: bool,
    ) {
        let pair_end = cols.start + (cols.len() / 16) * 16;
        let mut k0 = ks.start;
        while k0 < ks.end {
            let rows = BLOCK.min(ks.end - k0);
            let row = |t: usize| rhs.add((k0 + t) * ld_rhs);
            // The first block of a fresh fold starts from zero instead of what `out` holds.
            let zero = fresh && k0 == ks.start;
            let scalar = |at: *const f32| if zero { 0.0 } else { *at };
            // The last block of a finished fold adds its result into `finish`.
            let last = !finish.is_null() && k0 + rows >= ks.end;
            macro_rules! store {
                ($j:expr, $acc:expr) => {
                    match last {
                        true => _mm256_storeu_ps(
                            finish.add($j),
                            _mm256_add_ps(_mm256_loadu_ps(finish.add($j)), $acc),
                        ),
                        false => _mm256_storeu_ps(out.add($j), $acc),
                    }
                };
            }
            let store_scalar = |j: usize, a: f32| match last {
                true => *finish.add(j) += a,
                false => *out.add(j) = a,
            };
            if rows == BLOCK {
                let xs: [__m256; BLOCK] = std::array::from_fn(|t| _mm256_broadcast_ss(&*x.add(k0 + t)));
                let r: [*const f32; BLOCK] = std::array::from_fn(row);
                let mut j = cols.start;
                while j < pair_end {
                    let (mut a0, mut a1) = (
                        load_or_zero!(zero, out.add(j)),
                        load_or_zero!(zero, out.add(j + 8)),
                    );
                    for t in 0..BLOCK {
                        a0 = _mm256_fmadd_ps(xs[t], _mm256_loadu_ps(r[t].add(j)), a0);
                        a1 = _mm256_fmadd_ps(xs[t], _mm256_loadu_ps(r[t].add(j + 8)), a1);
                    }
                    store!(j, a0);
                    store!(j + 8, a1);
                    j += 16;
                }
                if j + 8 <= cols.end {
                    let mut a = load_or_zero!(zero, out.add(j));
                    for t in 0..BLOCK {
                        a = _mm256_fmadd_ps(xs[t], _mm256_loadu_ps(r[t].add(j)), a);
                    }
                    store!(j, a);
                    j += 8;
                }
                for j in j..cols.end {
                    let mut a = scalar(out.add(j));
                    for (t, r) in r.iter().enumerate() {
                        a = (*x.add(k0 + t)).mul_add(*r.add(j), a);
                    }
                    store_scalar(j, a);
                }
            } else {
                // The depth's last rows, fewer than a block: one fused multiply-add per value
                // and row, rows in order.
                for j in cols.clone() {
                    let mut a = scalar(out.add(j));
                    for t in 0..rows {
                        a = (*x.add(k0 + t)).mul_add(*row(t).add(j), a);
                    }
                    store_scalar(j, a);
                }
            }
            k0 += rows;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{add_partials, available, rows_times_matrix};

    /// The vector sum against the scalar one, in chunk order, bit for bit: lengths with and
    /// without a scalar tail, one to seven partials, values whose sums round differently in
    /// another order.
    #[test]
    fn partials_add_in_chunk_order_bit_for_bit() {
        for (len, count) in [(1, 1), (8, 3), (13, 7), (8192, 7), (1541, 2)] {
            let value = |i: usize| ((i * 7919 % 2003) as f32 - 1000.0) * 1.37e-3 * (1 + i % 5) as f32;
            let partials: Vec<f32> = (0..len * count).map(|i| value(i + 17)).collect();
            let start: Vec<f32> = (0..len).map(|i| value(i) * 1e3).collect();
            let mut want = start.clone();
            for (j, w) in want.iter_mut().enumerate() {
                for c in 0..count {
                    *w += partials[c * len + j];
                }
            }
            let mut got = start;
            add_partials(&mut got, &partials);
            assert!(got == want, "{len} × {count}");
        }
    }

    /// One product of the tests: `[m, k]` rows against `k` rows of `ld ≥ n` values.
    struct Case {
        mkn: [usize; 3],
        ld: usize,
        lhs: Vec<f32>,
        rhs: Vec<f32>,
    }

    /// The signature `rows_times_matrix` and the AVX2 kernel share.
    type Kernel = unsafe fn(
        &[f32],
        [usize; 2],
        std::ops::Range<usize>,
        *const f32,
        usize,
        *mut f32,
        usize,
        std::ops::Range<usize>,
        bool,
        Option<*mut f32>,
    );

    /// Row counts 1 to 16, depths and widths that are not multiples of the block or the
    /// vector, a row stride wider than the columns.
    fn cases() -> Vec<Case> {
        let value = |i: usize, salt: usize| (((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0) - 1.0;
        [
            (1, 512, 1536, 1536),
            (2, 100, 1555, 1560),
            (3, 45, 37, 50),
            (16, 9, 203, 203),
            (2, 7, 5, 5),
            (1, 13, 100, 100),
            (1, 24, 200, 210),
        ]
        .into_iter()
        .map(|(m, k, n, ld)| Case {
            mkn: [m, k, n],
            ld,
            lhs: (0..m * k).map(|i| value(i, 1)).collect(),
            rhs: (0..k * ld).map(|i| value(i, 2)).collect(),
        })
        .collect()
    }

    impl Case {
        /// The columns' uneven runs the tests cut the product into.
        fn cuts(&self) -> [usize; 4] {
            let n = self.mkn[2];
            [0, n / 3, n / 3 + 1, n]
        }

        /// `rows_times_matrix` over rows `rows` of `lhs` (their product into `out`, `[rows,
        /// n]`), depth `ks`, columns `cols`.
        fn fold(
            &self,
            rows: std::ops::Range<usize>,
            ks: std::ops::Range<usize>,
            cols: std::ops::Range<usize>,
            out: &mut [f32],
            fresh: bool,
            finish: Option<&mut [f32]>,
        ) {
            self.fold_on(rows_times_matrix, rows, ks, cols, out, fresh, finish)
        }

        /// [`Case::fold`] on `kernel`: `rows_times_matrix` or one of the kernels it picks from.
        #[allow(clippy::too_many_arguments)]
        fn fold_on(
            &self,
            kernel: Kernel,
            rows: std::ops::Range<usize>,
            ks: std::ops::Range<usize>,
            cols: std::ops::Range<usize>,
            out: &mut [f32],
            fresh: bool,
            finish: Option<&mut [f32]>,
        ) {
            let [_, k, n] = self.mkn;
            assert!(out.len() == rows.len() * n && finish.as_ref().is_none_or(|f| f.len() == out.len()));
            // SAFETY: AVX2 and FMA are there (the tests' first check); `rhs` has `k` rows of
            // `ld ≥ n` values; `out` (and `finish`) hold the rows' `n` values each, this
            // call's alone.
            unsafe {
                kernel(
                    &self.lhs[rows.start * k..rows.end * k],
                    [rows.len(), k],
                    ks,
                    self.rhs.as_ptr(),
                    self.ld,
                    out.as_mut_ptr(),
                    n,
                    cols,
                    fresh,
                    finish.map(|f| f.as_mut_ptr()),
                )
            }
        }

        /// The whole product in one call, folded onto zeros.
        fn whole(&self) -> Vec<f32> {
            let [m, k, n] = self.mkn;
            let mut out = vec![0f32; m * n];
            self.fold(0..m, 0..k, 0..n, &mut out, false, None);
            out
        }
    }

    /// Against a float64 product; computed in column runs of uneven width, each over the depth
    /// in two calls, bit for bit the same as in one call; and each row alone (the one-row
    /// kernel) bit for bit its row of the many-row product.
    #[test]
    fn few_rows_times_a_matrix_match_float64_and_split_runs_change_no_bit() {
        if !available() {
            return;
        }
        for case in cases() {
            let ([m, k, n], ld) = (case.mkn, case.ld);
            let whole = case.whole();
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|t| case.lhs[i * k + t] as f64 * case.rhs[t * ld + j] as f64)
                        .sum();
                    let got = whole[i * n + j] as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "{m}×{k}×{n} [{i}, {j}]"
                    );
                }
            }
            let mut split = vec![0f32; m * n];
            for w in case.cuts().windows(2) {
                for ks in [0..k / 2, k / 2..k] {
                    case.fold(0..m, ks, w[0]..w[1], &mut split, false, None);
                }
            }
            assert!(split == whole, "{m}×{k}×{n}: runs differ from one run");
            for i in 0..m {
                let mut alone = vec![0f32; n];
                case.fold(i..i + 1, 0..k, 0..n, &mut alone, false, None);
                assert!(
                    alone[..] == whole[i * n..(i + 1) * n],
                    "{m}×{k}×{n}: row {i} alone differs"
                );
            }
        }
    }

    /// A fresh fold over values that are not zeros (NaN: any read of them shows) gives the fold
    /// over zeros bit for bit, in column runs and each row alone; and a fresh fold finished into
    /// a product adds its result there as [`add_partials`] adds it: the product folded onto a
    /// base against the base plus the product, bit for bit, whatever the scratch held.
    #[test]
    fn fresh_and_finished_folds_give_the_plain_folds_bits() {
        if !available() {
            return;
        }
        for case in cases() {
            let [m, k, n] = case.mkn;
            let whole = case.whole();
            let mut fresh = vec![f32::NAN; m * n];
            for w in case.cuts().windows(2) {
                case.fold(0..m, 0..k, w[0]..w[1], &mut fresh, true, None);
            }
            assert!(fresh == whole, "{m}×{k}×{n}: a fresh fold differs");
            let base: Vec<f32> = (0..m * n).map(|i| ((i * 31 % 97) as f32 - 48.0) * 2.5).collect();
            let mut want = base.clone();
            add_partials(&mut want, &whole);
            let mut finished = base.clone();
            let mut scratch = vec![f32::NAN; m * n];
            for w in case.cuts().windows(2) {
                case.fold(0..m, 0..k, w[0]..w[1], &mut scratch, true, Some(&mut finished));
            }
            assert!(finished == want, "{m}×{k}×{n}: a finished fold differs");
            for i in 0..m {
                let mut alone = vec![f32::NAN; n];
                case.fold(i..i + 1, 0..k, 0..n, &mut alone, true, None);
                assert!(
                    alone[..] == whole[i * n..(i + 1) * n],
                    "{m}×{k}×{n}: row {i} fresh differs"
                );
                let mut alone = base[i * n..(i + 1) * n].to_vec();
                let mut scratch = vec![f32::NAN; n];
                case.fold(i..i + 1, 0..k, 0..n, &mut scratch, true, Some(&mut alone));
                assert!(
                    alone[..] == want[i * n..(i + 1) * n],
                    "{m}×{k}×{n}: row {i} finished differs"
                );
            }
        }
    }

    /// Whatever kernel the CPU's vectors pick (AVX-512's where it has them, one row or many)
    /// gives the AVX2 kernel's bits: folded onto a base, fresh over NaN, and finished into a
    /// base, in column runs of uneven width.
    #[test]
    fn the_wider_kernels_give_the_avx2_kernels_bits() {
        if !available() {
            return;
        }
        for case in cases() {
            let [m, k, n] = case.mkn;
            let base: Vec<f32> = (0..m * n).map(|i| ((i * 31 % 97) as f32 - 48.0) / 8.0).collect();
            for rows in [0..m, m - 1..m] {
                let len = rows.len() * n;
                let base = &base[..len];
                for (fresh, finished) in [(false, false), (true, false), (true, true)] {
                    let start = if fresh { vec![f32::NAN; len] } else { base.to_vec() };
                    let (mut wide, mut narrow) = (start.clone(), start);
                    let (mut wide_finish, mut narrow_finish) = (base.to_vec(), base.to_vec());
                    for w in case.cuts().windows(2) {
                        case.fold(
                            rows.clone(),
                            0..k,
                            w[0]..w[1],
                            &mut wide,
                            fresh,
                            finished.then_some(&mut wide_finish[..]),
                        );
                        case.fold_on(
                            super::avx2::rows_times_matrix,
                            rows.clone(),
                            0..k,
                            w[0]..w[1],
                            &mut narrow,
                            fresh,
                            finished.then_some(&mut narrow_finish[..]),
                        );
                    }
                    let (wide, narrow) = match finished {
                        true => (wide_finish, narrow_finish),
                        false => (wide, narrow),
                    };
                    let same = wide.iter().zip(&narrow).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{m}×{k}×{n} rows {rows:?} fresh {fresh} finished {finished}"
                    );
                }
            }
        }
    }
}
