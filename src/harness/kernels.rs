//! The backend ops a layer and a model run beside their GEMMs (the experts' activations, the
//! decoder blocks' norm, rotations, attention weights and dense SwiGLU, the token loss), each against its
//! composed default on the same backend and the same inputs, forward and backward, and the
//! router's choice on the device against the host's (`choice.rs`): what the
//! GPU check runs on CUDA, raw and under fusion, where the CubeCL kernels are compiled for a
//! GPU (the crate's tests run the same list on WGPU).
//!
//! Each op is compared on shapes that are no multiple of a cube's threads, the attention
//! weights under a causal mask with a hidden key per row besides, and the clamped SwiGLU with
//! values past its bounds. The ops are element-wise or row-wise (no product goes through a
//! tensor core), so the tolerance is f32's: `1e-5` of the largest value of the composed result.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Bool, Distribution, Int, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use crate::decoder;
use crate::experts;
use crate::loss;
use crate::MoeBackend;

/// A check's label and its outcome: `Ok` with a note (the error found), `Err` with why it failed.
pub type KernelCheck = (String, Result<String, String>);

/// Largest error allowed, relative to the largest magnitude of the composed result.
const TOLERANCE: f64 = 1e-5;

/// Every op of the module docs on backend `B` against its composed form on `device`.
pub fn kernel_checks<B: MoeBackend>(device: &B::Device) -> Vec<KernelCheck> {
    let mut checks = activation_checks::<B>(device);
    checks.extend(decoder_checks::<B>(device));
    checks.extend(loss_checks::<B>(device));
    checks.extend(super::choice::choice_checks::<B>(device));
    checks
}

fn random<B: MoeBackend, const D: usize>(shape: [usize; D], sd: f64, device: &B::Device) -> FloatTensor<B> {
    Tensor::<B, D>::random(shape, Distribution::Normal(0.0, sd), device)
        .into_primitive()
        .tensor()
}

/// Every value of `t` in row-major order.
fn values<B: MoeBackend>(t: FloatTensor<B>) -> Vec<f64> {
    let n = t.shape().num_elements();
    let flat = B::float_reshape(t, [n].into());
    Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(flat))
        .into_data()
        .convert::<f64>()
        .to_vec::<f64>()
        .unwrap_or_default()
}

/// `got` against `want` under `label`.
fn compare<B: MoeBackend>(label: &str, got: FloatTensor<B>, want: FloatTensor<B>) -> KernelCheck {
    let label = format!("kernel {label}");
    let (got_shape, want_shape) = (got.shape().to_vec(), want.shape().to_vec());
    if got_shape != want_shape {
        return (
            label,
            Err(format!("shape {got_shape:?}, the composed form's {want_shape:?}")),
        );
    }
    let (got, want) = (values::<B>(got), values::<B>(want));
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    if scale == 0.0 || got.len() != want.len() {
        return (
            label,
            Err("the composed result is all zeros or unreadable".into()),
        );
    }
    let worst = got
        .iter()
        .zip(&want)
        .map(|(g, w)| {
            if g.is_nan() != w.is_nan() {
                f64::INFINITY
            } else {
                (g - w).abs() / scale
            }
        })
        .fold(0.0f64, |m, e| m.max(e));
    let note = format!("max_rel_err={worst:.2e}");
    match worst <= TOLERANCE {
        true => (label, Ok(note)),
        false => (label, Err(format!("{note} over {TOLERANCE:.0e}"))),
    }
}

