//! The router's kernels (`cubecl_router.rs`, `cubecl_z_loss.rs`) against their composed twins
//! on WGPU: scores, weights, the z-loss and their backwards, from contiguous tensors and from
//! transposed views, for both scorings and every normalisation; and the choice kernel
//! (`cubecl_choice.rs`): its flags for values that are not finite and the rules it leaves to
//! the host (its choice is held to the host's by `harness::kernel_checks`, which
//! `tests/wgpu.rs` runs on WGPU and the GPU check on CUDA). Every reference case also runs
//! through them in the layer (`tests/wgpu.rs`).

use burn::backend::Wgpu;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Distribution, Tensor, TensorPrimitive};

use super::cubecl_router as kernels;
use super::{
    pick_backward_composed, pick_composed, scores_backward_composed, scores_composed,
    z_loss_backward_composed, z_loss_composed, PickRule, RouterKernels, Scoring,
};
use crate::cubecl_test_kernels::{p, strided};

const N_TOKENS: usize = 37;
const N_EXPERTS: usize = 12;

fn random(shape: [usize; 2], scale: f64) -> Tensor<Wgpu, 2> {
    Tensor::random(shape, Distribution::Normal(0.0, scale), &Default::default())
}

/// Each token's `top_k` distinct experts, not in the scores' order.
fn choice(top_k: usize) -> Vec<usize> {
    (0..N_TOKENS)
        .flat_map(|t| (0..top_k).map(move |j| (t * 7 + j * 5) % N_EXPERTS))
        .collect()
}

/// The kernel's output against the composed twin's (`cubecl_test_kernels::close_within`).
fn close(what: &str, got: Option<FloatTensor<Wgpu>>, want: FloatTensor<Wgpu>) {
    close_within(what, got, want, 0.0)
}

/// [`close`] with a floor under the scale: a top-1 pick's normalised weight is 1 whatever the
/// score, so its gradient is zero up to the rounding of `g / c − g · c / c²`.
fn close_within(what: &str, got: Option<FloatTensor<Wgpu>>, want: FloatTensor<Wgpu>, floor: f32) {
    let got = got.unwrap_or_else(|| panic!("{what}: the kernel handed the tensors back"));
    crate::cubecl_test_kernels::close_within(what, got, want, floor);
}

#[test]
fn the_score_kernels_match_the_composed_forms() {
    scores_match_at(N_EXPERTS, &[Scoring::Softmax, Scoring::Sigmoid]);
    // A shared expert's gate is a sigmoid one wide (`experts/shared.rs`); a softmax one wide is
    // a constant, whose gradient is zero.
    scores_match_at(1, &[Scoring::Sigmoid]);
}

fn scores_match_at(width: usize, scorings: &[Scoring]) {
    let logits = random([N_TOKENS, width], 3.0);
    let grad = random([N_TOKENS, width], 1.0);
    for &scoring in scorings {
        for (layout, logits, grad) in [
            ("contiguous", logits.clone(), grad.clone()),
            ("strided", strided(&logits), strided(&grad)),
        ] {
            let what = format!("{scoring:?}, {layout}, {width} wide");
            let want = scores_composed::<Wgpu>(p(&logits), scoring);
            close(&what, kernels::scores(&p(&logits), scoring), want);
            let scores = Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(scores_composed::<Wgpu>(
                p(&logits),
                scoring,
            )));
            let want = scores_backward_composed::<Wgpu>(p(&scores), p(&grad), scoring);
            close(
                &format!("{what}, backward"),
                kernels::scores_backward(&p(&scores), &p(&grad), scoring),
                want,
            );
        }
    }
}

#[test]
fn the_pick_kernels_match_the_composed_forms() {
    let scores = random([N_TOKENS, N_EXPERTS], 1.0).abs();
    for top_k in [1, 2, 4] {
        let indices = choice(top_k);
        let grad = random([N_TOKENS, top_k], 1.0);
        for (normalize, eps, scaling) in [
            (false, 0.0, 1.0),
            (true, 0.0, 1.0),
            (true, 1e-20, 2.5),
            (false, 0.0, 0.5),
        ] {
            let rule = PickRule {
                normalize,
                eps,
                scaling,
            };
            for (layout, scores, grad) in [
                ("contiguous", scores.clone(), grad.clone()),
                ("strided", strided(&scores), strided(&grad)),
            ] {
                let what = format!("top_k {top_k}, {rule:?}, {layout}");
                let want = pick_composed::<Wgpu>(p(&scores), &indices, top_k, rule);
                close(&what, kernels::pick(&p(&scores), &indices, top_k, rule), want);
                let want = pick_backward_composed::<Wgpu>(p(&scores), &indices, top_k, p(&grad), rule);
                // A top-1 pick that normalises has a zero gradient up to rounding; the
                // largest of its terms, `|g| / c`, bounds how far from zero either side rounds.
                let floor = match (top_k, normalize) {
                    (1, true) => {
                        let s = scores.clone().into_data().to_vec::<f32>().unwrap();
                        let g = grad.clone().into_data().to_vec::<f32>().unwrap();
                        (0..N_TOKENS)
                            .map(|t| g[t].abs() / s[t * N_EXPERTS + indices[t]])
                            .fold(0f32, f32::max)
                    }
                    _ => 0.0,
                };
                close_within(
                    &format!("{what}, backward"),
                    kernels::pick_backward(&p(&scores), &indices, top_k, &p(&grad), rule),
                    want,
                    floor,
                );
            }
        }
    }
}

