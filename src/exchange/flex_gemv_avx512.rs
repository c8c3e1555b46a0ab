//! [`rows_times_matrix`](super::flex_gemv::rows_times_matrix) for two or more rows on AVX-512:
//! sixteen columns a vector where the AVX2 kernel has eight.
//!
//! With a few rows the streaming kernel does `m` multiply-adds per weight it reads, so a
//! prefill's products (the 163 M Qwen3-MoE's 64-token prompt puts about eight rows on each
//! expert) are bound by the multiply-adds rather than by the reads on one core: the AVX2
//! kernel was half of a one-thread prefill's time (`perf`, BENCHMARKS §13m). Each value's fold
//! is the one the AVX2 kernel makes — one fused multiply-add per depth index, in order, in the
//! same blocks of eight rows, from zero where fresh, added into `finish` at the end where
//! asked — so the lane width changes no bit, and the columns short of a vector go to the AVX2
//! kernel.

use std::ops::Range;

/// Whether this CPU has AVX-512F (a cached word after the first call).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The columns `cols` of [`rows_times_matrix`](super::flex_gemv::rows_times_matrix) that fill
/// whole vectors of sixteen; returns where they end (the caller folds the rest).
///
/// # Safety
/// As [`rows_times_matrix`](super::flex_gemv::rows_times_matrix), with [`available`] true.
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn whole_vectors(
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
) -> usize {
    use std::arch::x86_64::*;

    const BLOCK: usize = 8;
    let vector_end = cols.start + cols.len() / 16 * 16;
    let mut k0 = ks.start;
    while k0 < ks.end {
        let rows = BLOCK.min(ks.end - k0);
        // The first block of a fresh fold starts from zero; the last of a finished one adds its
        // result into `finish`.
        let zero = fresh && k0 == ks.start;
        let finish = finish.filter(|_| k0 + rows >= ks.end);
        let row = |t: usize| rhs.add((k0 + t) * ld_rhs);
        let mut j = cols.start;
        while j < vector_end {
            let w: [__m512; BLOCK] = std::array::from_fn(|t| match t < rows {
                true => _mm512_loadu_ps(row(t).add(j)),
                false => _mm512_setzero_ps(),
            });
            for i in 0..m {
                let x = lhs.as_ptr().add(i * k + k0);
                let at = i * n + j;
                let mut acc = match zero {
                    true => _mm512_setzero_ps(),
                    false => _mm512_loadu_ps(out.add(at)),
                };
                for (t, w) in w.iter().enumerate().take(rows) {
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(*x.add(t)), *w, acc);
                }
                match finish {
                    Some(f) => _mm512_storeu_ps(f.add(at), _mm512_add_ps(_mm512_loadu_ps(f.add(at)), acc)),
                    None => _mm512_storeu_ps(out.add(at), acc),
                }
            }
            j += 16;
        }
        k0 += rows;
    }
    vector_end
}
