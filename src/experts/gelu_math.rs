//! The exact (erf) GELU and its derivative in `f32`, written so that the compiler vectorises
//! them: no calls, only arithmetic, bit operations and selects, and one branch per eight
//! elements.
//!
//! Scalar `libm` calls (`erff`, `expf`) cannot be vectorised: they were about 12% of the toy
//! GPT-MoE's training time on the CPU (next to 15% for its GEMMs), and made the GELU backward
//! of a large expert slower than a GEMM over the same rows. Here
//! `Φ(x) = ½·(1 + erf(x/√2))` is evaluated in three pieces of `u = x/√2`, `a = |u|`:
//! - near zero (`a < 0.75`): `erf(u) = u + u·R(u²)`, `R` a degree-5 polynomial;
//! - in the middle (`0.75 ≤ a < 1.5`): `erf(a) = erf(1.125) + s·M(s)`, `s = a − 1.125`, `M` of
//!   degree 7;
//! - in the tails: `erfc(a) = t·exp(−a² + G(t))` with `t = 1/(1 + a/2)` and `G` of degree 8
//!   (the form of Numerical Recipes' `erfcc`), so `Φ` keeps its relative accuracy in the
//!   negative tail where `½·(1 + erf)` would cancel to zero.
//!
//! A vector unit cannot take a branch per lane, so a lane-wise formula computes every piece and
//! selects; the tail piece (a division, an `exp` and a polynomial) is most of the cost. The
//! slice kernels therefore look at eight elements at a time and, when none of the eight is in
//! a tail — for pre-activations of unit scale most groups are not: `|x| < 2.12` holds for 97%
//! of a standard normal's draws — compute the two central pieces only. Both paths compute
//! those pieces with the same operations, so the result does not depend on which ran.
//!
//! The coefficients are near-minimax Chebyshev fits made by `scripts/fit/erf_coefficients.py`
//! (mpmath, 50 digits; the fits' own errors are 1.5e-9, 1.4e-9 and 3.1e-10). The `exp` is Cephes'
//! `expf` polynomial (S. L. Moshier) with Cody–Waite range reduction. `a²` is split into an
//! exact high part and a small low part (`a = a_hi + a_lo`, `a_hi` with 12 significant bits),
//! as glibc's `erff` does, so the tail's exponent does not lose the bits a rounded `a²` would.
//!
//! Products and sums are never fused, so every instruction set (the AVX2 path and the
//! baseline one) produces the same bits. Measured errors against f64 `erf` are stated in the
//! tests below.

/// Where the near-zero polynomial hands over to the middle one, in `a = |x|/√2`.
const SPLIT: f32 = 0.75;
/// Where the middle polynomial hands over to the tail form.
const TAIL_START: f32 = 1.5;
/// The middle polynomial's variable is `a − MID_CENTRE`.
const MID_CENTRE: f32 = 1.125;
/// `erfc(10.5)` is below the smallest subnormal `f32`; larger arguments are clamped here so
/// that infinities never reach the tail's arithmetic.
const TAIL_CLAMP: f32 = 10.5;

/// `R(v) = erf(√v)/√v − 1`, for `u² = v` with `|u| < SPLIT` (lowest degree first): `erf(u) =
/// u + u·R(u²)`. Keeping the leading `1` out of `R` makes the rounding of `R` to f32 count a ninth
/// as much as that of `2/√π` would.
const ERF_SMALL: [f32; 6] = [
    0.12837917,
    -0.3761262,
    0.112833865,
    -0.026835114,
    0.005115332,
    -0.000675648,
];

/// `erf(MID_CENTRE)` as a sum of two `f32`s.
const ERF_AT_MID_CENTRE: [f32; 2] = [0.8883882, 1.5206194e-08];

/// `M(s) = (erf(s + MID_CENTRE) − erf(MID_CENTRE))/s` for `a = s + MID_CENTRE ∈ [SPLIT,
/// TAIL_START]`: `erf(a) = m0 + (m1 + s·M(s))`, the large constant added last so that the sum
/// is rounded once at its own size.
const ERF_MIDDLE: [f32; 8] = [
    0.31827396,
    -0.3580582,
    0.16245206,
    0.027974073,
    -0.06131373,
    0.015509201,
    0.009496404,
    -0.005714506,
];

