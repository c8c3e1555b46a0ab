#!/usr/bin/env python3
"""Fits the polynomial coefficients of the vectorised exact GELU (src/experts/gelu_math.rs).

Three near-minimax (Chebyshev) fits, computed with mpmath at 50 digits:

* erf near zero: erf(u) = u + u * R(u^2) for |u| < SPLIT, R = P - 1 with P fitted to
  erf(sqrt(v)) / sqrt(v) on v in [0, SPLIT^2] (so P's absolute error is erf's relative error).
  The leading 1 is kept out of R so that rounding R's coefficients to f32 costs a ninth of what
  rounding 2/sqrt(pi) would.
* erf in the middle: erf(a) = m0 + (m1 + s * M(s)), s = a - MID_CENTRE, for a in
  [SPLIT, TAIL_START]: m0 + m1 is erf(MID_CENTRE) in two f32s and M is fitted to
  (erf(a) - erf(MID_CENTRE)) / s, so that the large constant is added last, in one rounding.
* erfc in the tail: erfc(a) = t * exp(-a^2 + G(t)), t = 1 / (1 + a/2), for a in [TAIL_START, A_MAX],
  G fitted to log(erfc(a) / t) + a^2 (so G's absolute error is erfc's relative error). This
  is the form of Numerical Recipes' `erfcc` (Press et al., 2nd ed., 6.2); the coefficients
  here are this script's own fit.

Run: python3 scripts/fit/erf_coefficients.py  (needs only mpmath). It prints the Rust
constants and each fit's largest relative error in exact arithmetic; the Rust tests measure
the f32 evaluation against f64 `erf`.
"""
import struct

import mpmath as mp

mp.mp.dps = 50
SPLIT = mp.mpf("0.75")
TAIL_START = mp.mpf("1.5")
MID_CENTRE = (SPLIT + TAIL_START) / 2
DEG_MID = 7
A_MAX = mp.mpf("10.1")  # erfc(10.1) is about 1e-46: below f32's smallest subnormal
DEG_SMALL = 5
DEG_TAIL = 8


def fit_small():
    def h(v):
        if v == 0:
            return 2 / mp.sqrt(mp.pi)
        u = mp.sqrt(v)
        return mp.erf(u) / u

    poly, err = mp.chebyfit(h, [0, SPLIT**2], DEG_SMALL + 1, error=True)
    coeffs = poly[::-1]  # lowest degree first
    coeffs[0] -= 1
    return coeffs, err


def fit_middle():
    centre = mp.erf(MID_CENTRE)
    m0 = mp.mpf(f32(centre))
    m1 = centre - m0

    def m(s):
        if s == 0:
            return 2 / mp.sqrt(mp.pi) * mp.exp(-(MID_CENTRE**2))
        return (mp.erf(s + MID_CENTRE) - centre) / s

    lo, hi = SPLIT - MID_CENTRE, TAIL_START - MID_CENTRE
    poly = mp.chebyfit(m, [lo, hi], DEG_MID + 1)
    # chebyfit's own error estimate trips over the removable singularity at s = 0, so the
    # error is measured here, on a fine grid, as erf's relative error.
    grid = (lo + (hi - lo) * i / 4000 for i in range(4001))
    err = max(abs(centre + s * mp.polyval(poly, s) - mp.erf(s + MID_CENTRE)) / mp.erf(s + MID_CENTRE) for s in grid)
    return (m0, m1), poly[::-1], err


def fit_tail():
    def g(t):
        a = 2 * (1 / t - 1)
        return mp.log(mp.erfc(a) / t) + a * a

    lo_t = 1 / (1 + A_MAX / 2)
    hi_t = 1 / (1 + TAIL_START / 2)
    poly, err = mp.chebyfit(g, [lo_t, hi_t], DEG_TAIL + 1, error=True)
    return poly[::-1], err, (lo_t, hi_t)


def f32(c):
    return struct.unpack("f", struct.pack("f", float(c)))[0]


def f32_literal(c):
    """The shortest decimal that rounds to the same f32 as `c` (what clippy wants to see)."""
    as_f32 = struct.unpack("f", struct.pack("f", float(c)))[0]
    for digits in range(6, 10):
        text = f"{as_f32:.{digits}g}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == as_f32:
            return text
    return repr(as_f32)


def rust(name, coeffs):
    body = ",\n".join(f"    {f32_literal(c)}" for c in coeffs)
    return f"const {name}: [f32; {len(coeffs)}] = [\n{body},\n];"


if __name__ == "__main__":
    small, err_small = fit_small()
    (m0, m1), middle, err_middle = fit_middle()
    tail, err_tail, t_range = fit_tail()
    print(f"// erf(u) = u + u * R(u^2), |u| < {SPLIT}: largest relative error of the fit {mp.nstr(err_small, 3)}")
    print(rust("ERF_SMALL", small))
    print(f"// erf(a) = m0 + (m1 + s * M(s)), s = a - {MID_CENTRE}, a in [{SPLIT}, {TAIL_START}]: largest "
          f"relative error of the fit {mp.nstr(err_middle, 3)}")
    print(f"const ERF_AT_MID_CENTRE: [f32; 2] = [{f32_literal(m0)}, {f32_literal(m1)}];")
    print(rust("ERF_MIDDLE", middle))
    print(f"// erfc(a) = t * exp(-a^2 + G(t)), t in [{mp.nstr(t_range[0], 6)}, {mp.nstr(t_range[1], 6)}]: "
          f"largest relative error of the fit {mp.nstr(err_tail, 3)}")
    print(rust("ERFC_TAIL", tail))
