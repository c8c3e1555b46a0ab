//! An independent float64 oracle of the reference function (`tests/data/cases/README.md`) and its
//! gradients, in plain loops.
//!
//! It shares no code with the layer beyond the capacity rule, and no code with burn at all,
//! so a case it generates checks the layer against the spec rather than against itself.

use std::collections::BTreeMap;

use super::oracle_math::{act_backward, act_forward, mat_vec, outer, sigmoid, vec_mat};
use crate::dispatch::{capacity_for, CapacityDecision};
use crate::experts::Activation;
use crate::layer::MoeLayerConfig;
use crate::layer::TensorMap;
use crate::router::Scoring;

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

/// The routed experts' parameters, as float64 rows.
struct Params {
    w_r: Vec<f64>,
    b_r: Option<Vec<f64>>,
    w_in: Vec<f64>,
    b_in: Option<Vec<f64>>,
    w_out: Vec<f64>,
    b_out: Option<Vec<f64>>,
}

/// The routed parameters' gradients, accumulated over the tokens.
struct Grads {
    w_r: Vec<f64>,
    b_r: Vec<f64>,
    w_in: Vec<f64>,
    b_in: Vec<f64>,
    w_out: Vec<f64>,
    b_out: Vec<f64>,
}

/// The batch's routing: every token's scores and choices, and which assignments capacity kept.
struct Choices {
    /// `[n_tokens, n_experts]`: the softmax, or a sigmoid each.
    scores: Vec<f64>,
    /// `[n_tokens * top_k]`, best first.
    indices: Vec<usize>,
    /// `[n_tokens * top_k]`
    kept: Vec<bool>,
}

/// Runs the reference function forward and backward on `tensors` (weights, `x`, `probe`).
pub(crate) fn golden(config: &MoeLayerConfig, tensors: &TensorMap) -> Golden {
    let (m, h, e_count) = (config.d_model, config.d_hidden, config.n_experts);
    let f = config.activation.d_inner(h);
    let x = values(tensors, "x");
    let probe = values(tensors, "probe");
    let t_count = x.len() / m;
    let p = Params {
        w_r: values(tensors, "router.weight"),
        b_r: optional(tensors, "router.bias", config.router_bias),
        w_in: values(tensors, "experts.w_in"),
        b_in: optional(tensors, "experts.b_in", config.bias),
        w_out: values(tensors, "experts.w_out"),
        b_out: optional(tensors, "experts.b_out", config.bias),
    };
    let mut g = Grads {
        w_r: vec![0.0; e_count * m],
        b_r: vec![0.0; e_count],
        w_in: vec![0.0; e_count * m * f],
        b_in: vec![0.0; e_count * f],
        w_out: vec![0.0; e_count * h * m],
        b_out: vec![0.0; e_count * m],
    };
    let mut y = vec![0.0; t_count * m];
    let mut dx = vec![0.0; t_count * m];

    // 1. Routing.
    let score_bias = optional(tensors, "router.score_bias", config.score_bias);
    let choices = route(config, &p, &x, score_bias.as_deref());

    // 2. Experts, combine, and their backward, token by token.
    for t in 0..t_count {
        let rows = t * m..(t + 1) * m;
        routed_token(
            config,
            &p,
            &mut g,
            &choices,
            t,
            (&x[rows.clone()], &probe[rows.clone()]),
            (&mut y[rows.clone()], &mut dx[rows]),
        );
    }

    let mut grads = BTreeMap::from([
        ("router.weight", g.w_r),
        ("experts.w_in", g.w_in),
        ("experts.w_out", g.w_out),
    ]);
    if config.router_bias {
        grads.insert("router.bias", g.b_r);
    }
    if config.score_bias {
        // Used for choosing only: piecewise constant, no gradient.
        grads.insert("router.score_bias", vec![0.0; e_count]);
    }
    if config.bias {
        grads.insert("experts.b_in", g.b_in);
        grads.insert("experts.b_out", g.b_out);
    }

    // 3. The shared expert.
    if let Some(hs) = config.shared_expert {
        shared_expert(config, tensors, hs, (&x, &probe), (&mut y, &mut dx), &mut grads);
    }
    Golden { y, dx, grads }
}

