//! An independent float64 oracle of the reference function (shared/cases/README.md) and its
//! gradients, in plain loops.
//!
//! It shares no code with the layer beyond the capacity rule, and no code with burn at all,
//! so a case it generates checks the layer against the spec rather than against itself.

use std::collections::BTreeMap;

use crate::dispatch::{capacity_for, CapacityDecision};
use crate::experts::Activation;
use crate::layer::TensorMap;
use crate::MoeLayerConfig;

/// The oracle's results for `loss = sum(y · probe)`.
pub(crate) struct Golden {
    pub y: Vec<f64>,
    pub dx: Vec<f64>,
    /// Gradient of every parameter, by canonical name.
    pub grads: BTreeMap<&'static str, Vec<f64>>,
}

fn values(tensors: &TensorMap, name: &str) -> Vec<f64> {
    tensors[name]
        .clone()
        .convert::<f64>()
        .into_vec()
        .expect("f64 data")
}

fn optional(tensors: &TensorMap, name: &str, present: bool) -> Option<Vec<f64>> {
    present.then(|| values(tensors, name))
}

/// `out[j] += Σ_i v[i] · w[i * cols + j]` (row vector times a `[rows, cols]` matrix).
fn vec_mat(v: &[f64], w: &[f64], cols: usize, out: &mut [f64]) {
    for (i, vi) in v.iter().enumerate() {
        for (o, wij) in out.iter_mut().zip(&w[i * cols..(i + 1) * cols]) {
            *o += vi * wij;
        }
    }
}

/// `out[i] += Σ_j w[i * cols + j] · g[j]` (matrix times a column vector: the backward of
/// [`vec_mat`] with respect to `v`).
fn mat_vec(w: &[f64], g: &[f64], out: &mut [f64]) {
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
fn outer(v: &[f64], g: &[f64], dw: &mut [f64]) {
    let cols = g.len();
    for (i, vi) in v.iter().enumerate() {
        for (d, gj) in dw[i * cols..(i + 1) * cols].iter_mut().zip(g) {
            *d += vi * gj;
        }
    }
}

fn sigmoid(v: f64) -> f64 {
    1.0 / (1.0 + (-v).exp())
}

/// `act(z)` for one row (`z` is `[d_inner]`).
fn act_forward(act: Activation, z: &[f64]) -> Vec<f64> {
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
    }
}

/// `grad · d act(z) / dz` for one row.
fn act_backward(act: Activation, z: &[f64], grad: &[f64]) -> Vec<f64> {
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
    }
}

