//! SwiGLU, `silu(gate) · up`, GPT-OSS's clamped form of it, and their derivatives in `f32` over
//! rows of `[gate | up]`, written so that the compiler vectorises them (no calls: the sigmoid's exponential is
//! [`gelu_math`](super::gelu_math)'s polynomial, not `libm`'s scalar `expf`).
//!
//! Flex computes the composed form (`sigmoid`, two products, and in backward eight more
//! element-wise ops, each a new tensor) on one thread with a scalar `expf` per element: in the
//! fine-tuning step of a 163 M-parameter Qwen3-MoE that was about 15% of the step (the
//! activation runs three times per layer: forward, its recomputation in backward, and its
//! derivative). These kernels make one pass per direction.
//!
//! The products are taken in the composed forms' order (`(g · σ(g)) · u`; `(grad · u) · (σ ·
//! (g · (1 − σ) + 1))` and `grad · (g · σ)`; the clamped form's likewise), so the two differ
//! only by the sigmoid's last bits.

use super::gelu_math::{exp_non_positive, has_avx2};

/// `1 / (1 + e^−x)`, from `e^−|x|` so that the exponential never overflows: for `x < 0` it is
/// `e^x / (1 + e^x)`. Within a few ulps of the exact value over all of `f32`.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    let e = exp_non_positive(-x.abs());
    let inv = 1.0 / (1.0 + e);
    if x >= 0.0 {
        inv
    } else {
        e * inv
    }
}

/// The gate's form: the value and derivative of one `(gate, up)` pair, inlined into the row
/// loops so that each form compiles to its own vectorised loop.
pub(crate) trait Gate: Copy + Send + Sync {
    /// The activation of one pair.
    fn value(self, g: f32, u: f32) -> f32;
    /// `(d gate, d up)` of one pair for the output's gradient `grad`.
    fn slopes(self, g: f32, u: f32, grad: f32) -> (f32, f32);
}

/// SwiGLU, `silu(gate) · up`.
#[derive(Clone, Copy)]
pub(crate) struct Plain;

impl Gate for Plain {
    #[inline(always)]
    fn value(self, g: f32, u: f32) -> f32 {
        g * sigmoid(g) * u
    }

    #[inline(always)]
    fn slopes(self, g: f32, u: f32, grad: f32) -> (f32, f32) {
        let s = sigmoid(g);
        ((grad * u) * (s * (g * (1.0 - s) + 1.0)), grad * (g * s))
    }
}

/// GPT-OSS's clamped SwiGLU, `(u + 1) · g · σ(alpha · g)` with `g = min(gate, limit)` and
/// `u = clamp(up, ±limit)`; each half's derivative is zero where its clamp clamped (the bounds
/// themselves pass it, as torch's clamps do).
#[derive(Clone, Copy)]
pub(crate) struct Clamped {
    /// The sigmoid's slope.
    pub alpha: f32,
    /// The clamp.
    pub limit: f32,
}

impl Gate for Clamped {
    #[inline(always)]
    fn value(self, g: f32, u: f32) -> f32 {
        let g = g.min(self.limit);
        let u = u.clamp(-self.limit, self.limit);
        (u + 1.0) * (g * sigmoid(g * self.alpha))
    }

    #[inline(always)]
    fn slopes(self, g: f32, u: f32, grad: f32) -> (f32, f32) {
        let gc = g.min(self.limit);
        let uc = u.clamp(-self.limit, self.limit);
        let s = sigmoid(gc * self.alpha);
        let d_up = if u > self.limit || u < -self.limit {
            0.0
        } else {
            grad * (gc * s)
        };
        let slope = gc * (1.0 - s) * self.alpha + 1.0;
        let d_gate = if g > self.limit {
            0.0
        } else {
            (grad * (uc + 1.0)) * (s * slope)
        };
        (d_gate, d_up)
    }
}

