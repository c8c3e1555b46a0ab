//! SwiGLU, `silu(gate) · up`, and its derivative in `f32` over rows of `[gate | up]`, written
//! so that the compiler vectorises them (no calls: the sigmoid's exponential is
//! [`gelu_math`](super::gelu_math)'s polynomial, not `libm`'s scalar `expf`).
//!
//! Flex computes the composed form (`sigmoid`, two products, and in backward eight more
//! element-wise ops, each a new tensor) on one thread with a scalar `expf` per element: in the
//! fine-tuning step of a 163 M-parameter Qwen3-MoE that was about 15% of the step (the
//! activation runs three times per layer: forward, its recomputation in backward, and its
//! derivative). These kernels make one pass per direction.
//!
//! The products are taken in the composed form's order (`(g · σ(g)) · u`; `(grad · u) · (σ ·
//! (g · (1 − σ) + 1))` and `grad · (g · σ)`), so the two differ only by the sigmoid's last bits.

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

/// One row: `out[j] = silu(gate[j]) · up[j]` with `z = [gate | up]` of twice `out`'s length.
#[inline(always)]
fn forward_row(z: &[f32], out: &mut [f32]) {
    let (gate, up) = z.split_at(out.len());
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g * sigmoid(g) * u;
    }
}

/// One row of the derivative: `dz = [d gate | d up]` from `z = [gate | up]` and the output's
/// gradient `grad` (half their length).
#[inline(always)]
fn backward_row(z: &[f32], grad: &[f32], dz: &mut [f32]) {
    let h = grad.len();
    let (gate, up) = z.split_at(h);
    let (d_gate, d_up) = dz.split_at_mut(h);
    for ((((dg, du), &g), &u), &gr) in d_gate.iter_mut().zip(d_up.iter_mut()).zip(gate).zip(up).zip(grad) {
        let s = sigmoid(g);
        *du = gr * (g * s);
        *dg = (gr * u) * (s * (g * (1.0 - s) + 1.0));
    }
}

/// Rows of `[gate | up]` (each `2h` long) to rows of `silu(gate) · up` (each `h` long).
///
/// # Shapes
/// - z: `rows · 2h` values; out: `rows · h` values (`h = d_hidden`)
pub(crate) fn forward_rows(z: &[f32], out: &mut [f32], h: usize) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU was just found to support AVX2, the only requirement of the call.
        return unsafe { forward_rows_avx2(z, out, h) };
    }
    forward_rows_plain(z, out, h)
}

/// Rows of the derivative: `dz` from `z` and the output's gradient `grad`.
///
/// # Shapes
/// - z, dz: `rows · 2h` values; grad: `rows · h` values
pub(crate) fn backward_rows(z: &[f32], grad: &[f32], dz: &mut [f32], h: usize) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU was just found to support AVX2, the only requirement of the call.
        return unsafe { backward_rows_avx2(z, grad, dz, h) };
    }
    backward_rows_plain(z, grad, dz, h)
}

#[inline(always)]
fn forward_rows_plain(z: &[f32], out: &mut [f32], h: usize) {
    for (z, out) in z.chunks_exact(2 * h).zip(out.chunks_exact_mut(h)) {
        forward_row(z, out);
    }
}

#[inline(always)]
fn backward_rows_plain(z: &[f32], grad: &[f32], dz: &mut [f32], h: usize) {
    for ((z, grad), dz) in z
        .chunks_exact(2 * h)
        .zip(grad.chunks_exact(h))
        .zip(dz.chunks_exact_mut(2 * h))
    {
        backward_row(z, grad, dz);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn forward_rows_avx2(z: &[f32], out: &mut [f32], h: usize) {
    forward_rows_plain(z, out, h)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn backward_rows_avx2(z: &[f32], grad: &[f32], dz: &mut [f32], h: usize) {
    backward_rows_plain(z, grad, dz, h)
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
        forward_rows(&z, &mut out, h);
        backward_rows(&z, &grad, &mut dz, h);
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
}