/// `G(t) = ln(erfc(a)/t) + a²` with `t = 1/(1 + a/2)`, for `a ∈ [TAIL_START, 10.1]`.
const ERFC_TAIL: [f32; 9] = [
    -1.2655168,
    1.0001539,
    0.3727827,
    0.101649344,
    -0.18122114,
    0.1777996,
    -0.783767,
    0.8991225,
    -0.32358614,
];

const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// `1/√(2π)`, the standard normal density at zero.
const INV_SQRT_2PI: f32 = 0.398_942_3;

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` in two parts (Cody–Waite): the high part, 0.693359375, has 9 significant bits, so
/// `k · LN2_HI` is exact for every `k` the range reduction produces.
const LN2_HI: f32 = 355.0 / 512.0;
const LN2_LO: f32 = -2.121_944_4e-4;
/// `1.5 · 2²³`: adding it rounds to the nearest integer and leaves that integer in the low
/// mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;
const ROUND_MAGIC_BITS: i32 = 0x4B40_0000;
/// Cephes `expf`'s `Q(r)`, lowest degree first.
const EXP_Q: [f32; 6] = [
    0.5,
    0.166_666_65,
    4.166_579_6e-2,
    8.333_452e-3,
    1.398_199_9e-3,
    1.987_569_2e-4,
];
/// Below `e^−104` every result is smaller than the smallest subnormal `f32`.
const EXP_MIN: f32 = -104.0;

/// `c[0] + c[1]·x + … + c[5]·x⁵` by Estrin's scheme: the same operations as Horner's rule
/// but in a shallow tree, so that a vector core is not waiting on one long chain of
/// dependent multiply-adds (the kernel is latency-bound; Horner made it ~25% slower here).
#[inline(always)]
fn estrin6(c: &[f32; 6], x: f32) -> f32 {
    let x2 = x * x;
    let p01 = c[0] + c[1] * x;
    let p23 = c[2] + c[3] * x;
    let p45 = c[4] + c[5] * x;
    p01 + x2 * (p23 + x2 * p45)
}

/// `c[0] + c[1]·x + … + c[7]·x⁷` by Estrin's scheme (see [`estrin6`]).
#[inline(always)]
fn estrin8(c: &[f32; 8], x: f32) -> f32 {
    let x2 = x * x;
    let x4 = x2 * x2;
    let p01 = c[0] + c[1] * x;
    let p23 = c[2] + c[3] * x;
    let p45 = c[4] + c[5] * x;
    let p67 = c[6] + c[7] * x;
    (p01 + x2 * p23) + x4 * (p45 + x2 * p67)
}

/// `c[0] + c[1]·x + … + c[8]·x⁸` by Estrin's scheme (see [`estrin6`]): [`estrin8`]'s tree
/// with the last term added at the top.
#[inline(always)]
fn estrin9(c: &[f32; 9], x: f32) -> f32 {
    let head: &[f32; 8] = c[..8].try_into().expect("the first eight of nine coefficients");
    let x4 = (x * x) * (x * x);
    estrin8(head, x) + (x4 * x4) * c[8]
}

/// `e^(hi + lo)` for `hi + lo ≤ 88`, where `lo` is small next to `hi` and carries the bits
/// that `hi` cannot: the reduction `hi − k·ln 2` is exact, and `lo` joins afterwards.
#[inline(always)]
fn exp_parts(hi: f32, lo: f32) -> f32 {
    let under = hi + lo < EXP_MIN;
    let hi = if under { EXP_MIN } else { hi };
    let lo = if under { 0.0 } else { lo };
    let shifted = (hi + lo) * LOG2E + ROUND_MAGIC;
    let kf = shifted - ROUND_MAGIC;
    let k = shifted.to_bits() as i32 - ROUND_MAGIC_BITS;
    let r = (hi - kf * LN2_HI) - kf * LN2_LO + lo;
    // Cephes expf: e^r = 1 + r + r²·Q(r) on |r| ≤ ln2/2.
    let q = estrin6(&EXP_Q, r);
    let p = q * r * r + r + 1.0;
    // 2^k in two factors, so that results down to the subnormals come out (k ≥ −151).
    let k1 = k >> 1;
    let k2 = k - k1;
    let s1 = f32::from_bits(((k1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((k2 + 127) as u32) << 23);
    let e = p * s1 * s2;
    if under {
        0.0
    } else {
        e
    }
}

/// `e^x` for `x ≤ 0` (0 below `e^−104`), the same arithmetic as the tail's exponential: the
/// sigmoid of the SwiGLU kernels (`swiglu_math`) takes it from here.
#[inline(always)]
pub(crate) fn exp_non_positive(x: f32) -> f32 {
    exp_parts(x, 0.0)
}

/// `−a²` as `(hi, lo)` with `hi` exact and `hi + lo` correct to a few bits beyond `f32`.
#[inline(always)]
fn neg_square_parts(a: f32) -> (f32, f32) {
    let a_hi = f32::from_bits(a.to_bits() & 0xFFFF_F000);
    let a_lo = a - a_hi;
    (-(a_hi * a_hi), -(a_lo * (a + a_hi)))
}

/// `erfc(a)` for `a ≥ TAIL_START` (any finite `a ≥ 0` is safe to evaluate; the result is only
/// accurate from `TAIL_START` on).
#[inline(always)]
fn erfc_tail(a: f32) -> f32 {
    let a = a.min(TAIL_CLAMP);
    let t = 1.0 / (1.0 + 0.5 * a);
    let (hi, lo) = neg_square_parts(a);
    t * exp_parts(hi, lo + estrin9(&ERFC_TAIL, t))
}

/// `erf(u)` by the two central pieces, the near-zero and the middle polynomial; accurate for
/// `|u| < TAIL_START`.
#[inline(always)]
fn erf_central(u: f32) -> f32 {
    let a = u.abs();
    let near_zero = u + u * estrin6(&ERF_SMALL, u * u);
    let s = a - MID_CENTRE;
    let middle = (ERF_AT_MID_CENTRE[0] + (ERF_AT_MID_CENTRE[1] + s * estrin8(&ERF_MIDDLE, s))).copysign(u);
    // Both are computed and one selected: a branch would stop the vectoriser. NaN compares
    // false and takes the near-zero piece, which keeps it NaN.
    if a >= SPLIT {
        middle
    } else {
        near_zero
    }
}

/// Whether `Φ(x)` takes a central piece, so that the tail form need not be evaluated. NaN
/// compares false and goes to the full form.
#[inline(always)]
fn is_central(x: f32) -> bool {
    (x * FRAC_1_SQRT_2).abs() < TAIL_START
}

/// The two parts every function here is built from, both evaluated: `erf(u)` by the central
/// pieces, `erfc(|u|)` by the tail form, and whether the tail applies. NaN compares false, so
/// it takes the central part and stays NaN.
#[inline(always)]
fn erf_pieces(u: f32) -> (f32, f32, bool) {
    let a = u.abs();
    (erf_central(u), erfc_tail(a), a >= TAIL_START)
}

/// `erf(u)`, from the pieces of [`normal_cdf`]; the tests measure the pieces through it against
/// f64 `erf`, since an `erf` is what they are fitted to.
#[cfg(test)]
fn erf(u: f32) -> f32 {
    let (small, erfc, in_tail) = erf_pieces(u);
    if in_tail {
        (1.0 - erfc).copysign(u)
    } else {
        small
    }
}

/// `Φ(x)` from the central pieces alone: the same bits as [`normal_cdf`] wherever
/// [`is_central`] holds, and meaningless elsewhere.
#[inline(always)]
fn normal_cdf_central(x: f32) -> f32 {
    0.5 + 0.5 * erf_central(x * FRAC_1_SQRT_2)
}

/// `Φ(x)`, the standard normal CDF, with relative accuracy in both tails.
#[inline(always)]
pub(crate) fn normal_cdf(x: f32) -> f32 {
    let u = x * FRAC_1_SQRT_2;
    let (small, erfc, in_tail) = erf_pieces(u);
    let half_erfc = 0.5 * erfc;
    // Both sides are computed and one selected: branches would stop the vectoriser.
    let tail = if u < 0.0 { half_erfc } else { 1.0 - half_erfc };
    let central = 0.5 + 0.5 * small;
    if in_tail {
        tail
    } else {
        central
    }
}

/// `gelu(x) = x·Φ(x)`. Non-finite inputs follow the formula in IEEE arithmetic (as the
/// composed reference does): `gelu(+∞) = +∞`, `gelu(−∞) = NaN`, `gelu(NaN) = NaN`.
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    x * normal_cdf(x)
}

/// [`gelu`] where [`is_central`] holds.
#[inline(always)]
fn gelu_central(x: f32) -> f32 {
    x * normal_cdf_central(x)
}

/// `Φ(x) + x·φ(x)` for a given `Φ(x)`, with `φ(x) = e^(−x²/2)/√(2π)`.
#[inline(always)]
fn slope_from_cdf(x: f32, cdf: f32) -> f32 {
    // |x| ≥ 15 has e^(−x²/2) = 0 in f32; the clamp keeps infinities out of the split.
    let xa = x.abs().min(15.0);
    let (hi, lo) = neg_square_parts(xa);
    let pdf = INV_SQRT_2PI * exp_parts(0.5 * hi, 0.5 * lo);
    cdf + x * pdf
}

/// `gelu'(x) = Φ(x) + x·φ(x)`, with `φ(x) = e^(−x²/2)/√(2π)`.
#[inline(always)]
pub(crate) fn gelu_slope(x: f32) -> f32 {
    slope_from_cdf(x, normal_cdf(x))
}