fn activation_checks<B: MoeBackend>(device: &B::Device) -> Vec<KernelCheck> {
    let (rows, h) = (37, 45);
    let z = random::<B, 2>([rows, 2 * h], 4.0, device);
    let gate = random::<B, 2>([rows, h], 2.0, device);
    let grad = random::<B, 2>([rows, h], 1.0, device);
    // Past the bound at 4 sd's 1.5: about a third of the halves clamp.
    let (alpha, limit) = (1.702, 6.0);
    let mut checks = vec![
        compare::<B>(
            "gelu",
            B::gelu_exact(gate.clone()),
            <B as burn::tensor::ops::ActivationOps<B>>::gelu(gate.clone()),
        ),
        compare::<B>(
            "gelu backward",
            B::gelu_backward_exact(gate.clone(), grad.clone()),
            experts::gelu_backward_composed::<B>(gate.clone(), grad.clone()),
        ),
        compare::<B>(
            "swiglu",
            B::swiglu(z.clone()),
            experts::swiglu_composed::<B>(z.clone()),
        ),
        compare::<B>(
            "swiglu backward",
            B::swiglu_backward(z.clone(), grad.clone()),
            experts::swiglu_backward_composed::<B>(z.clone(), grad.clone()),
        ),
        compare::<B>(
            "clamped swiglu",
            B::clamped_swiglu(z.clone(), alpha, limit),
            experts::clamped_swiglu_composed::<B>(z.clone(), alpha, limit),
        ),
        compare::<B>(
            "clamped swiglu backward",
            B::clamped_swiglu_backward(z.clone(), grad.clone(), alpha, limit),
            experts::clamped_swiglu_backward_composed::<B>(z.clone(), grad.clone(), alpha, limit),
        ),
    ];
    // The value and the derivative from one kernel, each against its composed form.
    let pairs = [
        (
            "gelu",
            B::gelu_with_backward_exact(gate.clone(), grad.clone()),
            <B as burn::tensor::ops::ActivationOps<B>>::gelu(gate.clone()),
            experts::gelu_backward_composed::<B>(gate, grad.clone()),
        ),
        (
            "swiglu",
            B::swiglu_with_backward(z.clone(), grad.clone()),
            experts::swiglu_composed::<B>(z.clone()),
            experts::swiglu_backward_composed::<B>(z.clone(), grad.clone()),
        ),
        (
            "clamped swiglu",
            B::clamped_swiglu_with_backward(z.clone(), grad.clone(), alpha, limit),
            experts::clamped_swiglu_composed::<B>(z.clone(), alpha, limit),
            experts::clamped_swiglu_backward_composed::<B>(z, grad, alpha, limit),
        ),
    ];
    for (name, (value, derivative), want_value, want_derivative) in pairs {
        checks.push(compare::<B>(
            &format!("{name} with backward: value"),
            value,
            want_value,
        ));
        checks.push(compare::<B>(
            &format!("{name} with backward: derivative"),
            derivative,
            want_derivative,
        ));
    }
    checks
}

/// A causal `[rows, seq, keys]` mask over the last `seq` keys that also hides one earlier key
/// per query, as a left-padded row does.
fn causal<B: MoeBackend>(rows: usize, seq: usize, keys: usize, device: &B::Device) -> Tensor<B, 3, Bool> {
    let hidden: Vec<bool> = (0..rows * seq * keys)
        .map(|i| {
            let (r, q, k) = (i / (seq * keys), i / keys % seq, i % keys);
            k > keys - seq + q || k == (q + r) % (keys - seq + 1)
        })
        .collect();
    Tensor::from_data(TensorData::new(hidden, [rows, seq, keys]), device)
}

