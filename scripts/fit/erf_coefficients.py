#!/usr/bin/env python3
"""Fits the polynomial coefficients of the vectorised exact GELU (src/experts/erf_simd.rs).

Two near-minimax (Chebyshev) fits, computed with mpmath at 50 digits:

* erf near zero: erf(u) = u + u * R(u^2) for |u| < SPLIT, R = P - 1 with P fitted to
  erf(sqrt(v)) / sqrt(v) on v in [0, SPLIT^2] (so P's absolute error is erf's relative error).
  The leading 1 is kept out of R so that rounding R's coefficients to f32 costs a ninth of what
  rounding 2/sqrt(pi) would.
* erfc in the tail: erfc(a) = t * exp(-a^2 + G(t)), t = 1 / (1 + a/2), for a in [SPLIT, A_MAX],
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
A_MAX = mp.mpf("10.1")  # erfc(10.1) is about 1e-46: below f32's smallest subnormal
DEG_SMALL = 5
DEG_TAIL = 9


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


def fit_tail():
    def g(t):
        a = 2 * (1 / t - 1)
        return mp.log(mp.erfc(a) / t) + a * a

    lo_t = 1 / (1 + A_MAX / 2)
    hi_t = 1 / (1 + SPLIT / 2)
    poly, err = mp.chebyfit(g, [lo_t, hi_t], DEG_TAIL + 1, error=True)
    return poly[::-1], err, (lo_t, hi_t)


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
    tail, err_tail, t_range = fit_tail()
    print(f"// erf(u) = u + u * R(u^2), |u| < {SPLIT}: largest relative error of the fit {mp.nstr(err_small, 3)}")
    print(rust("ERF_SMALL", small))
    print(f"// erfc(a) = t * exp(-a^2 + G(t)), t in [{mp.nstr(t_range[0], 6)}, {mp.nstr(t_range[1], 6)}]: "
          f"largest relative error of the fit {mp.nstr(err_tail, 3)}")
    print(rust("ERFC_TAIL", tail))