/// [`gelu_slope`] where [`is_central`] holds.
#[inline(always)]
fn gelu_slope_central(x: f32) -> f32 {
    slope_from_cdf(x, normal_cdf_central(x))
}

/// Elements the slice kernels decide on together: one AVX2 vector of `f32`.
pub(crate) const LANES: usize = 8;

/// Whether every element of `x` takes a central piece. A fold rather than `all`, so that the
/// eight compares become one vector compare instead of eight early exits.
#[inline(always)]
fn all_central(x: &[f32; LANES]) -> bool {
    x.iter().fold(true, |all, &x| all & is_central(x))
}

/// A chunk of [`LANES`] elements as an array, so that the compiler knows its length and makes
/// one vector of it. Only called on `chunks_exact(LANES)` items, whose length is `LANES`.
#[inline(always)]
fn as_group(chunk: &[f32]) -> &[f32; LANES] {
    chunk.try_into().expect("chunks_exact yields LANES elements")
}

/// [`as_group`] for a mutable chunk.
#[inline(always)]
fn as_group_mut(chunk: &mut [f32]) -> &mut [f32; LANES] {
    chunk.try_into().expect("chunks_exact_mut yields LANES elements")
}

/// An element-wise update `out ← f(x, out)` in its two forms: `central`, equal to `full`
/// wherever [`is_central`] holds and cheaper, and `full`, right everywhere. A trait with
/// associated functions rather than function values: a function passed as a value is called
/// through a shim the compiler may leave un-inlined, which costs the vectorisation (7× here).
trait GroupKernel {
    fn central(x: f32, out: f32) -> f32;
    fn full(x: f32, out: f32) -> f32;
}