fn decoder_checks<B: MoeBackend>(device: &B::Device) -> Vec<KernelCheck> {
    // The dense blocks' SwiGLU, the decoder's route to the experts' kernel.
    let (rows, h) = (37, 45);
    let z = random::<B, 2>([rows, 2 * h], 4.0, device);
    let grad = random::<B, 2>([rows, h], 1.0, device);
    let mut checks = vec![
        compare::<B>(
            "gated silu",
            <B as decoder::DecoderKernels>::gated_silu(z.clone()),
            experts::swiglu_composed::<B>(z.clone()),
        ),
        compare::<B>(
            "gated silu backward",
            <B as decoder::DecoderKernels>::gated_silu_backward(z.clone(), grad.clone()),
            experts::swiglu_backward_composed::<B>(z, grad.clone()),
        ),
    ];
    // The same on the two halves given apart (a dense MLP's two projections).
    let (gate, up) = (
        random::<B, 2>([rows, h], 4.0, device),
        random::<B, 2>([rows, h], 4.0, device),
    );
    checks.push(compare::<B>(
        "gated silu of two halves",
        B::gated_silu_pair(gate.clone(), up.clone()),
        decoder::gated_silu_pair_composed::<B>(gate.clone(), up.clone()),
    ));
    let (d_gate, d_up) = B::gated_silu_pair_backward(gate.clone(), up.clone(), grad.clone());
    let (want_gate, want_up) = decoder::gated_silu_pair_backward_composed::<B>(gate, up, grad);
    checks.push(compare::<B>(
        "gated silu of two halves backward, gate",
        d_gate,
        want_gate,
    ));
    checks.push(compare::<B>(
        "gated silu of two halves backward, up",
        d_up,
        want_up,
    ));
    // The norm, on rows narrower and wider than a cube.
    for width in [29, 1000] {
        let x = random::<B, 2>([37, width], 2.0, device);
        let weight = Tensor::<B, 1>::random([width], Distribution::Uniform(0.5, 1.5), device)
            .into_primitive()
            .tensor();
        let grad = random::<B, 2>([37, width], 1.0, device);
        let eps = 1e-6;
        checks.push(compare::<B>(
            &format!("rms norm, width {width}"),
            B::rms_norm(x.clone(), weight.clone(), eps),
            decoder::rms_norm_composed::<B>(x.clone(), weight.clone(), eps),
        ));
        let (dx, dw) = B::rms_norm_backward(x.clone(), weight.clone(), grad.clone(), eps, true);
        let (want_dx, want_dw) =
            decoder::rms_norm_backward_composed::<B>(x.clone(), weight.clone(), grad.clone(), eps, true);
        checks.push(compare::<B>(
            &format!("rms norm backward x, width {width}"),
            dx,
            want_dx.clone(),
        ));
        checks.push(compare::<B>(
            &format!("rms norm backward weight, width {width}"),
            dw.expect("asked for"),
            want_dw.expect("asked for"),
        ));
        // Without the weight's gradient (a frozen weight): the kernel writes no products.
        let (dx, _) = B::rms_norm_backward(x, weight, grad, eps, false);
        checks.push(compare::<B>(
            &format!("rms norm backward x without the weight's, width {width}"),
            dx,
            want_dx,
        ));
    }
    // Both rotations, with one table for every batch row and one each.
    let (batch, seq, heads, head_dim) = (2, 7, 3, 16);
    for rows in [1, batch] {
        let x = random::<B, 4>([batch, seq, heads, head_dim], 1.0, device);
        let cos = random::<B, 3>([rows, seq, head_dim], 1.0, device);
        let sin = random::<B, 3>([rows, seq, head_dim], 1.0, device);
        let what = |op: &str| format!("{op}, table rows {rows}");
        checks.push(compare::<B>(
            &what("rotate half"),
            B::rotate_half_seq_major(x.clone(), cos.clone(), sin.clone()),
            decoder::rotate_half_seq_major_composed::<B>(x.clone(), cos.clone(), sin.clone()),
        ));
        checks.push(compare::<B>(
            &what("rotate half backward"),
            B::rotate_half_seq_major_backward(x.clone(), cos.clone(), sin.clone()),
            decoder::rotate_half_seq_major_backward_composed::<B>(x.clone(), cos.clone(), sin.clone()),
        ));
        checks.push(compare::<B>(
            &what("rotate pairs"),
            B::rotate_pairs_seq_major(x.clone(), cos.clone(), sin.clone()),
            decoder::rotate_pairs_seq_major_composed::<B>(x.clone(), cos.clone(), sin.clone()),
        ));
        checks.push(compare::<B>(
            &what("rotate pairs backward"),
            B::rotate_pairs_seq_major_backward(x.clone(), cos.clone(), sin.clone()),
            decoder::rotate_pairs_seq_major_backward_composed::<B>(x.clone(), cos.clone(), sin.clone()),
        ));
        // Written head-major, and the transpose of a head-major gradient seen sequence-major
        // (a view), as the node's backward reads it.
        let grad = B::float_swap_dims(random::<B, 4>([batch, heads, seq, head_dim], 1.0, device), 1, 2);
        for (form, pairs) in [("half", false), ("pairs", true)] {
            checks.push(compare::<B>(
                &what(&format!("rotate {form} to heads")),
                B::rotate_seq_major_to_heads(x.clone(), cos.clone(), sin.clone(), pairs),
                decoder::rotate_to_heads_composed::<B>(x.clone(), cos.clone(), sin.clone(), pairs),
            ));
        }
        checks.push(compare::<B>(
            &what("rotate half backward, head-major gradient"),
            B::rotate_half_seq_major_backward(grad.clone(), cos.clone(), sin.clone()),
            decoder::rotate_half_seq_major_backward_composed::<B>(grad.clone(), cos.clone(), sin.clone()),
        ));
        checks.push(compare::<B>(
            &what("rotate pairs backward, head-major gradient"),
            B::rotate_pairs_seq_major_backward(grad.clone(), cos.clone(), sin.clone()),
            decoder::rotate_pairs_seq_major_backward_composed::<B>(grad, cos, sin),
        ));
        // Latent attention's rotations: the query's (the first `pass` values of each head kept,
        // the rest rotated) and the keys' (the first `skip` left out), the tables as wide as
        // the rotated part, written head-major, and the transposes.
        for (skip, pass) in [(0, 6), (4, 0)] {
            let rotated = head_dim - skip - pass;
            let cos = random::<B, 3>([rows, seq, rotated], 1.0, device);
            let sin = random::<B, 3>([rows, seq, rotated], 1.0, device);
            let grad = random::<B, 4>([batch, heads, seq, head_dim - skip], 1.0, device);
            for (name, interleaved) in [("half", false), ("interleaved", true)] {
                let form = decoder::TailRotation {
                    interleaved,
                    skip,
                    pass,
                };
                let label = format!("rotate {name} after {skip} left out and {pass} kept");
                checks.push(compare::<B>(
                    &what(&format!("{label}, to heads")),
                    B::rotate_tail_to_heads(x.clone(), cos.clone(), sin.clone(), form),
                    decoder::rotate_tail_to_heads_composed::<B>(x.clone(), cos.clone(), sin.clone(), form),
                ));
                checks.push(compare::<B>(
                    &what(&format!("{label}, backward")),
                    B::rotate_tail_to_heads_backward(grad.clone(), cos.clone(), sin.clone(), form),
                    decoder::rotate_tail_to_heads_backward_composed::<B>(
                        grad.clone(),
                        cos.clone(),
                        sin.clone(),
                        form,
                    ),
                ));
            }
        }
    }
    // The norm of each row's first columns of a wider tensor (DeepSeek's latent), each way.
    let (rows, width, total) = (37, 29, 35);
    let x = random::<B, 2>([rows, total], 2.0, device);
    let weight = Tensor::<B, 1>::random([width], Distribution::Uniform(0.5, 1.5), device)
        .into_primitive()
        .tensor();
    let grad = random::<B, 2>([rows, width], 1.0, device);
    let (eps, front) = (1e-6, |x: FloatTensor<B>| {
        B::float_slice(x, &[(0..rows).into(), (0..width).into()])
    });
    checks.push(compare::<B>(
        "rms norm of the first columns",
        B::rms_norm_columns(x.clone(), weight.clone(), eps),
        decoder::rms_norm_composed::<B>(front(x.clone()), weight.clone(), eps),
    ));
    let (dx, dw) = B::rms_norm_columns_backward(x.clone(), weight.clone(), grad.clone(), eps, true);
    let (want_dx, want_dw) = decoder::rms_norm_backward_composed::<B>(front(x), weight, grad, eps, true);
    let zeros = B::float_zeros([rows, total - width].into(), device, want_dx.dtype().into());
    checks.push(compare::<B>(
        "rms norm of the first columns backward, x",
        dx,
        B::float_cat(vec![want_dx, zeros], 1),
    ));
    checks.push(compare::<B>(
        "rms norm of the first columns backward, weight",
        dw.expect("asked for"),
        want_dw.expect("asked for"),
    ));
    // Latent attention's keys and values, each way.
    let (batch, seq, heads, nope, v, rope) = (2, 7, 3, 12, 10, 6);
    let kv = random::<B, 4>([batch, seq, heads, nope + v], 1.0, device);
    let k_rot = random::<B, 4>([batch, 1, seq, rope], 1.0, device);
    let what = |op: &str| format!("{op}, [{batch}, {seq}, {heads}], nope {nope}, v {v}, rope {rope}");
    checks.push(compare::<B>(
        &what("latent keys"),
        B::latent_keys(kv.clone(), k_rot.clone(), nope),
        decoder::latent_keys_composed::<B>(kv.clone(), k_rot, nope),
    ));
    checks.push(compare::<B>(
        &what("latent values"),
        B::latent_values(kv.clone(), nope),
        decoder::latent_values_composed::<B>(kv, nope),
    ));
    let grad = random::<B, 4>([batch, heads, seq, nope + rope], 1.0, device);
    let ((dkv, drot), (want_kv, want_rot)) = (
        B::latent_keys_backward(grad.clone(), nope, v),
        decoder::latent_keys_backward_composed::<B>(grad, nope, v),
    );
    checks.push(compare::<B>(&what("latent keys backward, kv"), dkv, want_kv));
    checks.push(compare::<B>(
        &what("latent keys backward, rotary key"),
        drot,
        want_rot,
    ));
    let grad = random::<B, 4>([batch, heads, seq, v], 1.0, device);
    checks.push(compare::<B>(
        &what("latent values backward"),
        B::latent_values_backward(grad.clone(), nope),
        decoder::latent_values_backward_composed::<B>(grad, nope),
    ));
    // Attention's weights, plain and with sinks, rows shorter and longer than a cube.
    for (seq, keys) in [(5, 9), (6, 70)] {
        let (batch, heads, scale) = (2, 3, 0.3);
        let scores = random::<B, 4>([batch, heads, seq, keys], 3.0, device);
        let grad = random::<B, 4>([batch, heads, seq, keys], 1.0, device);
        let hidden = causal::<B>(batch, seq, keys, device).into_primitive();
        let sinks = random::<B, 1>([heads], 1.0, device);
        let what = |op: &str| format!("{op}, [{batch}, {heads}, {seq}, {keys}]");
        let want = decoder::attention_softmax_composed::<B>(scores.clone(), Some(hidden.clone()), scale);
        checks.push(compare::<B>(
            &what("attention softmax"),
            B::attention_softmax(scores.clone(), Some(hidden.clone()), scale),
            want.clone(),
        ));
        checks.push(compare::<B>(
            &what("attention softmax backward"),
            B::attention_softmax_backward(want.clone(), grad.clone(), scale),
            decoder::attention_softmax_backward_composed::<B>(want, grad.clone(), scale),
        ));
        let (want, want_shares) = decoder::attention_softmax_sinks_composed::<B>(
            scores.clone(),
            Some(hidden.clone()),
            sinks.clone(),
            scale,
        );
        let (probs, shares) = B::attention_softmax_sinks(scores, Some(hidden), sinks, scale);
        checks.push(compare::<B>(&what("attention sinks"), probs, want.clone()));
        checks.push(compare::<B>(
            &what("attention sinks shares"),
            shares,
            want_shares.clone(),
        ));
        let (ds, dk) =
            B::attention_softmax_sinks_backward(want.clone(), want_shares.clone(), grad.clone(), scale);
        let (want_ds, want_dk) =
            decoder::attention_softmax_sinks_backward_composed::<B>(want, want_shares, grad, scale);
        checks.push(compare::<B>(
            &what("attention sinks backward scores"),
            ds,
            want_ds,
        ));
        checks.push(compare::<B>(&what("attention sinks backward sinks"), dk, want_dk));
    }
    checks
}