/// One row: `out[j] = act(gate[j], up[j])` with `z = [gate | up]` of twice `out`'s length.
#[inline(always)]
fn forward_row<G: Gate>(z: &[f32], out: &mut [f32], form: G) {
    let (gate, up) = z.split_at(out.len());
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = form.value(g, u);
    }
}

/// One row of the derivative: `dz = [d gate | d up]` from `z = [gate | up]` and the output's
/// gradient `grad` (half their length).
#[inline(always)]
fn backward_row<G: Gate>(z: &[f32], grad: &[f32], dz: &mut [f32], form: G) {
    let h = grad.len();
    let (gate, up) = z.split_at(h);
    let (d_gate, d_up) = dz.split_at_mut(h);
    for ((((dg, du), &g), &u), &gr) in d_gate.iter_mut().zip(d_up.iter_mut()).zip(gate).zip(up).zip(grad) {
        (*dg, *du) = form.slopes(g, u, gr);
    }
}

/// Rows of `[gate | up]` (each `2h` long) to rows of the gated activation (each `h` long).
///
/// # Shapes
/// - z: `rows · 2h` values; out: `rows · h` values (`h = d_hidden`)
pub(crate) fn forward_rows<G: Gate>(z: &[f32], out: &mut [f32], h: usize, form: G) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU was just found to support AVX2, the only requirement of the call.
        return unsafe { forward_rows_avx2(z, out, h, form) };
    }
    forward_rows_plain(z, out, h, form)
}

/// Rows of the derivative: `dz` from `z` and the output's gradient `grad`.
///
/// # Shapes
/// - z, dz: `rows · 2h` values; grad: `rows · h` values
pub(crate) fn backward_rows<G: Gate>(z: &[f32], grad: &[f32], dz: &mut [f32], h: usize, form: G) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU was just found to support AVX2, the only requirement of the call.
        return unsafe { backward_rows_avx2(z, grad, dz, h, form) };
    }
    backward_rows_plain(z, grad, dz, h, form)
}

#[inline(always)]
fn forward_rows_plain<G: Gate>(z: &[f32], out: &mut [f32], h: usize, form: G) {
    for (z, out) in z.chunks_exact(2 * h).zip(out.chunks_exact_mut(h)) {
        forward_row(z, out, form);
    }
}

