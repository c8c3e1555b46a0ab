//! The router's auxiliary losses in float64: values against their formulas, gradients against
//! finite differences.
//!
//! This binary uses only `NdArray<f64>`: burn keys a device's default float type by device,
//! and NdArray's f32 and f64 backends share one device, so mixing them in one process can
//! give either type to tensors created without explicit data.

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Tensor, TensorData};
use mpipemoe::{MoeLayer, MoeLayerConfig};

type B64 = Autodiff<NdArray<f64>>;

/// A layer in f64 whose only loss is one auxiliary loss; checks d loss / d router params
/// against central finite differences.
fn finite_difference_check(config: MoeLayerConfig, pick: fn(&mpipemoe::MoeOutput<B64, 2>) -> Tensor<B64, 1>) {
    let device = Default::default();
    let layer: MoeLayer<B64> = config.init(&device);
    let x = Tensor::<B64, 2>::random(
        [20, config.d_model],
        burn::tensor::Distribution::Uniform(-2.0, 2.0),
        &device,
    );
    let loss = |layer: &MoeLayer<B64>| -> f64 { pick(&layer.forward(x.clone())).into_scalar() };
    let out = layer.forward(x.clone());
    let grads = pick(&out).backward();
    let weight_grad: Vec<f64> = layer
        .router
        .weight
        .grad(&grads)
        .unwrap()
        .into_data()
        .to_vec()
        .unwrap();
    let weight: Vec<f64> = layer.router.weight.val().into_data().to_vec().unwrap();
    let eps = 1e-6;
    let mut max_err = 0f64;
    for i in (0..weight.len()).step_by(3) {
        let shifted = |delta: f64| {
            let mut w = weight.clone();
            w[i] += delta;
            let mut l = layer.clone();
            l.router.weight = l
                .router
                .weight
                .map(|p| Tensor::from_data(TensorData::new(w, p.dims()), &p.device()).require_grad());
            loss(&l)
        };
        let fd = (shifted(eps) - shifted(-eps)) / (2.0 * eps);
        max_err = max_err.max((fd - weight_grad[i]).abs() / (fd.abs() + 1e-3));
    }
    assert!(
        max_err < 1e-5,
        "router gradient vs finite differences: {max_err:e}"
    );
}

#[test]
fn aux_loss_gradient_matches_finite_differences() {
    let config = MoeLayerConfig::new(6, 8, 4, 2)
        .with_aux_loss_coef(0.7)
        .with_seed(11);
    finite_difference_check(config, |out| out.aux_loss.clone());
}

#[test]
fn z_loss_gradient_matches_finite_differences() {
    let config = MoeLayerConfig::new(6, 8, 4, 1)
        .with_z_loss_coef(0.3)
        .with_router_bias(true)
        .with_seed(12);
    finite_difference_check(config, |out| out.z_loss.clone());
}

#[test]
fn aux_and_z_loss_values_match_their_formulas() {
    let device = Default::default();
    let (t, m, e, k) = (12, 5, 4, 2);
    let layer: MoeLayer<B64> = MoeLayerConfig::new(m, 8, e, k)
        .with_aux_loss_coef(1.0)
        .with_z_loss_coef(1.0)
        .with_seed(5)
        .init(&device);
    let x = Tensor::<B64, 2>::random([t, m], burn::tensor::Distribution::Default, &device);
    let out = layer.forward(x.clone());
    let logits: Vec<f64> = x
        .matmul(layer.router.weight.val().transpose())
        .into_data()
        .to_vec()
        .unwrap();
    let (mut counts, mut prob_sums, mut z) = (vec![0.0; e], vec![0.0; e], 0.0);
    for row in logits.chunks(e) {
        let max = row.iter().cloned().fold(f64::MIN, f64::max);
        let sum: f64 = row.iter().map(|l| (l - max).exp()).sum();
        z += (max + sum.ln()).powi(2);
        let probs: Vec<f64> = row.iter().map(|l| (l - max).exp() / sum).collect();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        order[..k].iter().for_each(|&c| counts[c] += 1.0);
        probs.iter().enumerate().for_each(|(c, p)| prob_sums[c] += p);
    }
    let aux: f64 = e as f64
        * (0..e)
            .map(|c| counts[c] / (t * k) as f64 * prob_sums[c] / t as f64)
            .sum::<f64>();
    let got = out.aux_loss.into_scalar();
    assert!((got - aux).abs() < 1e-12, "aux {got} vs formula {aux}");
    assert!((out.z_loss.into_scalar() - z / t as f64).abs() < 1e-12);
}