fn loss_checks<B: MoeBackend>(device: &B::Device) -> Vec<KernelCheck> {
    let (n_tokens, vocab) = (23, 300);
    let logits = random::<B, 2>([n_tokens, vocab], 3.0, device);
    // Every fifth target ignored (negative), as padding is.
    let targets: Vec<i64> = (0..n_tokens as i64)
        .map(|i| if i % 5 == 4 { -100 } else { (i * 37) % vocab as i64 })
        .collect();
    let targets = || -> IntTensor<B> {
        Tensor::<B, 1, Int>::from_data(TensorData::new(targets.clone(), [n_tokens]), device).into_primitive()
    };
    let grad = random::<B, 1>([n_tokens], 1.0, device);
    let (nll, lse) = B::token_nll_forward(logits.clone(), targets());
    let (want_nll, want_lse) = loss::token_nll_forward_composed::<B>(logits.clone(), targets());
    vec![
        compare::<B>("token loss", nll, want_nll),
        compare::<B>("token loss log-sum-exp", lse, want_lse.clone()),
        compare::<B>(
            "token loss backward",
            B::token_nll_backward(logits.clone(), targets(), want_lse.clone(), grad.clone()),
            loss::token_nll_backward_composed::<B>(logits, targets(), want_lse, grad),
        ),
    ]
}
