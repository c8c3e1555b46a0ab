//! The oracle's algebra in plain float64 loops: row-vector products, outer products, and each
//! activation with its derivative.

use crate::experts::Activation;

/// `out[j] += Σ_i v[i] · w[i * cols + j]` (row vector times a `[rows, cols]` matrix).
pub(super) fn vec_mat(v: &[f64], w: &[f64], cols: usize, out: &mut [f64]) {
    for (i, vi) in v.iter().enumerate() {
        for (o, wij) in out.iter_mut().zip(&w[i * cols..(i + 1) * cols]) {
            *o += vi * wij;
        }
    }
}

/// `out[i] += Σ_j w[i * cols + j] · g[j]` (matrix times a column vector: the backward of
/// [`vec_mat`] with respect to `v`).
pub(super) fn mat_vec(w: &[f64], g: &[f64], out: &mut [f64]) {
    let cols = g.len();
    for (i, o) in out.iter_mut().enumerate() {
        *o += w[i * cols..(i + 1) * cols]
            .iter()
            .zip(g)
            .map(|(a, b)| a * b)
            .sum::<f64>();
    }
}

/// `dw[i * cols + j] += v[i] · g[j]` (outer product: the weight gradient of [`vec_mat`]).
pub(super) fn outer(v: &[f64], g: &[f64], dw: &mut [f64]) {
    let cols = g.len();
    for (i, vi) in v.iter().enumerate() {
        for (d, gj) in dw[i * cols..(i + 1) * cols].iter_mut().zip(g) {
            *d += vi * gj;
        }
    }
}

pub(super) fn sigmoid(v: f64) -> f64 {
    1.0 / (1.0 + (-v).exp())
}

/// `act(z)` for one row (`z` is `[d_inner]`).
pub(super) fn act_forward(act: Activation, z: &[f64]) -> Vec<f64> {
    match act {
        Activation::Gelu => z
            .iter()
            .map(|&v| v * 0.5 * (1.0 + libm::erf(v / std::f64::consts::SQRT_2)))
            .collect(),
        Activation::Relu => z.iter().map(|&v| v.max(0.0)).collect(),
        Activation::SwiGlu => {
            let h = z.len() / 2;
            (0..h).map(|i| z[i] * sigmoid(z[i]) * z[h + i]).collect()
        }
        Activation::ClampedSwiGlu { alpha, limit } => {
            let (h, alpha, limit) = (z.len() / 2, alpha as f64, limit as f64);
            (0..h)
                .map(|i| {
                    let g = z[i].min(limit);
                    let u = z[h + i].clamp(-limit, limit);
                    (u + 1.0) * g * sigmoid(alpha * g)
                })
                .collect()
        }
    }
}

/// `grad · d act(z) / dz` for one row.
pub(super) fn act_backward(act: Activation, z: &[f64], grad: &[f64]) -> Vec<f64> {
    match act {
        Activation::Gelu => z
            .iter()
            .zip(grad)
            .map(|(&v, g)| {
                let cdf = 0.5 * (1.0 + libm::erf(v / std::f64::consts::SQRT_2));
                let pdf = (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt();
                g * (cdf + v * pdf)
            })
            .collect(),
        Activation::Relu => z
            .iter()
            .zip(grad)
            .map(|(&v, g)| if v > 0.0 { *g } else { 0.0 })
            .collect(),
        Activation::SwiGlu => {
            let h = z.len() / 2;
            let mut out = vec![0.0; 2 * h];
            for i in 0..h {
                let (gate, up) = (z[i], z[h + i]);
                let s = sigmoid(gate);
                out[i] = grad[i] * up * s * (1.0 + gate * (1.0 - s));
                out[h + i] = grad[i] * gate * s;
            }
            out
        }
        Activation::ClampedSwiGlu { alpha, limit } => {
            let (h, alpha, limit) = (z.len() / 2, alpha as f64, limit as f64);
            let mut out = vec![0.0; 2 * h];
            for i in 0..h {
                let (gate, up) = (z[i], z[h + i]);
                let (g, u) = (gate.min(limit), up.clamp(-limit, limit));
                let s = sigmoid(alpha * g);
                // torch's clamp passes the gradient where the value is within the bounds,
                // bounds included.
                if gate <= limit {
                    out[i] = grad[i] * (u + 1.0) * s * (1.0 + alpha * g * (1.0 - s));
                }
                if up.abs() <= limit {
                    out[h + i] = grad[i] * g * s;
                }
            }
            out
        }
    }
}