#[inline(always)]
fn backward_rows_plain<G: Gate>(z: &[f32], grad: &[f32], dz: &mut [f32], h: usize, form: G) {
    for ((z, grad), dz) in z
        .chunks_exact(2 * h)
        .zip(grad.chunks_exact(h))
        .zip(dz.chunks_exact_mut(2 * h))
    {
        backward_row(z, grad, dz, form);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn forward_rows_avx2<G: Gate>(z: &[f32], out: &mut [f32], h: usize, form: G) {
    forward_rows_plain(z, out, h, form)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn backward_rows_avx2<G: Gate>(z: &[f32], grad: &[f32], dz: &mut [f32], h: usize, form: G) {
    backward_rows_plain(z, grad, dz, h, form)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `stride`-th finite f32 bit pattern, both signs.
    fn sampled(stride: u32) -> impl Iterator<Item = f32> {
        (0..0x7F80_0000u32)
            .step_by(stride as usize)
            .flat_map(|b| [f32::from_bits(b), -f32::from_bits(b)])
    }

    #[test]
    fn the_sigmoid_is_within_four_ulps_of_the_exact_one_over_all_f32() {
        let mut worst = 0.0f64;
        for x in sampled(4099) {
            let exact = 1.0 / (1.0 + (-(x as f64)).exp());
            let got = sigmoid(x) as f64;
            let e = exact as f32;
            let ulp = match e == 0.0 {
                true => f32::from_bits(1) as f64,
                false => (f32::from_bits(e.to_bits() + 1) - e) as f64,
            };
            worst = worst.max((got - exact).abs() / ulp);
        }
        assert!(worst <= 4.0, "worst error {worst} ulps");
    }

    #[test]
    fn rows_match_the_f64_formulas_and_odd_widths_take_no_shortcut() {
        // h = 13: no row is a whole number of vectors, so the scalar remainders run too.
        let (rows, h) = (5, 13);
        let z: Vec<f32> = (0..rows * 2 * h)
            .map(|i| ((i * 37) % 41) as f32 / 4.0 - 5.0)
            .collect();
        let grad: Vec<f32> = (0..rows * h).map(|i| ((i * 11) % 7) as f32 / 3.0 - 1.0).collect();
        let mut out = vec![f32::NAN; rows * h];
        let mut dz = vec![f32::NAN; rows * 2 * h];
        forward_rows(&z, &mut out, h, Plain);
        backward_rows(&z, &grad, &mut dz, h, Plain);
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        for r in 0..rows {
            for j in 0..h {
                let (g, u) = (z[r * 2 * h + j] as f64, z[r * 2 * h + h + j] as f64);
                let gr = grad[r * h + j] as f64;
                let close = |got: f32, want: f64| (got as f64 - want).abs() <= 1e-6 * (1.0 + want.abs());
                assert!(close(out[r * h + j], g * sig(g) * u), "forward at ({r}, {j})");
                let d_up = gr * g * sig(g);
                let d_gate = gr * u * sig(g) * (1.0 + g * (1.0 - sig(g)));
                assert!(close(dz[r * 2 * h + h + j], d_up), "d up at ({r}, {j})");
                assert!(close(dz[r * 2 * h + j], d_gate), "d gate at ({r}, {j})");
            }
        }
    }

    /// The clamped form against its f64 formula, with values on both bounds (which pass the
    /// gradient) and past them (which do not), so a mask off by one comparison fails.
    #[test]
    fn clamped_rows_match_the_f64_formula_on_and_past_the_bounds() {
        let (alpha, limit) = (1.702f32, 0.75f32);
        let form = Clamped { alpha, limit };
        let (rows, h) = (3, 11);
        let special = [limit, -limit, limit + 0.25, -limit - 0.25, 0.0, 2.0];
        let z: Vec<f32> = (0..rows * 2 * h)
            .map(|i| match i % 5 {
                0 => special[(i / 5) % special.len()],
                _ => ((i * 29) % 43) as f32 / 16.0 - 1.3,
            })
            .collect();
        let grad: Vec<f32> = (0..rows * h).map(|i| ((i * 13) % 9) as f32 / 4.0 - 1.0).collect();
        let mut out = vec![f32::NAN; rows * h];
        let mut dz = vec![f32::NAN; rows * 2 * h];
        forward_rows(&z, &mut out, h, form);
        backward_rows(&z, &grad, &mut dz, h, form);
        let (a, l) = (alpha as f64, limit as f64);
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let (mut on_bounds, mut clamped) = (0, 0);
        for r in 0..rows {
            for j in 0..h {
                let (g, u) = (z[r * 2 * h + j] as f64, z[r * 2 * h + h + j] as f64);
                let gr = grad[r * h + j] as f64;
                let (gc, uc) = (g.min(l), u.clamp(-l, l));
                let s = sig(a * gc);
                let close = |got: f32, want: f64| (got as f64 - want).abs() <= 1e-6 * (1.0 + want.abs());
                assert!(
                    close(out[r * h + j], (uc + 1.0) * gc * s),
                    "forward at ({r}, {j})"
                );
                let d_up = if u.abs() > l { 0.0 } else { gr * gc * s };
                let d_gate = if g > l {
                    0.0
                } else {
                    gr * (uc + 1.0) * s * (1.0 + a * gc * (1.0 - s))
                };
                assert!(close(dz[r * 2 * h + h + j], d_up), "d up at ({r}, {j})");
                assert!(close(dz[r * 2 * h + j], d_gate), "d gate at ({r}, {j})");
                on_bounds += (u.abs() == l || g == l) as usize;
                clamped += (u.abs() > l || g > l) as usize;
            }
        }
        assert!(
            on_bounds > 0 && clamped > 0,
            "{on_bounds} values on a bound, {clamped} past one"
        );
    }
}