/// A choice outside the scores, or of the wrong length, is handed back to the composed form
/// (whose `gather` refuses it) rather than read out of bounds on the device.
#[test]
fn a_choice_that_breaks_the_contract_is_not_launched() {
    let scores = random([N_TOKENS, N_EXPERTS], 1.0);
    let rule = PickRule {
        normalize: true,
        eps: 0.0,
        scaling: 1.0,
    };
    let mut outside = choice(2);
    outside[5] = N_EXPERTS;
    assert!(kernels::pick(&p(&scores), &outside, 2, rule).is_none());
    let grad = random([N_TOKENS, 2], 1.0);
    assert!(kernels::pick_backward(&p(&scores), &outside, 2, &p(&grad), rule).is_none());
    assert!(kernels::pick(&p(&scores), &choice(2)[1..], 2, rule).is_none());
    assert!(kernels::pick(&p(&scores), &choice(2), 2, rule).is_some());
}

/// A `[1]` primitive as `[1, 1]`, for the comparison.
fn square(t: FloatTensor<Wgpu>) -> FloatTensor<Wgpu> {
    Tensor::<Wgpu, 1>::from_primitive(TensorPrimitive::Float(t))
        .reshape([1, 1])
        .into_primitive()
        .tensor()
}

/// The z-loss through the backend's op (the kernel's terms and burn's sum) and the backward
/// kernel, against the composed forms; at logits of scale 40 as well, with a first row whose
/// first logit is 200 and the others -200, where `exp` overflows f32 unless each row is
/// shifted by its maximum, the first column included.
#[test]
fn the_z_loss_kernels_match_the_composed_forms() {
    let grad = Tensor::<Wgpu, 1>::from_floats([0.7], &Default::default());
    for (spread, scale) in [(3.0, 0.01), (40.0, 1e-3)] {
        let mut logits = random([N_TOKENS, N_EXPERTS], spread);
        if spread > 10.0 {
            let mut row = vec![-200.0f32; N_EXPERTS];
            row[0] = 200.0;
            let row = Tensor::<Wgpu, 1>::from_floats(row.as_slice(), &Default::default());
            logits = logits.slice_assign([0..1, 0..N_EXPERTS], row.reshape([1, N_EXPERTS]));
        }
        for (layout, logits) in [("contiguous", logits.clone()), ("strided", strided(&logits))] {
            let what = format!("logits of scale {spread}, {layout}");
            let want = square(z_loss_composed::<Wgpu>(p(&logits), scale));
            let got = square(<Wgpu as RouterKernels>::router_z_loss(p(&logits), scale));
            close(&what, Some(got), want);
            let grad = grad.clone().into_primitive().tensor();
            let want = z_loss_backward_composed::<Wgpu>(p(&logits), grad.clone(), scale);
            // Each gradient is `lse · softmax`, and `exp(x − lse)` in f32 carries the rounding
            // of `x − lse`, about `|x| · ε` relative: at logits of scale 40 (|x| up to ~200)
            // that is ~2e-5 of an element, ten times the comparison's 2e-6, and one run in a
            // few hundred differed by that much. So the scale's floor is raised by it; a wrong
            // kernel is off by far more.
            let largest = logits.clone().abs().max().into_scalar();
            let widest = Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(want.clone()))
                .abs()
                .max()
                .into_scalar();
            let floor = widest * (1.0 + largest * f32::EPSILON / 2e-6);
            close_within(
                &format!("{what}, backward"),
                super::cubecl_z_loss::backward(&p(&logits), &grad, scale),
                want,
                floor,
            );
        }
    }
}

fn tensor(values: &[f32], shape: [usize; 2]) -> Tensor<Wgpu, 2> {
    Tensor::from_data(
        burn::tensor::TensorData::new(values.to_vec(), shape),
        &Default::default(),
    )
}

/// A NaN or an infinity in one token's values, or in its logits alone, is flagged for the
/// host, wherever it lies in the row; a batch of finite values is chosen; and a rule the host
/// refuses (more experts than allowed) is not launched.
#[test]
fn the_choice_kernel_flags_values_that_are_not_finite() {
    use super::{DeviceChoice, RoutingRule};
    let (n_tokens, n_experts) = (9, 8);
    let rule = RoutingRule::top_k(2, true);
    let fine = super::topk::tied_values(n_tokens * n_experts, 7);
    let finite = tensor(&fine, [n_tokens, n_experts]);
    assert!(matches!(
        super::cubecl_choice::choose(&p(&finite), &p(&finite), &rule).and_then(|read| read.wait()),
        Some(DeviceChoice::Chosen(_))
    ));
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for at in [0, 4 * n_experts + 3, n_tokens * n_experts - 1] {
            let mut values = fine.clone();
            values[at] = bad;
            let broken = tensor(&values, [n_tokens, n_experts]);
            for (what, values, logits) in [("values", &broken, &broken), ("logits", &finite, &broken)] {
                assert_eq!(
                    super::cubecl_choice::choose(&p(values), &p(logits), &rule).and_then(|read| read.wait()),
                    Some(DeviceChoice::NotFinite),
                    "{bad} at {at} in the {what}"
                );
            }
        }
    }
    let too_many = RoutingRule {
        n_group: 4,
        topk_group: 1,
        ..RoutingRule::top_k(3, true)
    };
    assert!(super::cubecl_choice::choose(&p(&finite), &p(&finite), &too_many).is_none());
    // Columns past 2^16 would meet the tag that marks what the kernel wrote.
    let wide = tensor(&vec![0.5; 1 << 16], [1, 1 << 16]);
    assert!(super::cubecl_choice::choose(&p(&wide), &p(&wide), &rule).is_none());
}
