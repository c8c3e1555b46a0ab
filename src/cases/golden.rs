//! An independent float64 oracle of the reference function (shared/cases/README.md) and its
//! gradients, in plain loops.
//!
//! It shares no code with the layer beyond the capacity rule, and no code with burn at all,
//! so a case it generates checks the layer against the spec rather than against itself.

use std::collections::BTreeMap;

use crate::dispatch::{capacity_for, CapacityDecision};
use crate::experts::Activation;
use crate::layer::TensorMap;
use crate::router::Scoring;
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

/// The `k` experts a token chooses by `choice` (best first): among the `topk_group` groups of
/// `n_group` contiguous groups whose two largest values sum highest when `n_group > 1`, among
/// all experts otherwise. Ties go to the lower index.
fn choose(choice: &[f64], k: usize, n_group: usize, topk_group: usize) -> Vec<usize> {
    let e_count = choice.len();
    let per_group = e_count / n_group;
    let argmax = |allowed: &dyn Fn(usize) -> bool, values: &[f64]| {
        (0..values.len())
            .filter(|&i| allowed(i))
            .fold(None, |best: Option<usize>, i| match best {
                Some(b) if values[b] >= values[i] => Some(b),
                _ => Some(i),
            })
            .expect("enough candidates")
    };
    let mut allowed = vec![true; e_count];
    if n_group > 1 && topk_group < n_group {
        let group_score: Vec<f64> = (0..n_group)
            .map(|g| {
                let mut v = choice[g * per_group..(g + 1) * per_group].to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                v.iter().take(2).sum()
            })
            .collect();
        let mut kept = vec![false; n_group];
        for _ in 0..topk_group {
            let g = argmax(&|g| !kept[g], &group_score);
            kept[g] = true;
        }
        for (e, a) in allowed.iter_mut().enumerate() {
            *a = kept[e / per_group];
        }
    }
    let mut taken = vec![false; e_count];
    (0..k)
        .map(|_| {
            let e = argmax(&|e| allowed[e] && !taken[e], choice);
            taken[e] = true;
            e
        })
        .collect()
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

    // 1. Routing: scores (softmax over all experts, or a sigmoid each), the choice by the
    // scores plus the score bias (by the logits for a plain softmax router), group-limited
    // where configured, ties to the lower index; then capacity.
    let score_bias = optional(tensors, "router.score_bias", config.score_bias);
    let sigmoid_scoring = config.scoring == Scoring::Sigmoid;
    let mut scores = vec![0.0; t_count * e_count];
    let mut indices = Vec::with_capacity(t_count * k);
    for t in 0..t_count {
        let xt = &x[t * m..(t + 1) * m];
        let logits: Vec<f64> = (0..e_count)
            .map(|e| {
                let dot: f64 = xt.iter().zip(&w_r[e * m..(e + 1) * m]).map(|(a, b)| a * b).sum();
                dot + b_r.as_ref().map_or(0.0, |b| b[e])
            })
            .collect();
        let row = &mut scores[t * e_count..(t + 1) * e_count];
        if sigmoid_scoring {
            row.iter_mut().zip(&logits).for_each(|(s, l)| *s = sigmoid(*l));
        } else {
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            row.iter_mut()
                .zip(&logits)
                .for_each(|(s, l)| *s = (l - max).exp() / sum);
        }
        let choice: Vec<f64> = match (&score_bias, sigmoid_scoring) {
            (None, false) => logits,
            (bias, _) => (0..e_count)
                .map(|e| row[e] + bias.as_ref().map_or(0.0, |b| b[e]))
                .collect(),
        };
        indices.extend(choose(&choice, k, config.n_group, config.topk_group));
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
        let p: Vec<f64> = chosen.iter().map(|&e| scores[t * e_count + e]).collect();
        let norm = match (config.normalize_topk, sigmoid_scoring) {
            (false, _) => 1.0,
            (true, false) => p.iter().sum::<f64>(),
            (true, true) => p.iter().sum::<f64>() + 1e-20,
        };
        let scale = config.routed_scaling_factor;
        // `unit` are the weights before the scaling factor.
        let unit: Vec<f64> = p.iter().map(|v| v / norm).collect();
        let w: Vec<f64> = unit.iter().map(|v| v * scale).collect();
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
        // Through the weights: scaling, normalisation, then the scores.
        let g_p: Vec<f64> = if config.normalize_topk {
            let dot: f64 = grad_w.iter().zip(&unit).map(|(g, v)| g * v).sum();
            grad_w.iter().map(|g| scale * (g - dot) / norm).collect()
        } else {
            grad_w.iter().map(|g| scale * g).collect()
        };
        let mut g_scores = vec![0.0; e_count];
        for (j, &e) in chosen.iter().enumerate() {
            g_scores[e] += g_p[j];
        }
        let row = &scores[t * e_count..(t + 1) * e_count];
        let dot: f64 = g_scores.iter().zip(row).map(|(g, p)| g * p).sum();
        for e in 0..e_count {
            let g_logit = if sigmoid_scoring {
                g_scores[e] * row[e] * (1.0 - row[e])
            } else {
                row[e] * (g_scores[e] - dot)
            };
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
    if config.score_bias {
        // Used for choosing only: piecewise constant, no gradient.
        grads.insert("router.score_bias", vec![0.0; e_count]);
    }
    if config.bias {
        grads.insert("experts.b_in", d_b_in);
        grads.insert("experts.b_out", d_b_out);
    }

    // 3. The shared expert: y += σ(x · gate) · (silu(x · Wg) ⊙ x · Wu) · W_out, without the
    // σ factor where it is ungated.
    if let Some(hs) = config.shared_expert {
        let s_in = values(tensors, "shared.w_in");
        let s_out = values(tensors, "shared.w_out");
        let gate = optional(tensors, "shared.gate.weight", config.shared_expert_gate);
        let (mut d_in, mut d_out, mut d_gate) = (vec![0.0; m * 2 * hs], vec![0.0; hs * m], vec![0.0; m]);
        for t in 0..t_count {
            let xt = &x[t * m..(t + 1) * m];
            let pt = &probe[t * m..(t + 1) * m];
            let mut inner = vec![0.0; 2 * hs];
            vec_mat(xt, &s_in, 2 * hs, &mut inner);
            let hidden = act_forward(Activation::SwiGlu, &inner);
            let mut o = vec![0.0; m];
            vec_mat(&hidden, &s_out, m, &mut o);
            let s = gate
                .as_ref()
                .map_or(1.0, |g| sigmoid(xt.iter().zip(g).map(|(a, b)| a * b).sum()));
            for c in 0..m {
                y[t * m + c] += s * o[c];
            }
            if let Some(gate) = &gate {
                let g_s: f64 = pt.iter().zip(&o).map(|(a, b)| a * b).sum();
                let g_u = g_s * s * (1.0 - s);
                for c in 0..m {
                    d_gate[c] += g_u * xt[c];
                    dx[t * m + c] += g_u * gate[c];
                }
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
        if config.shared_expert_gate {
            grads.insert("shared.gate.weight", d_gate);
        }
    }
    Golden { y, dx, grads }
}