/// `out = gelu(x)`.
struct Gelu;

impl GroupKernel for Gelu {
    #[inline(always)]
    fn central(x: f32, _: f32) -> f32 {
        gelu_central(x)
    }
    #[inline(always)]
    fn full(x: f32, _: f32) -> f32 {
        gelu(x)
    }
}

/// `out = out · gelu'(x)`.
struct ScaleBySlope;

impl GroupKernel for ScaleBySlope {
    #[inline(always)]
    fn central(x: f32, grad: f32) -> f32 {
        grad * gelu_slope_central(x)
    }
    #[inline(always)]
    fn full(x: f32, grad: f32) -> f32 {
        grad * gelu_slope(x)
    }
}

/// `out[i] = K(x[i], out[i])` over the shorter of the two slices, with `K::central` on every
/// group of [`LANES`] elements that are all central. Kept inline so that each caller below
/// compiles it for its own instruction set; the groups are arrays, so that each is one vector.
#[inline(always)]
fn by_groups<K: GroupKernel>(x: &[f32], out: &mut [f32]) {
    let n = x.len().min(out.len());
    let mut x = x[..n].chunks_exact(LANES);
    let mut out = out[..n].chunks_exact_mut(LANES);
    for (o, x) in (&mut out).zip(&mut x) {
        let (o, x) = (as_group_mut(o), as_group(x));
        if all_central(x) {
            for i in 0..LANES {
                o[i] = K::central(x[i], o[i]);
            }
        } else {
            for i in 0..LANES {
                o[i] = K::full(x[i], o[i]);
            }
        }
    }
    let rest = out.into_remainder();
    rest.iter_mut()
        .zip(x.remainder())
        .for_each(|(o, &x)| *o = K::full(x, *o));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn gelu_avx2(src: &[f32], dst: &mut [f32]) {
    by_groups::<Gelu>(src, dst)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn scale_by_slope_avx2(x: &[f32], grad: &mut [f32]) {
    by_groups::<ScaleBySlope>(x, grad)
}

/// Whether this CPU runs the 8-lane AVX2 build of the kernels. The answer is cached by std.
#[inline]
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `dst[i] = gelu(src[i])` over the shorter of the two slices.
pub(crate) fn gelu_into(src: &[f32], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU was just found to support AVX2, the only requirement of the call.
        return unsafe { gelu_avx2(src, dst) };
    }
    by_groups::<Gelu>(src, dst)
}

/// `grad[i] *= gelu'(x[i])` over the shorter of the two slices.
pub(crate) fn scale_by_gelu_slope(x: &[f32], grad: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU was just found to support AVX2, the only requirement of the call.
        return unsafe { scale_by_slope_avx2(x, grad) };
    }
    by_groups::<ScaleBySlope>(x, grad)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(ours: f32, exact: f64) -> f64 {
        let e = exact as f32;
        let ulp = if e == 0.0 {
            f32::from_bits(1) as f64
        } else {
            (f32::from_bits(e.abs().to_bits() + 1) - e.abs()) as f64
        };
        ((ours as f64) - exact).abs() / ulp
    }

    /// Every `stride`-th f32 bit pattern of both signs, finite ones only.
    fn sampled(stride: u32) -> impl Iterator<Item = f32> {
        (0..0x7F80_0000u32)
            .step_by(stride as usize)
            .flat_map(|b| [f32::from_bits(b), -f32::from_bits(b)])
    }

    #[test]
    fn erf_is_within_two_ulp_of_f64_erf_over_the_whole_f32_range() {
        let mut worst = (0.0, 0.0f32);
        for x in sampled(997).chain([
            0.0,
            -0.0,
            SPLIT,
            -SPLIT,
            TAIL_START,
            -TAIL_START,
            1.0606601,
            3.9,
            10.5,
            f32::MAX,
        ]) {
            let u = ulps(erf(x), libm::erf(x as f64));
            if u > worst.0 {
                worst = (u, x);
            }
        }
        assert!(worst.0 <= 2.0, "erf: {} ulp at {:e}", worst.0, worst.1);
        assert_eq!(erf(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(erf(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(erf(f32::INFINITY), 1.0);
        assert_eq!(erf(f32::NEG_INFINITY), -1.0);
        assert!(erf(f32::NAN).is_nan());
    }

    /// Relative error of `Φ`, including the negative tail down to where `Φ(x)` leaves the
    /// normal `f32` range (x ≈ −13); below that the result is subnormal and compared absolutely.
    #[test]
    fn normal_cdf_keeps_its_relative_accuracy_in_both_tails() {
        let mut worst = (0.0f64, 0.0f32);
        for x in sampled(613) {
            let exact = 0.5 * libm::erfc(-(x as f64) * std::f64::consts::FRAC_1_SQRT_2);
            let ours = normal_cdf(x) as f64;
            if exact < f32::MIN_POSITIVE as f64 {
                // Subnormal results: the same relative bound, taken of the smallest normal.
                assert!(
                    (ours - exact).abs() < 2e-5 * f32::MIN_POSITIVE as f64,
                    "Φ({x:e}) = {ours:e}, exact {exact:e}"
                );
                continue;
            }
            let rel = (ours - exact).abs() / exact;
            if rel > worst.0 {
                worst = (rel, x);
            }
        }
        // The argument x/√2 is rounded to f32 first, as in every f32 GELU; in the far tail
        // that rounding alone moves Φ by 2·u²·2⁻²⁴ relatively (1e-5 at x = −13).
        assert!(worst.0 < 2e-5, "Φ: relative error {:e} at {:e}", worst.0, worst.1);
    }

    #[test]
    fn gelu_and_its_slope_match_f64_within_stated_bounds() {
        let (mut worst_gelu, mut worst_slope) = (0.0f64, 0.0f64);
        for x in sampled(409).filter(|x| x.abs() < 20.0) {
            let xd = x as f64;
            let cdf = 0.5 * libm::erfc(-xd * std::f64::consts::FRAC_1_SQRT_2);
            let pdf = (-0.5 * xd * xd).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let exact_gelu = xd * cdf;
            let exact_slope = cdf + xd * pdf;
            // Relative error where the value is a normal f32, absolute below.
            let err = |ours: f32, exact: f64| {
                let scale = exact.abs().max(f32::MIN_POSITIVE as f64);
                (ours as f64 - exact).abs() / scale
            };
            if exact_gelu.abs() > 1e-30 {
                worst_gelu = worst_gelu.max(err(gelu(x), exact_gelu));
            }
            // The slope crosses zero near x = −0.75179 and is a difference of two nearly equal
            // terms in the negative tail, so it is measured against its scale, |Φ| + |x·φ|.
            let scale = (cdf + (xd * pdf).abs()).max(f32::MIN_POSITIVE as f64);
            worst_slope = worst_slope.max((gelu_slope(x) as f64 - exact_slope).abs() / scale);
        }
        assert!(worst_gelu < 2e-5, "gelu: relative error {worst_gelu:e}");
        assert!(worst_slope < 2e-5, "gelu': error {worst_slope:e} of its scale");
        assert_eq!(gelu(f32::INFINITY), f32::INFINITY);
        assert!(gelu(f32::NEG_INFINITY).is_nan());
        assert!(gelu(f32::NAN).is_nan() && gelu_slope(f32::NAN).is_nan() && normal_cdf(f32::NAN).is_nan());
        assert_eq!(gelu(0.0), 0.0);
        assert_eq!(gelu_slope(0.0), 0.5);
        assert_eq!(gelu_slope(30.0), 1.0);
        assert_eq!(gelu_slope(-30.0), 0.0);
    }

    /// The dispatching slice kernels give the same bits as the scalar functions, whichever
    /// instruction set ran and whichever path each group of eight took (the central one or the
    /// full one), on a length that is not a multiple of any vector width.
    #[test]
    fn slice_kernels_match_the_scalar_functions_bit_for_bit() {
        let x: Vec<f32> = (0..1003).map(|i| (i as f32 - 501.0) * 0.0173).collect();
        // Both paths run: some groups lie wholly inside the central pieces, some do not, and
        // some straddle the boundary between them.
        let groups: Vec<&[f32; LANES]> = x.chunks_exact(LANES).map(as_group).collect();
        let central = groups.iter().filter(|g| all_central(g)).count();
        assert!(
            central >= 20 && central + 20 <= groups.len(),
            "{central} of {} groups central",
            groups.len()
        );
        for &edge in &[TAIL_START, SPLIT] {
            let x_edge = edge * std::f32::consts::SQRT_2;
            let straddles =
                |g: &[f32; LANES]| g.iter().any(|x| x.abs() < x_edge) && g.iter().any(|x| x.abs() > x_edge);
            assert!(
                groups.iter().any(|g| straddles(g)),
                "no group straddles |x| = {x_edge}"
            );
        }
        let mut out = vec![0.0; x.len()];
        gelu_into(&x, &mut out);
        let mut grad: Vec<f32> = x.iter().map(|v| 1.0 + v).collect();
        let expected_grad: Vec<f32> = x.iter().zip(&grad).map(|(&x, &g)| g * gelu_slope(x)).collect();
        scale_by_gelu_slope(&x, &mut grad);
        for i in 0..x.len() {
            assert_eq!(out[i].to_bits(), gelu(x[i]).to_bits(), "gelu at {}", x[i]);
            assert_eq!(grad[i].to_bits(), expected_grad[i].to_bits(), "slope at {}", x[i]);
        }
    }
}
