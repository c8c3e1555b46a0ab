//! Helpers shared by the integration tests of both crates (`tools/tests` includes this file by
//! path): scratch folders and copies of the checkpoint fixtures.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// An empty folder in the system's temporary folder, unique to `name` and this process.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mpipemoe-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Copies the files of folder `from` (not its subfolders) into `to`, creating it.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
}

/// The layer's finite check on backend `B`: an input with a NaN or an infinity anywhere is
/// refused by name, and one whose values are finite at their extremes (the largest magnitudes,
/// a subnormal, a negative zero) is not. The check multiplies the input by zero and sums it
/// (`layer/module.rs`); a backend that folded `x · 0` to zero would pass no NaN through and
/// fail the first half, and a check that flagged large values would fail the second.
pub fn holds_the_finite_check<B: mpipemoe::MoeBackend>(device: &B::Device) {
    use burn::tensor::{Tensor, TensorData};
    use mpipemoe::Scoring;
    let input = |at: usize, value: f32| {
        let mut values = vec![0.5f32; 24];
        values[at] = value;
        Tensor::<B, 2>::from_data(TensorData::new(values, [3, 8]), device)
    };
    // A router that chooses by its logits (the check reads them), and a sigmoid router with a
    // score bias (it chooses by scores, which a logit of -inf leaves finite, so the input's
    // own check is read with them).
    let plain = mpipemoe::MoeLayerConfig::new(8, 16, 4, 2);
    let biased = plain.clone().with_scoring(Scoring::Sigmoid).with_score_bias(true);
    for config in [plain, biased] {
        let layer = config.init::<B>(device);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 13, 23] {
                let err = match layer.try_forward(input(at, bad)) {
                    Ok(_) => panic!("{bad} at {at} was let through (score bias {})", config.score_bias),
                    Err(e) => e.to_string(),
                };
                assert!(err.contains("NaN or infinite"), "{err}");
            }
        }
        // f32::MAX overflows some logits to infinity: the input itself is then looked at,
        // and it is finite.
        for fine in [f32::MAX, -f32::MAX, f32::MIN_POSITIVE / 4.0, -0.0] {
            assert!(
                layer.try_forward(input(13, fine)).is_ok(),
                "the finite value {fine:e} was refused (score bias {})",
                config.score_bias
            );
        }
        // A finite input whose logits overflow: f32::MAX with the sign of each router weight
        // of the expert whose weights add up to the most in magnitude. The values read with
        // the routing are then not all finite, and the input itself must be looked at.
        let w = layer
            .router
            .weight
            .val()
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .unwrap();
        let mass = |e: usize| w[e * 8..e * 8 + 8].iter().map(|v| v.abs() as f64).sum::<f64>();
        let e = (0..4).max_by(|&a, &b| mass(a).total_cmp(&mass(b))).unwrap();
        assert!(
            mass(e) > 1.01,
            "no expert's logit overflows (weights {:.3})",
            mass(e)
        );
        let mut values = vec![0.5f32; 24];
        for (d, value) in values[8..16].iter_mut().enumerate() {
            *value = f32::MAX.copysign(w[e * 8 + d]);
        }
        let overflowing = Tensor::<B, 2>::from_data(TensorData::new(values, [3, 8]), device);
        assert!(
            layer.try_forward(overflowing).is_ok(),
            "a finite input whose logits overflow was refused (score bias {})",
            config.score_bias
        );
    }
}

/// `got` against `want` within `tolerance` of `want`'s largest magnitude, which must not be
/// zero (a zero twin would hold any op that writes zeros); `what` names the comparison.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tolerance: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    assert!(scale > 0.0, "{what}: the composed form is zero");
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0f64, f64::max);
    assert!(
        worst <= tolerance * scale,
        "{what}: {worst:e} off at scale {scale:e}"
    );
}