/// Runs the reference function forward and backward on `tensors` (weights, `x`, `probe`).
pub(crate) fn golden(config: &MoeLayerConfig, tensors: &TensorMap) -> Golden {
    let (m, h, e_count, k) = (config.d_model, config.d_hidden, config.n_experts, config.top_k);
    let f = config.activation.d_inner(h);
    let x = values(tensors, "x");
    let probe = values(tensors, "probe");
    let t_count = x.len() / m;
    let w_r = values(tensors, "router.weight");
    let b_r = optional(tensors, "router.bias", config.router_bias);
    let w_in = values(tensors, "experts.w_in");
    let b_in = optional(tensors, "experts.b_in", config.bias);
    let w_out = values(tensors, "experts.w_out");
    let b_out = optional(tensors, "experts.b_out", config.bias);

    let mut y = vec![0.0; t_count * m];
    let mut dx = vec![0.0; t_count * m];
    let mut d_w_r = vec![0.0; e_count * m];
    let mut d_b_r = vec![0.0; e_count];
    let mut d_w_in = vec![0.0; e_count * m * f];
    let mut d_b_in = vec![0.0; e_count * f];
    let mut d_w_out = vec![0.0; e_count * h * m];
    let mut d_b_out = vec![0.0; e_count * m];

    // 1. Routing: softmax over all experts, top-k (ties to the lower index), capacity.
    let mut probs = vec![0.0; t_count * e_count];
    let mut indices = Vec::with_capacity(t_count * k);
    for t in 0..t_count {
        let xt = &x[t * m..(t + 1) * m];
        let logits: Vec<f64> = (0..e_count)
            .map(|e| {
                let dot: f64 = xt.iter().zip(&w_r[e * m..(e + 1) * m]).map(|(a, b)| a * b).sum();
                dot + b_r.as_ref().map_or(0.0, |b| b[e])
            })
            .collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
        for e in 0..e_count {
            probs[t * e_count + e] = (logits[e] - max).exp() / sum;
        }
        let mut taken = vec![false; e_count];
        for _ in 0..k {
            let best = (0..e_count)
                .filter(|&e| !taken[e])
                .fold(None, |best: Option<usize>, e| match best {
                    Some(b) if logits[b] >= logits[e] => Some(b),
                    _ => Some(e),
                })
                .expect("k <= n_experts");
            taken[best] = true;
            indices.push(best);
        }
    }
    let capacity = config
        .capacity_factor
        .map(|c| capacity_for(c, t_count, k, e_count));
    let kept = CapacityDecision::decide(&indices, e_count, capacity, &vec![0; e_count]).kept;

    // 2. Experts, combine, and their backward, token by token.
    for t in 0..t_count {
        let xt = &x[t * m..(t + 1) * m];
        let pt = &probe[t * m..(t + 1) * m];
        let chosen = &indices[t * k..(t + 1) * k];
        let p: Vec<f64> = chosen.iter().map(|&e| probs[t * e_count + e]).collect();
        let norm = if config.normalize_topk {
            p.iter().sum::<f64>()
        } else {
            1.0
        };
        let w: Vec<f64> = p.iter().map(|v| v / norm).collect();
        let mut grad_w = vec![0.0; k];
        for (j, &e) in chosen.iter().enumerate() {
            if !kept[t * k + j] {
                continue;
            }
            let (wi, wo) = (
                &w_in[e * m * f..(e + 1) * m * f],
                &w_out[e * h * m..(e + 1) * h * m],
            );
            let mut z = b_in
                .as_ref()
                .map_or(vec![0.0; f], |b| b[e * f..(e + 1) * f].to_vec());
            vec_mat(xt, wi, f, &mut z);
            let a = act_forward(config.activation, &z);
            let mut o = b_out
                .as_ref()
                .map_or(vec![0.0; m], |b| b[e * m..(e + 1) * m].to_vec());
            vec_mat(&a, wo, m, &mut o);
            for c in 0..m {
                y[t * m + c] += w[j] * o[c];
            }
            // Backward: loss = Σ probe · y.
            grad_w[j] = pt.iter().zip(&o).map(|(a, b)| a * b).sum();
            let g_o: Vec<f64> = pt.iter().map(|v| v * w[j]).collect();
            outer(&a, &g_o, &mut d_w_out[e * h * m..(e + 1) * h * m]);
            d_b_out[e * m..(e + 1) * m]
                .iter_mut()
                .zip(&g_o)
                .for_each(|(d, g)| *d += g);
            let mut g_a = vec![0.0; h];
            mat_vec(wo, &g_o, &mut g_a);
            let g_z = act_backward(config.activation, &z, &g_a);
            outer(xt, &g_z, &mut d_w_in[e * m * f..(e + 1) * m * f]);
            d_b_in[e * f..(e + 1) * f]
                .iter_mut()
                .zip(&g_z)
                .for_each(|(d, g)| *d += g);
            mat_vec(wi, &g_z, &mut dx[t * m..(t + 1) * m]);
        }
        // Through the weights: normalisation, then the softmax over all experts.
        let g_p: Vec<f64> = if config.normalize_topk {
            let dot: f64 = grad_w.iter().zip(&w).map(|(g, v)| g * v).sum();
            grad_w.iter().map(|g| (g - dot) / norm).collect()
        } else {
            grad_w
        };
        let mut g_probs = vec![0.0; e_count];
        for (j, &e) in chosen.iter().enumerate() {
            g_probs[e] += g_p[j];
        }
        let row = &probs[t * e_count..(t + 1) * e_count];
        let dot: f64 = g_probs.iter().zip(row).map(|(g, p)| g * p).sum();
        for e in 0..e_count {
            let g_logit = row[e] * (g_probs[e] - dot);
            d_b_r[e] += g_logit;
            for c in 0..m {
                d_w_r[e * m + c] += g_logit * xt[c];
                dx[t * m + c] += g_logit * w_r[e * m + c];
            }
        }
    }

    let mut grads = BTreeMap::from([
        ("router.weight", d_w_r),
        ("experts.w_in", d_w_in),
        ("experts.w_out", d_w_out),
    ]);
    if config.router_bias {
        grads.insert("router.bias", d_b_r);
    }
    if config.bias {
        grads.insert("experts.b_in", d_b_in);
        grads.insert("experts.b_out", d_b_out);
    }

    // 3. The shared expert: y += σ(x · gate) · (silu(x · Wg) ⊙ x · Wu) · W_out.
    if let Some(hs) = config.shared_expert {
        let s_in = values(tensors, "shared.w_in");
        let s_out = values(tensors, "shared.w_out");
        let gate = values(tensors, "shared.gate.weight");
        let (mut d_in, mut d_out, mut d_gate) = (vec![0.0; m * 2 * hs], vec![0.0; hs * m], vec![0.0; m]);
        for t in 0..t_count {
            let xt = &x[t * m..(t + 1) * m];
            let pt = &probe[t * m..(t + 1) * m];
            let mut inner = vec![0.0; 2 * hs];
            vec_mat(xt, &s_in, 2 * hs, &mut inner);
            let hidden = act_forward(Activation::SwiGlu, &inner);
            let mut o = vec![0.0; m];
            vec_mat(&hidden, &s_out, m, &mut o);
            let s = sigmoid(xt.iter().zip(&gate).map(|(a, b)| a * b).sum());
            for c in 0..m {
                y[t * m + c] += s * o[c];
            }
            let g_s: f64 = pt.iter().zip(&o).map(|(a, b)| a * b).sum();
            let g_u = g_s * s * (1.0 - s);
            for c in 0..m {
                d_gate[c] += g_u * xt[c];
                dx[t * m + c] += g_u * gate[c];
            }
            let g_o: Vec<f64> = pt.iter().map(|v| v * s).collect();
            outer(&hidden, &g_o, &mut d_out);
            let mut g_h = vec![0.0; hs];
            mat_vec(&s_out, &g_o, &mut g_h);
            let g_inner = act_backward(Activation::SwiGlu, &inner, &g_h);
            outer(xt, &g_inner, &mut d_in);
            mat_vec(&s_in, &g_inner, &mut dx[t * m..(t + 1) * m]);
        }
        grads.insert("shared.w_in", d_in);
        grads.insert("shared.w_out", d_out);
        grads.insert("shared.gate.weight", d_gate);
    }
    Golden { y, dx, grads }
}
