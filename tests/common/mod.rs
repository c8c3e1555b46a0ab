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
    let close = |what: &str, got: Vec<f64>, want: Vec<f64>| {
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{what}: the composed form is zero");
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0f64, f64::max);
        assert!(worst <= 2e-5 * scale, "{what}: {worst:e} off at scale {scale:e}");
    };
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