/// The layer's z-loss on backend `B` against its composed form on the same backend: the value
/// `coef / n_tokens · Σ_t logsumexp(logits_t)²` and the router's weight and bias gradients,
/// through burn's own autodiff of the composed ops. The layer's loss is one op
/// (`RouterKernels::router_z_loss`: one node under autodiff, a kernel and a sum on the CubeCL
/// backends); a wrong scale, a missing square or a gradient with the softmax of another row
/// fails it. Inputs of scale 30 put the logits far from zero, where each row's shift by its
/// maximum matters.
pub fn z_loss_matches_its_composed_form<B>(device: &B::Device)
where
    B: burn::tensor::backend::AutodiffBackend + mpipemoe::MoeBackend,
{
    use burn::tensor::{Distribution, Tensor};
    let (n_tokens, d_model, coef) = (40, 16, 0.05);
    let config = mpipemoe::MoeLayerConfig::new(d_model, 24, 6, 2)
        .with_z_loss_coef(coef)
        .with_router_bias(true)
        .with_seed(21);
    let layer: mpipemoe::MoeLayer<B> = config.init(device);
    let x = Tensor::<B, 2>::random([n_tokens, d_model], Distribution::Normal(0.0, 30.0), device);
    let out = layer.forward(x.clone());
    let got = out.z_loss.clone();
    let grads = got.clone().backward();
    let weight = layer.router.weight.val().detach().require_grad();
    let bias = layer
        .router
        .bias
        .as_ref()
        .expect("a router bias")
        .val()
        .detach()
        .require_grad();
    let logits = x.detach().matmul(weight.clone().transpose()) + bias.clone().unsqueeze::<2>();
    let shift = logits.clone().max_dim(1).detach();
    let lse = (logits - shift.clone()).exp().sum_dim(1).log() + shift;
    let want = lse.powi_scalar(2).sum() * (coef / n_tokens as f64);
    let want_grads = want.clone().backward();
    let values = |t: Tensor<B::InnerBackend, 1>| t.into_data().convert::<f64>().to_vec::<f64>().unwrap();
    let close = |what: &str, got: Vec<f64>, want: Vec<f64>| assert_close(what, &got, &want, 2e-5);
    close("z-loss", values(got.inner()), values(want.inner()));
    let flat = |t: Tensor<B::InnerBackend, 2>| values(t.flatten::<1>(0, 1));
    close(
        "router weight gradient",
        flat(layer.router.weight.grad(&grads).expect("a weight gradient")),
        flat(weight.grad(&want_grads).expect("the twin's weight gradient")),
    );
    close(
        "router bias gradient",
        values(
            layer
                .router
                .bias
                .as_ref()
                .unwrap()
                .grad(&grads)
                .expect("a bias gradient"),
        ),
        values(bias.grad(&want_grads).expect("the twin's bias gradient")),
    );
}

/// Attention's weights on backend `B` (`DecoderKernels::attention_softmax`: one node under
/// autodiff and one kernel each way on the CubeCL backends, burn's ops elsewhere) against
/// burn's `mask_fill` and `softmax` written out here: the weights and the scores' gradient for
/// a loss that weighs every weight differently, under a causal mask with one row for every
/// batch row and under one with a row each. A missing scale, a mask read from another batch
/// row or a gradient without the row's dot product fails it. The same with GPT-OSS's sinks
/// (`DecoderKernels::attention_softmax_sinks`) against the sink column concatenated, the
/// softmax and the column dropped, written out here, the sinks' gradient too: a sink left out
/// of the maximum or the sum, read for another head, scaled, or without its gradient fails.
pub fn attention_softmax_matches_burns_ops<B>(device: &B::Device)
where
    B: burn::tensor::backend::AutodiffBackend + mpipemoe::MoeBackend,
{
    use burn::tensor::activation::softmax;
    use burn::tensor::{Bool, Distribution, Tensor, TensorData, TensorPrimitive};
    let (batch, heads, seq, keys, scale) = (2, 3, 6, 9, 0.4);
    for rows in [1, batch] {
        // Causal over the last `seq` columns; row 1 (where there is one) hides its first two
        // columns as well, as a left-padded row would.
        let hidden: Vec<bool> = (0..rows * seq * keys)
            .map(|i| {
                let (r, q, k) = (i / (seq * keys), i / keys % seq, i % keys);
                k > keys - seq + q || (r == 1 && k < 2)
            })
            .collect();
        let hidden = Tensor::<B, 3, Bool>::from_data(TensorData::new(hidden, [rows, seq, keys]), device);
        let scores0 =
            Tensor::<B, 4>::random([batch, heads, seq, keys], Distribution::Normal(0.0, 3.0), device);
        let weigh = Tensor::<B, 4>::random([batch, heads, seq, keys], Distribution::Default, device);
        let scores = scores0.clone().require_grad();
        let probs = B::attention_softmax(
            scores.clone().into_primitive().tensor(),
            Some(hidden.clone().into_primitive()),
            scale,
        );
        let probs = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(probs));
        let grads = (probs.clone() * weigh.clone()).sum().backward();
        // The scaled scores with the hidden keys at -inf, written out with burn's ops.
        let masked = |twin: Tensor<B, 4>| {
            (twin * scale).mask_fill(
                hidden
                    .clone()
                    .unsqueeze_dim::<4>(1)
                    .expand([batch, heads, seq, keys]),
                f32::NEG_INFINITY,
            )
        };
        let twin = scores0.clone().require_grad();
        let want = softmax(masked(twin.clone()), 3);
        let want_grads = (want.clone() * weigh.clone()).sum().backward();
        let values = |t: Tensor<B::InnerBackend, 4>| t.into_data().convert::<f64>().to_vec::<f64>().unwrap();
        let close = |what: &str, got: Vec<f64>, want: Vec<f64>| {
            assert_close(&format!("{what}, mask rows {rows}"), &got, &want, 2e-6)
        };
        close("weights", values(probs.inner()), values(want.inner()));
        close(
            "scores' gradient",
            values(scores.grad(&grads).expect("the scores' gradient")),
            values(twin.grad(&want_grads).expect("the twin's gradient")),
        );

        // With a sink per head, of the scaled scores' size so that it takes a real share.
        let sinks0 = Tensor::<B, 1>::from_data(TensorData::new(vec![0.5f32, -1.0, 2.0], [heads]), device);
        let (scores, sinks) = (scores0.clone().require_grad(), sinks0.clone().require_grad());
        let (probs, _) = B::attention_softmax_sinks(
            scores.clone().into_primitive().tensor(),
            Some(hidden.clone().into_primitive()),
            sinks.clone().into_primitive().tensor(),
            scale,
        );
        let probs = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(probs));
        let grads = (probs.clone() * weigh.clone()).sum().backward();
        let (twin, twin_sinks) = (scores0.clone().require_grad(), sinks0.require_grad());
        let column = twin_sinks
            .clone()
            .reshape([1, heads, 1, 1])
            .expand([batch, heads, seq, 1]);
        let want = softmax(Tensor::cat(vec![masked(twin.clone()), column], 3), 3).slice([
            0..batch,
            0..heads,
            0..seq,
            0..keys,
        ]);
        let want_grads = (want.clone() * weigh.clone()).sum().backward();
        let values1 = |t: Tensor<B::InnerBackend, 1>| t.into_data().convert::<f64>().to_vec::<f64>().unwrap();
        close("weights with sinks", values(probs.inner()), values(want.inner()));
        close(
            "scores' gradient with sinks",
            values(scores.grad(&grads).expect("the scores' gradient")),
            values(twin.grad(&want_grads).expect("the twin's gradient")),
        );
        close(
            "sinks' gradient",
            values1(sinks.grad(&grads).expect("the sinks' gradient")),
            values1(twin_sinks.grad(&want_grads).expect("the twin's sinks' gradient")),
        );
    }
}