/// Step 1: scores (softmax over all experts, or a sigmoid each), the choice by the scores plus
/// the score bias (by the logits where there is none), group-limited where configured,
/// ties to the lower index; then capacity.
fn route(config: &MoeLayerConfig, p: &Params, x: &[f64], score_bias: Option<&[f64]>) -> Choices {
    let (m, e_count, k) = (config.d_model, config.n_experts, config.top_k);
    let t_count = x.len() / m;
    let sigmoid_scoring = config.scoring == Scoring::Sigmoid;
    let mut scores = vec![0.0; t_count * e_count];
    let mut indices = Vec::with_capacity(t_count * k);
    for t in 0..t_count {
        let xt = &x[t * m..(t + 1) * m];
        let logits: Vec<f64> = (0..e_count)
            .map(|e| {
                let dot: f64 = xt
                    .iter()
                    .zip(&p.w_r[e * m..(e + 1) * m])
                    .map(|(a, b)| a * b)
                    .sum();
                dot + p.b_r.as_ref().map_or(0.0, |b| b[e])
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
        // Without a score bias the logits order the experts as the scores do.
        let choice: Vec<f64> = match score_bias {
            None => logits,
            Some(bias) => (0..e_count).map(|e| row[e] + bias[e]).collect(),
        };
        indices.extend(choose(&choice, k, config.n_group, config.topk_group));
    }
    let capacity = config
        .capacity_factor
        .map(|c| capacity_for(c, t_count, k, e_count));
    let kept = CapacityDecision::decide(&indices, e_count, capacity, &vec![0; e_count]).kept;
    Choices {
        scores,
        indices,
        kept,
    }
}

/// Step 2 for token `t`: its kept experts, weighted, onto `y_t`; then the backward of
/// `loss = Σ probe · y` through the experts and the combine weights to the router, onto `dx_t`.
fn routed_token(
    config: &MoeLayerConfig,
    p: &Params,
    g: &mut Grads,
    choices: &Choices,
    t: usize,
    (xt, pt): (&[f64], &[f64]),
    (y_t, dx_t): (&mut [f64], &mut [f64]),
) {
    let (e_count, k) = (config.n_experts, config.top_k);
    let sigmoid_scoring = config.scoring == Scoring::Sigmoid;
    let chosen = &choices.indices[t * k..(t + 1) * k];
    let row = &choices.scores[t * e_count..(t + 1) * e_count];
    let picked: Vec<f64> = chosen.iter().map(|&e| row[e]).collect();
    let norm = match (config.normalize_topk, sigmoid_scoring) {
        (false, _) => 1.0,
        (true, false) => picked.iter().sum::<f64>(),
        (true, true) => picked.iter().sum::<f64>() + 1e-20,
    };
    let scale = config.routed_scaling_factor;
    // `unit` are the weights before the scaling factor.
    let unit: Vec<f64> = picked.iter().map(|v| v / norm).collect();
    let mut grad_w = vec![0.0; k];
    for (j, &e) in chosen.iter().enumerate() {
        if choices.kept[t * k + j] {
            grad_w[j] = expert_assignment(config, p, g, e, unit[j] * scale, (xt, pt), (y_t, dx_t));
        }
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
    let m = config.d_model;
    let dot: f64 = g_scores.iter().zip(row).map(|(g, p)| g * p).sum();
    for e in 0..e_count {
        let g_logit = if sigmoid_scoring {
            g_scores[e] * row[e] * (1.0 - row[e])
        } else {
            row[e] * (g_scores[e] - dot)
        };
        g.b_r[e] += g_logit;
        for c in 0..m {
            g.w_r[e * m + c] += g_logit * xt[c];
            dx_t[c] += g_logit * p.w_r[e * m + c];
        }
    }
}

/// One kept assignment of a token (`xt`) to expert `e` with combine weight `w`: adds
/// `w · FFN_e(xt)` to `y_t`, the expert's parameter gradients to `g` and the gradient through
/// the expert to `dx_t`; returns the loss's gradient with respect to `w`.
fn expert_assignment(
    config: &MoeLayerConfig,
    p: &Params,
    g: &mut Grads,
    e: usize,
    w: f64,
    (xt, pt): (&[f64], &[f64]),
    (y_t, dx_t): (&mut [f64], &mut [f64]),
) -> f64 {
    let (m, h) = (config.d_model, config.d_hidden);
    let f = config.activation.d_inner(h);
    let (wi, wo) = (
        &p.w_in[e * m * f..(e + 1) * m * f],
        &p.w_out[e * h * m..(e + 1) * h * m],
    );
    // With the weight on the input the expert sees `w · xt` and its output is added as is;
    // otherwise it sees `xt` and its output is scaled by `w`.
    let (w_in, w_out) = if config.weights_on_input {
        (w, 1.0)
    } else {
        (1.0, w)
    };
    let v: Vec<f64> = xt.iter().map(|a| a * w_in).collect();
    let mut z = p
        .b_in
        .as_ref()
        .map_or(vec![0.0; f], |b| b[e * f..(e + 1) * f].to_vec());
    vec_mat(&v, wi, f, &mut z);
    let a = act_forward(config.activation, &z);
    let mut o = p
        .b_out
        .as_ref()
        .map_or(vec![0.0; m], |b| b[e * m..(e + 1) * m].to_vec());
    vec_mat(&a, wo, m, &mut o);
    for c in 0..m {
        y_t[c] += w_out * o[c];
    }
    // Backward: loss = Σ probe · y.
    let g_o: Vec<f64> = pt.iter().map(|p| p * w_out).collect();
    outer(&a, &g_o, &mut g.w_out[e * h * m..(e + 1) * h * m]);
    g.b_out[e * m..(e + 1) * m]
        .iter_mut()
        .zip(&g_o)
        .for_each(|(d, g)| *d += g);
    let mut g_a = vec![0.0; h];
    mat_vec(wo, &g_o, &mut g_a);
    let g_z = act_backward(config.activation, &z, &g_a);
    outer(&v, &g_z, &mut g.w_in[e * m * f..(e + 1) * m * f]);
    g.b_in[e * f..(e + 1) * f]
        .iter_mut()
        .zip(&g_z)
        .for_each(|(d, g)| *d += g);
    let mut g_v = vec![0.0; m];
    mat_vec(wi, &g_z, &mut g_v);
    for c in 0..m {
        dx_t[c] += w_in * g_v[c];
    }
    if config.weights_on_input {
        xt.iter().zip(&g_v).map(|(a, b)| a * b).sum()
    } else {
        pt.iter().zip(&o).map(|(a, b)| a * b).sum()
    }
}

/// Step 3: `y += σ(x · gate) · (silu(x · Wg) ⊙ x · Wu) · W_out`, without the σ factor where it
/// is ungated, and its backward.
fn shared_expert(
    config: &MoeLayerConfig,
    tensors: &TensorMap,
    hs: usize,
    (x, probe): (&[f64], &[f64]),
    (y, dx): (&mut [f64], &mut [f64]),
    grads: &mut BTreeMap<&'static str, Vec<f64>>,
) {
    let m = config.d_model;
    let s_in = values(tensors, "shared.w_in");
    let s_out = values(tensors, "shared.w_out");
    let gate = optional(tensors, "shared.gate.weight", config.shared_expert_gate);
    let (mut d_in, mut d_out, mut d_gate) = (vec![0.0; m * 2 * hs], vec![0.0; hs * m], vec![0.0; m]);
    for t in 0..x.len() / m {
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
