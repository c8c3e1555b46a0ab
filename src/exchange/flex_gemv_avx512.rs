//! [`rows_times_matrix`](super::flex_gemv::rows_times_matrix) on AVX-512: sixteen columns a
//! vector where the AVX2 kernel has eight; one row ([`one_row`], a decode step's products)
//! four vectors a step.
//!
//! With a few rows the streaming kernel does `m` multiply-adds per weight it reads, so a
//! prefill's products (the 163 M Qwen3-MoE's 64-token prompt puts about eight rows on each
//! expert) are bound by the multiply-adds rather than by the reads on one core: the AVX2
//! kernel was half of a one-thread prefill's time (`perf`, BENCHMARKS §13m). Each value's fold
//! is the one the AVX2 kernel makes — one fused multiply-add per depth index, in order, in the
//! same blocks of eight rows, from zero where fresh, added into `finish` at the end where
//! asked — so the lane width changes no bit, and the columns short of a vector go to the AVX2
//! kernel. The tests hold both kernels here to the AVX2 kernel's bits.

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

/// The columns `cols` of [`rows_times_matrix`](super::flex_gemv::rows_times_matrix) of two or
/// more rows that fill whole vectors of sixteen; returns where they end (the caller folds the
/// rest).
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

/// The columns of a one-row [`rows_times_matrix`](super::flex_gemv::rows_times_matrix) that
/// fill whole vectors of sixteen; returns where they end (the caller folds the rest).
///
/// One row does one multiply-add per weight it reads, so this kernel is bound by how fast one
/// core streams the block's eight matrix rows. It takes four vectors a step where the AVX2
/// kernel takes two of eight values: 256 bytes of each row a step, and half the instructions
/// (loads, multiply-adds, the output's loads and stores) per weight read. In the CLI (64-token
/// greedy generations of the 163 M Qwen3-MoE, ten alternating processes each, medians, new
/// tokens/s) this kernel against the AVX2 one gave 247.4 against 216.4 on one thread and 336.8
/// against 313.1 on two; two vectors a step 233.0 and eight 217.5 where four gave 241.9. A
/// non-temporal prefetch of each row's lines 512 bytes ahead, which a scratch benchmark of
/// the expert products alone favoured (36.8 against 31.4 GB/s), gained nothing in the CLI
/// (270.1 against 266.8 tokens/s over 16 processes on one thread, 353.4 against 354.4 over 12
/// on two), and one that ran on into the next block's rows lost (223.6 against 267.7), so
/// there is none. The fold of each value is the AVX2 kernel's, so the bits are.
///
/// # Safety
/// As [`rows_times_matrix`](super::flex_gemv::rows_times_matrix) with `m = 1`, with
/// [`available`] true: `x` holds the row; `finish` is that call's `finish`, null for none.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn one_row(
    x: *const f32,
    ks: Range<usize>,
    rhs: *const f32,
    ld_rhs: usize,
    [out, finish]: [*mut f32; 2],
    cols: Range<usize>,
    fresh: bool,
) -> usize {
    use std::arch::x86_64::*;

    const BLOCK: usize = 8;
    // Vectors a step where the block is whole; a short block (the depth's last rows) and the
    // columns short of four vectors take one a step.
    const WIDE: usize = 4;
    let vector_end = cols.start + cols.len() / 16 * 16;
    let mut k0 = ks.start;
    while k0 < ks.end {
        let rows = BLOCK.min(ks.end - k0);
        // The first block of a fresh fold starts from zero; the last of a finished one adds its
        // result into `finish`.
        let zero = fresh && k0 == ks.start;
        let last = !finish.is_null() && k0 + rows >= ks.end;
        let xs: [__m512; BLOCK] = std::array::from_fn(|t| _mm512_set1_ps(*x.add(k0 + t.min(rows - 1))));
        let r: [*const f32; BLOCK] = std::array::from_fn(|t| rhs.add((k0 + t.min(rows - 1)) * ld_rhs));
        // `$w` vectors of sixteen columns from `$j`, each value folded over the block's first
        // `$rows` rows in order.
        macro_rules! step {
            ($j:expr, $w:expr, $rows:expr) => {{
                let j = $j;
                let mut acc = [_mm512_setzero_ps(); $w];
                if !zero {
                    for (v, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm512_loadu_ps(out.add(j + 16 * v));
                    }
                }
                for t in 0..$rows {
                    for (v, acc) in acc.iter_mut().enumerate() {
                        *acc = _mm512_fmadd_ps(xs[t], _mm512_loadu_ps(r[t].add(j + 16 * v)), *acc);
                    }
                }
                for (v, acc) in acc.iter().enumerate() {
                    let at = j + 16 * v;
                    match last {
                        true => _mm512_storeu_ps(
                            finish.add(at),
                            _mm512_add_ps(_mm512_loadu_ps(finish.add(at)), *acc),
                        ),
                        false => _mm512_storeu_ps(out.add(at), *acc),
                    }
                }
            }};
        }
        let mut j = cols.start;
        if rows == BLOCK {
            while j + 16 * WIDE <= vector_end {
                step!(j, WIDE, BLOCK);
                j += 16 * WIDE;
            }
            while j < vector_end {
                step!(j, 1, BLOCK);
                j += 16;
            }
        } else {
            while j < vector_end {
                step!(j, 1, rows);
                j += 16;
            }
        }
        k0 += rows;
    }
    vector_end
}