/// The rotary embedding on backend `B` (`DecoderKernels::rotate_half_seq_major` and Llama 4's
/// `rotate_pairs_seq_major`: one node under autodiff and one kernel each way on the CubeCL
/// backends, burn's ops elsewhere) against `x · cos + rotate_half(x) · sin` and the pairs'
/// rotation written out here with burn's slices, negation and concatenation: the output and
/// `x`'s gradient for a loss that weighs every value differently, with tables of one row and of
/// one per batch row.
pub fn rotary_matches_burns_ops<B>(device: &B::Device)
where
    B: burn::tensor::backend::AutodiffBackend + mpipemoe::MoeBackend,
{
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};
    let (batch, seq, heads, head_dim) = (2, 5, 3, 8);
    let half = head_dim / 2;
    for rows in [1, batch] {
        let x0 = Tensor::<B, 4>::random([batch, seq, heads, head_dim], Distribution::Default, device);
        let weigh = Tensor::<B, 4>::random([batch, seq, heads, head_dim], Distribution::Default, device);
        let [cos, sin] = [0, 1]
            .map(|_| Tensor::<B, 3>::random([rows, seq, head_dim], Distribution::Uniform(-1.0, 1.0), device));
        let x = x0.clone().require_grad();
        let out = B::rotate_half_seq_major(
            x.clone().into_primitive().tensor(),
            cos.clone().into_primitive().tensor(),
            sin.clone().into_primitive().tensor(),
        );
        let out = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(out));
        let grads = (out.clone() * weigh.clone()).sum().backward();
        let twin = x0.clone().require_grad();
        let rotated = Tensor::cat(
            vec![
                twin.clone()
                    .slice([0..batch, 0..seq, 0..heads, half..head_dim])
                    .neg(),
                twin.clone().slice([0..batch, 0..seq, 0..heads, 0..half]),
            ],
            3,
        );
        let per_head = |t: Tensor<B, 3>| t.unsqueeze_dim::<4>(2);
        let want = twin.clone() * per_head(cos.clone()) + rotated * per_head(sin.clone());
        let want_grads = (want.clone() * weigh.clone()).sum().backward();
        let values = |t: Tensor<B::InnerBackend, 4>| t.into_data().convert::<f64>().to_vec::<f64>().unwrap();
        let close = |what: &str, got: Vec<f64>, want: Vec<f64>| {
            assert_close(&format!("{what}, table rows {rows}"), &got, &want, 2e-6)
        };
        close("rotation", values(out.inner()), values(want.inner()));
        close(
            "x's gradient",
            values(x.grad(&grads).expect("x's gradient")),
            values(twin.grad(&want_grads).expect("the twin's gradient")),
        );

        // Llama 4's pairs `(x[2i], x[2i + 1])`, each rotated by angle `i` (the tables' first
        // half), against the same rotation written with interleaved slices.
        let x = x0.clone().require_grad();
        let out = B::rotate_pairs_seq_major(
            x.clone().into_primitive().tensor(),
            cos.clone().into_primitive().tensor(),
            sin.clone().into_primitive().tensor(),
        );
        let out = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(out));
        let grads = (out.clone() * weigh.clone()).sum().backward();
        let twin = x0.require_grad();
        let pairs = twin.clone().reshape([batch, seq, heads, half, 2]);
        let (re, im) = (
            pairs.clone().slice([0..batch, 0..seq, 0..heads, 0..half, 0..1]),
            pairs.slice([0..batch, 0..seq, 0..heads, 0..half, 1..2]),
        );
        let angle = |t: Tensor<B, 3>| {
            t.slice([0..rows, 0..seq, 0..half])
                .reshape([rows, seq, 1, half, 1])
        };
        let (c, s) = (angle(cos), angle(sin));
        let want = Tensor::cat(
            vec![re.clone() * c.clone() - im.clone() * s.clone(), re * s + im * c],
            4,
        )
        .reshape([batch, seq, heads, head_dim]);
        let want_grads = (want.clone() * weigh).sum().backward();
        close("pairs' rotation", values(out.inner()), values(want.inner()));
        close(
            "pairs' x gradient",
            values(x.grad(&grads).expect("x's gradient")),
            values(twin.grad(&want_grads).expect("the twin's gradient")),
        );
    }
}

/// The token cross-entropy on backend `B` (`mpipemoe::loss::cross_entropy`: one node under
/// autodiff over the backend's `LossKernels`, one kernel each way on the CubeCL backends)
/// against burn's `log_softmax` and a one-hot product written out here: the mean loss and the
/// logits' gradient, with two rows ignored (−1 and −100) and logits spread wide enough that
/// each row's shift by its maximum matters.
pub fn cross_entropy_matches_burns_ops<B>(device: &B::Device)
where
    B: burn::tensor::backend::AutodiffBackend + mpipemoe::MoeBackend,
{
    use burn::tensor::activation::log_softmax;
    use burn::tensor::{Distribution, Int, Tensor, TensorData};
    let (n_tokens, vocab) = (11, 300);
    let targets: Vec<i64> = (0..n_tokens as i64)
        .map(|r| match r {
            3 => -1,
            7 => -100,
            _ => (r * 131 + 5) % vocab as i64,
        })
        .collect();
    let counted = targets.iter().filter(|&&t| t >= 0).count();
    let one_hot: Vec<f32> = (0..n_tokens * vocab)
        .map(|i| f32::from(targets[i / vocab] == (i % vocab) as i64))
        .collect();
    let one_hot = Tensor::<B, 2>::from_data(TensorData::new(one_hot, [n_tokens, vocab]), device);
    let targets = Tensor::<B, 1, Int>::from_data(TensorData::new(targets, [n_tokens]), device);
    let logits0 = Tensor::<B, 2>::random([n_tokens, vocab], Distribution::Normal(0.0, 20.0), device);
    let logits = logits0.clone().require_grad();
    let loss = mpipemoe::loss::cross_entropy(logits.clone(), targets);
    let grads = loss.backward();
    let twin = logits0.require_grad();
    let want = (log_softmax(twin.clone(), 1) * one_hot).sum().neg() / counted as f64;
    let want_grads = want.backward();
    let values = |t: Tensor<B::InnerBackend, 2>| t.into_data().convert::<f64>().to_vec::<f64>().unwrap();
    let close = |what: &str, got: Vec<f64>, want: Vec<f64>| assert_close(what, &got, &want, 1e-5);
    let scalar = |t: Tensor<B, 1>| values(t.inner().reshape([1, 1]));
    close("loss", scalar(loss), scalar(want));
    close(
        "logits' gradient",
        values(logits.grad(&grads).expect("the logits' gradient")),
        values(twin.grad(&want_grads).expect("the twin's gradient")),
    );
}
