//! The layer on the CPU: config and input validation, reference vs fused on random configs,
//! routing edge cases, save/load. (The auxiliary losses' float64 checks are in router.rs.)

use std::sync::Arc;

use burn::backend::{Autodiff, Flex, NdArray};
use burn::tensor::{Tensor, TensorData};
use mpipemoe::backend::StepExecutor;
use mpipemoe::harness::{agreement_error, check_case, expected, Case, CheckOptions};
use mpipemoe::memory::Strategy;
use mpipemoe::{
    Activation, ExchangePath, MemoryReuse, MoeError, MoeLayer, MoeLayerConfig, Partitions, Scoring, Shadowing,
};
use proptest::prelude::*;
use proptest::strategy::Strategy as PropStrategy;

type B = Autodiff<NdArray>;

mod common;

/// The device library hook of the experts' compute, through its plain-primitive twin.
#[path = "layer/expert_path.rs"]
mod expert_path;

/// The decode path against the exchange, bit for bit, and the reference cases.
#[path = "layer/decode.rs"]
mod decode;

/// Low-rank adapters on the experts against a merged float64 oracle.
#[path = "layer/lora.rs"]
mod lora;

/// The shared expert issued while the routing read is in flight.
#[path = "layer/shared_overlap.rs"]
mod shared_overlap;

fn config_error(config: MoeLayerConfig) -> String {
    match config.validate() {
        Err(MoeError::Config { field, reason }) => format!("{field}: {reason}"),
        other => panic!("expected a config error, got {other:?}"),
    }
}

#[test]
fn bad_config_fields_are_named() {
    let base = MoeLayerConfig::new(8, 16, 4, 2);
    assert!(base.validate().is_ok());
    let with = |edit: fn(&mut MoeLayerConfig)| {
        let mut c = base.clone();
        edit(&mut c);
        c
    };
    assert!(config_error(with(|c| c.top_k = 0)).starts_with("top_k"));
    assert!(config_error(with(|c| c.top_k = 5)).starts_with("top_k"));
    assert!(config_error(with(|c| c.d_model = 0)).starts_with("d_model"));
    assert!(config_error(with(|c| c.d_hidden = 0)).starts_with("d_hidden"));
    assert!(config_error(MoeLayerConfig::new(8, 16, 0, 1)).starts_with("n_experts"));
    assert!(config_error(base.clone().with_capacity_factor(Some(0.0))).starts_with("capacity_factor"));
    assert!(config_error(base.clone().with_capacity_factor(Some(-1.0))).starts_with("capacity_factor"));
    assert!(config_error(base.clone().with_capacity_factor(Some(f64::NAN))).starts_with("capacity_factor"));
    assert!(config_error(base.clone().with_shared_expert(Some(0))).starts_with("shared_expert"));
    assert!(config_error(base.clone().with_aux_loss_coef(-0.1)).starts_with("aux_loss_coef"));
    assert!(config_error(base.clone().with_partitions(Partitions::Fixed(0))).starts_with("partitions"));
    assert!(config_error(base.clone().with_n_group(3)).starts_with("n_group"));
    assert!(config_error(base.clone().with_n_group(0)).starts_with("n_group"));
    assert!(config_error(base.clone().with_n_group(2).with_topk_group(3)).starts_with("topk_group"));
    // Two groups of two experts, one kept: top-3 cannot be chosen from two experts.
    let err = config_error(
        MoeLayerConfig::new(8, 16, 4, 3)
            .with_n_group(2)
            .with_topk_group(1),
    );
    assert!(err.starts_with("top_k") && err.contains("hold only 2"), "{err}");
    assert!(config_error(base.clone().with_routed_scaling_factor(0.0)).starts_with("routed_scaling_factor"));
    let err = base.validate_for_ranks(3).unwrap_err().to_string();
    assert!(
        err.contains("n_experts") && err.contains('4') && err.contains('3'),
        "{err}"
    );
    // `init` reports the same error.
    let err = std::panic::catch_unwind(|| MoeLayerConfig::new(8, 16, 4, 0).init::<B>(&Default::default()))
        .unwrap_err()
        .downcast::<String>()
        .unwrap();
    assert!(err.contains("top_k"), "{err}");
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let device = Default::default();
    let layer = MoeLayerConfig::new(8, 16, 4, 2).init::<B>(&device);
    let wrong_width = Tensor::<B, 2>::ones([3, 7], &device);
    let err = layer.try_forward(wrong_width).unwrap_err().to_string();
    assert!(err.contains("d_model = 8") && err.contains('7'), "{err}");
    let vector = Tensor::<B, 1>::ones([8], &device);
    assert!(matches!(layer.try_forward(vector), Err(MoeError::Input(_))));
    common::holds_the_finite_check::<B>(&device);
    common::holds_the_finite_check::<Autodiff<Flex>>(&Default::default());
    common::holds_the_finite_check::<Flex>(&Default::default());
}

/// The z-loss as one op against its composed form, on both CPU backends
/// (`common::z_loss_matches_its_composed_form`).
#[test]
fn the_z_loss_matches_its_composed_form() {
    common::z_loss_matches_its_composed_form::<B>(&Default::default());
    common::z_loss_matches_its_composed_form::<Autodiff<Flex>>(&Default::default());
}

/// Attention's weights (composed on the CPU backends) against burn's `mask_fill` and `softmax`
/// (`common::attention_softmax_matches_burns_ops`).
#[test]
fn attention_softmax_matches_burns_ops() {
    common::attention_softmax_matches_burns_ops::<B>(&Default::default());
    common::attention_softmax_matches_burns_ops::<Autodiff<Flex>>(&Default::default());
}

/// The rotary embedding (composed on NdArray, one pass forward on Flex) against burn's slices
/// and concatenation (`common::rotary_matches_burns_ops`).
#[test]
fn rotary_matches_burns_ops() {
    common::rotary_matches_burns_ops::<B>(&Default::default());
    common::rotary_matches_burns_ops::<Autodiff<Flex>>(&Default::default());
}

#[test]
fn three_d_input_keeps_its_shape_and_matches_flat_input() {
    let device = Default::default();
    let layer = MoeLayerConfig::new(8, 16, 4, 2).with_seed(3).init::<B>(&device);
    let x = Tensor::<B, 3>::random([2, 5, 8], burn::tensor::Distribution::Default, &device);
    let y3 = layer.forward(x.clone()).output;
    assert_eq!(y3.dims(), [2, 5, 8]);
    let y2 = layer.forward(x.reshape([10, 8])).output;
    y3.reshape([10, 8]).into_data().assert_eq(&y2.into_data(), true);
}

/// A random layer config small enough to check many times.
fn arb_config() -> impl PropStrategy<Value = (MoeLayerConfig, usize, u64)> {
    (
        prop::sample::select(vec![2usize, 4, 8]),
        1usize..=3,
        prop::sample::select(vec![4usize, 8, 12]),
        prop::sample::select(vec![4usize, 6, 16]),
        // GPT-OSS's clamped SwiGLU with a small clamp, so that the random values pass it.
        prop::sample::select(vec![
            Activation::Gelu,
            Activation::Relu,
            Activation::SwiGlu,
            Activation::clamped_swiglu(1.702, 0.3).unwrap(),
        ]),
        any::<(bool, bool, bool)>(),
        prop::option::of(0.5f64..2.0),
        prop::option::of(prop::sample::select(vec![3usize, 8])),
        0usize..30,
        any::<u64>(),
        (
            any::<bool>(),
            1usize..=4,
            prop::sample::select(vec![1.0f64, 2.5]),
            any::<bool>(),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(e, k, m, h, act, (bias, router_bias, norm), cap, shared, tokens, seed, deepseek)| {
                let (sigmoid, groups, scaling, shared_gate, weights_on_input) = deepseek;
                let mut config = MoeLayerConfig::new(m, h, e, k.min(e))
                    .with_activation(act)
                    .with_bias(bias)
                    .with_router_bias(router_bias)
                    .with_normalize_topk(norm)
                    .with_capacity_factor(cap)
                    .with_shared_expert(shared)
                    .with_shared_expert_gate(shared_gate)
                    .with_routed_scaling_factor(scaling)
                    .with_weights_on_input(weights_on_input);
                if sigmoid {
                    // DeepSeek-V3 routing: sigmoid scores, a score bias, and groups of at least
                    // two experts of which half are kept (when there are groups at all).
                    let n_group = [1, 2, 4]
                        .into_iter()
                        .filter(|g| e % g == 0 && e / g >= 2 && *g <= groups)
                        .max()
                        .unwrap_or(1);
                    let topk_group = n_group
                        .div_ceil(2)
                        .max((k.min(e)).div_ceil(e / n_group))
                        .min(n_group);
                    config = config
                        .with_scoring(Scoring::Sigmoid)
                        .with_score_bias(true)
                        .with_n_group(n_group)
                        .with_topk_group(topk_group);
                }
                (config, tokens, seed)
            },
        )
}

/// A generated case, with a random score bias where the config has one (the layer initialises
/// it to zeros, which would leave its effect on the choice untested).
fn generate(config: &MoeLayerConfig, tokens: usize, seed: u64) -> Case {
    let case = Case::generate("random", config, tokens, seed).unwrap();
    if !config.score_bias {
        return case;
    }
    let mut inputs: std::collections::BTreeMap<String, TensorData> = case
        .tensors
        .into_iter()
        .filter(|(n, _)| !n.starts_with("grad.") && n != "y" && n != "dx")
        .collect();
    let bias = mpipemoe::seeded_uniform(seed, "score_bias", config.n_experts, 0.3);
    inputs.insert(
        "router.score_bias".into(),
        TensorData::new(bias, [config.n_experts]),
    );
    Case::from_parts("random", config, inputs).unwrap()
}

/// The gradients that are plain sums over tokens of per-token contributions of either sign.
const TOKEN_SUMS: [&str; 3] = ["grad.router.bias", "grad.experts.b_in", "grad.experts.b_out"];

/// For each of [`TOKEN_SUMS`] the case has, `‖Σ_t |g_t|‖`: the norm of the elementwise sum of
/// the absolute per-token contributions `g_t` (each token's case computed alone by the f64
/// oracle). Where the contributions cancel, the gradient is far smaller than its parts, and
/// f32 rounding, which is relative to the parts, is a large fraction of it: a router-bias
/// gradient of 5e-5 made of parts near 1e-2 misses 1e-4 relative by rounding alone. A scale
/// is given only where the parts add up to the case's gradient (to 1e-6 of their size): a
/// capacity limit that drops tokens couples them, and the plain relative error applies then.
fn token_sum_scales(case: &Case) -> std::collections::BTreeMap<String, f64> {
    // name -> (Σ_t g_t, Σ_t |g_t|)
    let mut sums: std::collections::BTreeMap<String, (Vec<f64>, Vec<f64>)> = Default::default();
    let [n_tokens, m] = [case.tensor("x").shape[0], case.tensor("x").shape[1]];
    for t in 0..n_tokens {
        let mut inputs: std::collections::BTreeMap<String, TensorData> = case
            .tensors
            .iter()
            .filter(|(n, _)| !n.starts_with("grad.") && !["y", "dx"].contains(&n.as_str()))
            .map(|(n, d)| (n.clone(), d.clone()))
            .collect();
        for name in ["x", "probe"] {
            let row = expected(case, name)[t * m..(t + 1) * m].to_vec();
            inputs.insert(name.into(), TensorData::new(row, [1, m]).convert::<f32>());
        }
        let alone = Case::from_parts("token", &case.config, inputs).unwrap();
        for name in TOKEN_SUMS.iter().filter(|n| case.tensors.contains_key(**n)) {
            let part = expected(&alone, name);
            let (signed, abs) = sums
                .entry(name.to_string())
                .or_insert_with(|| (vec![0.0; part.len()], vec![0.0; part.len()]));
            for ((s, a), p) in signed.iter_mut().zip(abs.iter_mut()).zip(part) {
                *s += p;
                *a += p.abs();
            }
        }
    }
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    sums.into_iter()
        .filter_map(|(name, (signed, abs))| {
            // The case's gradient was stored in f32, so the parts' sum matches it to f32
            // rounding of the gradient itself, well within 1e-6 of the parts.
            let whole = expected(case, &name);
            let off = agreement_error(&signed, &whole, &vec![0.0; whole.len()]);
            (off <= 1e-6 * norm(&abs)).then(|| (name, norm(&abs)))
        })
        .collect()
}

/// `‖a − b‖ / max(‖want‖, scale)`: `agreement_error` with its denominator floored at the
/// gradient's token-sum scale where it has one (`‖a − b‖` where both are zero).
fn conditioned_error(a: &[f64], b: &[f64], want: &[f64], scale: Option<&f64>) -> f64 {
    let norm = want.iter().map(|w| w * w).sum::<f64>().sqrt();
    let denominator = norm.max(scale.copied().unwrap_or(0.0));
    let diff = agreement_error(a, b, &vec![0.0; want.len()]);
    if denominator == 0.0 {
        diff
    } else {
        diff / denominator
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Reference and fused paths agree to 1e-5 on random configs (every rank count that
    /// divides the experts, random partitions and strategy), and both match the float64
    /// reference to 1e-4: relative to each tensor's norm, or for a gradient summed over
    /// tokens to the norm of its parts where that is larger (`token_sum_scales`).
    #[test]
    fn reference_and_fused_agree_on_random_configs(
        (config, tokens, seed) in arb_config(),
        n in 1usize..5,
        strategy in prop::sample::select(Strategy::ALL.to_vec()),
    ) {
        prop_assert!(config.validate().is_ok(), "{:?}", config.validate());
        let case = generate(&config, tokens, seed);
        let scales = token_sum_scales(&case);
        let device = Default::default();
        for n_ranks in [1usize, 2].into_iter().filter(|r| config.n_experts % r == 0) {
            let reference = check_case::<B>(&case, &CheckOptions { path: ExchangePath::Reference, n_ranks, ..CheckOptions::default() }, &device).unwrap();
            let fused = check_case::<B>(&case, &CheckOptions { path: ExchangePath::Fused, n_ranks, partitions: Partitions::Fixed(n), strategy, memory_budget: None, executor: Some(StepExecutor::StreamThreads), shadowing: mpipemoe::Shadowing::Off, ..CheckOptions::default() }, &device).unwrap();
            for (name, got) in &fused.tensors {
                let (want, scale, reference) = (expected(&case, name), scales.get(name), &reference.tensors[name]);
                let err = conditioned_error(reference, &want, &want, scale);
                prop_assert!(err <= 1e-4, "{name}: reference vs f64 {err:e} (token-sum scale {scale:?})");
                let err = conditioned_error(got, &want, &want, scale);
                prop_assert!(err <= 1e-4, "{name}: fused vs f64 {err:e} (ranks {n_ranks}, n {n}, {strategy})");
                let err = conditioned_error(got, reference, &want, scale);
                prop_assert!(err <= 1e-5, "{name}: fused vs reference {err:e} (ranks {n_ranks}, n {n}, {strategy})");
            }
        }
    }
}

#[test]
fn all_tokens_to_one_expert_and_ranks_without_rows_are_exact() {
    let device = Default::default();
    let case = Case::all_to_one_expert(4, 10).unwrap();
    for n_ranks in [1, 2, 4] {
        // Shadowing the hot expert (issue 45) computes every row where it was routed: then
        // no row crosses, and every rank's own experts receive nothing.
        let shadowings = match n_ranks {
            1 => vec![Shadowing::Off],
            _ => vec![Shadowing::Off, Shadowing::Fixed(1)],
        };
        for shadowing in shadowings {
            for path in [ExchangePath::Reference, ExchangePath::Fused] {
                for strategy in Strategy::ALL {
                    let options = CheckOptions {
                        path,
                        n_ranks,
                        partitions: Partitions::Fixed(3),
                        strategy,
                        shadowing,
                        ..CheckOptions::default()
                    };
                    let report = check_case::<B>(&case, &options, &device).unwrap();
                    assert!(report.passed(1e-4), "{options:?}: {:?}", report.worst());
                    let want = if shadowing == Shadowing::Off { 0 } else { 1 };
                    assert_eq!(report.shadows.len(), want, "{options:?}");
                }
            }
        }
    }
}

#[test]
fn ranks_with_zero_input_tokens_are_exact() {
    let device = Default::default();
    // 3 tokens over 4 ranks: rank 3 has none; 0 tokens: every rank has none.
    for tokens in [3, 1, 0] {
        let config = MoeLayerConfig::new(6, 8, 4, 2)
            .with_shared_expert(Some(4))
            .with_capacity_factor(Some(1.0));
        let case = Case::generate("few_tokens", &config, tokens, 4).unwrap();
        for path in [ExchangePath::Reference, ExchangePath::Fused] {
            let options = CheckOptions {
                path,
                n_ranks: 4,
                partitions: Partitions::Fixed(2),
                strategy: Strategy::S2,
                ..CheckOptions::default()
            };
            let report = check_case::<Autodiff<Flex>>(&case, &options, &device).unwrap();
            assert!(
                report.passed(1e-4),
                "tokens {tokens} {options:?}: {:?}",
                report.worst()
            );
        }
    }
}

#[test]
fn capacity_drops_are_counted_and_rank_independent() {
    let device = Default::default();
    let config = MoeLayerConfig::new(6, 8, 4, 2).with_capacity_factor(Some(0.5));
    let case = Case::generate("capacity", &config, 16, 21).unwrap();
    let layer = MoeLayer::<B>::from_tensor_map(
        &config,
        &case.tensors,
        &case.path,
        &device,
        Arc::new(mpipemoe::comm::SingleRank),
    )
    .unwrap();
    let x = Tensor::<B, 2>::from_data(case.tensor("x").clone(), &device);
    let stats = layer.forward(x).stats.routing;
    assert_eq!(stats.capacity, Some(4));
    assert!(stats.tokens_per_expert.iter().all(|&c| c <= 4));
    assert_eq!(stats.tokens_per_expert.iter().sum::<usize>() + stats.dropped, 32);
    for n_ranks in [2, 4] {
        let options = CheckOptions {
            n_ranks,
            ..CheckOptions::default()
        };
        assert!(check_case::<B>(&case, &options, &device).unwrap().passed(1e-4));
    }
}

#[test]
fn save_and_load_round_trip_across_rank_counts() {
    let device = Default::default();
    let dir = std::env::temp_dir().join(format!("mpipemoe-io-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = MoeLayerConfig::new(8, 12, 4, 2)
        .with_activation(Activation::SwiGlu)
        .with_bias(true)
        .with_shared_expert(Some(6))
        .with_capacity_factor(Some(1.5))
        .with_seed(77);
    // Two ranks save the layer together; one rank loads it.
    let path = dir.join("layer.safetensors");
    mpipemoe::LocalGroup::run(2, |ctx| {
        config
            .init_rank::<NdArray>(&device, ctx.comm.clone())?
            .save_safetensors(&path)
    })
    .unwrap();
    let loaded = MoeLayer::<NdArray>::load_safetensors(&path, &device).unwrap();
    let fresh = config.init::<NdArray>(&device);
    assert_eq!(loaded.config().capacity_factor, Some(1.5));
    let x = Tensor::<NdArray, 2>::random([9, 8], burn::tensor::Distribution::Default, &device);
    loaded
        .forward(x.clone())
        .output
        .into_data()
        .assert_eq(&fresh.forward(x).output.into_data(), true);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn run_settings_change_without_touching_weights() {
    let device = Default::default();
    let layer = MoeLayerConfig::new(8, 12, 4, 2).init::<B>(&device);
    let x = Tensor::<B, 2>::random([10, 8], burn::tensor::Distribution::Default, &device);
    let base = layer.forward(x.clone()).output;
    let tuned = layer
        .clone()
        .with_config(
            layer
                .config()
                .clone()
                .with_partitions(Partitions::Fixed(3))
                .with_memory_reuse(MemoryReuse::S1),
        )
        .unwrap();
    let out = tuned.forward(x);
    assert_eq!(out.stats.n_partitions, 3);
    assert_eq!(out.stats.strategy, Strategy::S1);
    let diff = (out.output - base).abs().max().into_scalar();
    assert!(diff < 1e-6);
    let err = layer.with_config(MoeLayerConfig::new(8, 16, 4, 2)).unwrap_err();
    assert!(err.to_string().contains("shape"));
}

/// Regression guard for the reason burn-ndarray's `simd` feature is off (Cargo.toml): its
/// f32 `recip` was an approximate reciprocal, which made every division's gradient inexact.
#[test]
fn ndarray_reciprocal_is_exact() {
    let device = Default::default();
    let values: Vec<f32> = (0..256).map(|i| 0.37 + i as f32 * 0.113).collect();
    let x = Tensor::<NdArray, 1>::from_data(TensorData::new(values.clone(), [256]), &device);
    let got: Vec<f32> = x.recip().into_data().to_vec().unwrap();
    for (g, v) in got.iter().zip(&values) {
        let want = 1.0 / *v as f64;
        assert!(
            ((*g as f64 - want) / want).abs() < 2e-7,
            "recip({v}) = {g}, want {want}"
        );
    }
}

/// The parallel exact GELU kernels on Flex against the f64 formula, on every layout the
/// exchange op hands them: contiguous, a row slice at an offset, a transposed view, and a
/// gradient whose buffer is shared (so it cannot be overwritten in place).
#[test]
fn flex_gelu_kernels_match_the_f64_formula_on_every_layout() {
    use burn::tensor::TensorPrimitive;
    use mpipemoe::backend::ActivationKernels;

    let device = Default::default();
    let n: usize = 40 * 700;
    let z_values: Vec<f32> = (0..n).map(|i| ((i * 7919) % 2003) as f32 / 200.0 - 5.0).collect();
    let g_values: Vec<f32> = (0..n)
        .map(|i| ((i * 104729) % 1009) as f32 / 500.0 - 1.0)
        .collect();
    let z_full = Tensor::<Flex, 2>::from_data(TensorData::new(z_values, [40, 700]), &device);
    let g_full = Tensor::<Flex, 2>::from_data(TensorData::new(g_values, [40, 700]), &device);
    let prim = |t: &Tensor<Flex, 2>| t.clone().into_primitive().tensor();
    let host = |t: Tensor<Flex, 2>| t.into_data().to_vec::<f32>().unwrap();
    let wrap = |p| Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(p));
    let phi = |x: f64| 0.5 * (1.0 + libm::erf(x / std::f64::consts::SQRT_2));
    let pdf = |x: f64| (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();

    let views: [(&str, Tensor<Flex, 2>, Tensor<Flex, 2>); 3] = [
        ("contiguous", z_full.clone(), g_full.clone()),
        (
            "row slice",
            z_full.clone().narrow(0, 13, 11),
            g_full.clone().narrow(0, 13, 11),
        ),
        (
            "transposed",
            z_full.clone().transpose(),
            g_full.clone().transpose(),
        ),
    ];
    for (name, z, g) in views {
        let (zs, gs) = (host(z.clone()), host(g.clone()));
        let gelu = host(wrap(Flex::gelu_exact(prim(&z))));
        // `g` stays alive here, so the kernel must not write into its buffer.
        let back = host(wrap(Flex::gelu_backward_exact(prim(&z), prim(&g))));
        assert_eq!(host(g.clone()), gs, "{name}: the shared gradient was overwritten");
        for i in 0..zs.len() {
            let x = zs[i] as f64;
            let want = x * phi(x);
            assert!(
                (gelu[i] as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{name} gelu({x})"
            );
            let want = gs[i] as f64 * (phi(x) + x * pdf(x));
            assert!(
                (back[i] as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{name} gelu'({x})"
            );
        }
    }
    // A uniquely owned gradient is overwritten in place and gives the same numbers.
    let shared = host(wrap(Flex::gelu_backward_exact(prim(&z_full), prim(&g_full))));
    let unique = Tensor::<Flex, 2>::from_data(g_full.into_data(), &device);
    let owned = host(wrap(Flex::gelu_backward_exact(
        prim(&z_full),
        unique.into_primitive().tensor(),
    )));
    assert_eq!(shared, owned);
}

/// Flex's parallel SwiGLU kernels against the composed form (NdArray runs the trait's default,
/// built from burn's primitives) on every layout the exchange hands them: contiguous, a row
/// slice at an offset, and a transposed view (which they hand back to the composed form).
/// The two differ only by the sigmoid's last bits.
#[test]
fn flex_swiglu_kernels_match_the_composed_form_on_every_layout() {
    use burn::tensor::TensorPrimitive;
    use mpipemoe::backend::ActivationKernels;

    let device = Default::default();
    let (rows, h) = (40, 350);
    let z_values: Vec<f32> = (0..rows * 2 * h)
        .map(|i| ((i * 7919) % 2003) as f32 / 100.0 - 10.0)
        .collect();
    let g_values: Vec<f32> = (0..rows * h)
        .map(|i| ((i * 104729) % 1009) as f32 / 500.0 - 1.0)
        .collect();
    let flex = |v: &[f32], shape: [usize; 2]| {
        Tensor::<Flex, 2>::from_data(TensorData::new(v.to_vec(), shape), &device)
    };
    let nd = |v: Vec<f32>, shape: [usize; 2]| {
        Tensor::<NdArray, 2>::from_data(TensorData::new(v, shape), &Default::default())
            .into_primitive()
            .tensor()
    };
    let host = |t: Tensor<Flex, 2>| t.into_data().to_vec::<f32>().unwrap();
    let wrap = |p| Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(p));
    let nd_host = |p| {
        Tensor::<NdArray, 2>::from_primitive(TensorPrimitive::Float(p))
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    };
    let close = |name: &str, got: &[f32], want: &[f32]| {
        assert_eq!(got.len(), want.len(), "{name}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                "{name}[{i}]: {g} against {w}"
            );
        }
    };
    let z_full = flex(&z_values, [rows, 2 * h]);
    let g_full = flex(&g_values, [rows, h]);
    // (name, z, grad): the transposed case is a [2h, rows] view of a [rows, 2h] buffer
    // transposed back, so its shape matches but its strides do not.
    let views: [(&str, Tensor<Flex, 2>, Tensor<Flex, 2>); 3] = [
        ("contiguous", z_full.clone(), g_full.clone()),
        (
            "row slice",
            z_full.clone().narrow(0, 13, 11),
            g_full.clone().narrow(0, 13, 11),
        ),
        (
            "transposed",
            flex(&host(z_full.clone().transpose()), [2 * h, rows]).transpose(),
            flex(&host(g_full.clone().transpose()), [h, rows]).transpose(),
        ),
    ];
    for (name, z, g) in views {
        let (zs, gs) = (host(z.clone()), host(g.clone()));
        let [r, _] = z.dims();
        let got = host(wrap(Flex::swiglu(z.clone().into_primitive().tensor())));
        let want = nd_host(<NdArray as ActivationKernels>::swiglu(nd(zs.clone(), [r, 2 * h])));
        close(&format!("{name} swiglu"), &got, &want);
        let got = host(wrap(Flex::swiglu_backward(
            z.clone().into_primitive().tensor(),
            g.clone().into_primitive().tensor(),
        )));
        let want = nd_host(<NdArray as ActivationKernels>::swiglu_backward(
            nd(zs.clone(), [r, 2 * h]),
            nd(gs.clone(), [r, h]),
        ));
        close(&format!("{name} swiglu backward"), &got, &want);
        // GPT-OSS's clamp at 7: the values run from -10 to 10 in hundredths, so some lie
        // exactly on each bound (where the gradient passes) and some past it (where it does not).
        let (alpha, limit) = (1.702, 7.0);
        let got = host(wrap(Flex::clamped_swiglu(
            z.clone().into_primitive().tensor(),
            alpha,
            limit,
        )));
        let want = nd_host(<NdArray as ActivationKernels>::clamped_swiglu(
            nd(zs.clone(), [r, 2 * h]),
            alpha,
            limit,
        ));
        close(&format!("{name} clamped swiglu"), &got, &want);
        let got = host(wrap(Flex::clamped_swiglu_backward(
            z.into_primitive().tensor(),
            g.into_primitive().tensor(),
            alpha,
            limit,
        )));
        let want = nd_host(<NdArray as ActivationKernels>::clamped_swiglu_backward(
            nd(zs, [r, 2 * h]),
            nd(gs, [r, h]),
            alpha,
            limit,
        ));
        close(&format!("{name} clamped swiglu backward"), &got, &want);
    }
}

/// The experts' GEMMs on Flex (`MoeBackend::expert_matmul`, into an output allocated once)
/// give Flex's own matmul bit for bit on the operand layouts the fused op hands them: plain,
/// transposed views (the weight gradients' `xᵀ · g`), row slices at an offset, and an expert's
/// matrix of a stacked weight.
#[test]
fn flex_expert_matmul_equals_flex_matmul_on_every_layout() {
    use burn::tensor::ops::FloatTensorOps;
    use burn::tensor::TensorPrimitive;
    use mpipemoe::backend::MoeBackend;

    let device = Default::default();
    let values = |n: usize, seed: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i + seed) * 7919) % 2003) as f32 / 1000.0 - 1.0)
            .collect()
    };
    let t = |n: [usize; 2], seed| {
        Tensor::<Flex, 2>::from_data(TensorData::new(values(n[0] * n[1], seed), n), &device)
    };
    let stacked = Tensor::<Flex, 3>::from_data(TensorData::new(values(3 * 64 * 96, 9), [3, 64, 96]), &device);
    let prim = |x: Tensor<Flex, 2>| x.into_primitive().tensor();
    let host = |p| {
        Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(p))
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    };
    // Small (one thread) and large (every core) products, so both of gemm's paths run.
    let pairs: [(&str, Tensor<Flex, 2>, Tensor<Flex, 2>); 5] = [
        ("plain", t([7, 5], 1), t([5, 3], 2)),
        ("large", t([300, 200], 3), t([200, 250], 4)),
        ("transposed lhs", t([200, 300], 5).transpose(), t([200, 250], 6)),
        (
            "row slices",
            t([50, 64], 7).narrow(0, 9, 30),
            t([90, 96], 8).narrow(0, 20, 64),
        ),
        (
            "expert matrix",
            t([30, 64], 10),
            Tensor::from_primitive(TensorPrimitive::Float(Flex::expert_matrix(
                &stacked.clone().into_primitive().tensor(),
                1,
            ))),
        ),
    ];
    for (name, lhs, rhs) in pairs {
        let want = host(Flex::float_matmul(prim(lhs.clone()), prim(rhs.clone())));
        let got = host(Flex::expert_matmul(prim(lhs), prim(rhs)));
        assert_eq!(got, want, "{name}");
    }
}

/// `MoeBackend::expert_matmul` under `Autodiff` (one node over the inner backend's product,
/// what the models' projections run) against burn's own matmul and its gradients, on Flex and
/// NdArray: a decode step's few rows (Flex cuts those by depth, so within rounding rather than
/// bit for bit), many rows, and a transposed weight (a tied head's `Eᵀ`); a frozen weight gets
/// no gradient while its input does.
#[test]
fn expert_matmul_under_autodiff_matches_burns_matmul_and_its_gradients() {
    fn check<I: mpipemoe::MoeBackend>(name: &str) {
        use burn::tensor::TensorPrimitive;
        use mpipemoe::MoeBackend;
        type A<I> = Autodiff<I>;
        let device = Default::default();
        let values = |n: usize, seed: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i + seed) * 7919) % 2003) as f32 / 1000.0 - 1.0)
                .collect()
        };
        for (m, k, n, transposed) in [
            (1, 512, 1536, false),
            (3, 200, 700, false),
            (40, 64, 96, false),
            (2, 96, 300, true),
        ] {
            let x = || Tensor::<A<I>, 2>::from_data(TensorData::new(values(m * k, 1), [m, k]), &device);
            let w = || match transposed {
                false => Tensor::<A<I>, 2>::from_data(TensorData::new(values(k * n, 2), [k, n]), &device),
                true => Tensor::<A<I>, 2>::from_data(TensorData::new(values(n * k, 2), [n, k]), &device),
            };
            let g = Tensor::<A<I>, 2>::from_data(TensorData::new(values(m * n, 3), [m, n]), &device);
            let oriented = |w: Tensor<A<I>, 2>| if transposed { w.transpose() } else { w };
            let run = |ours: bool, train_w: bool| {
                let (x, w) = (x().require_grad(), w());
                let w = if train_w { w.require_grad() } else { w };
                let y = match ours {
                    true => Tensor::<A<I>, 2>::from_primitive(TensorPrimitive::Float(A::<I>::expert_matmul(
                        x.clone().into_primitive().tensor(),
                        oriented(w.clone()).into_primitive().tensor(),
                    ))),
                    false => x.clone().matmul(oriented(w.clone())),
                };
                let grads = (y.clone() * g.clone()).sum().backward();
                let host = |t: Tensor<I, 2>| t.into_data().to_vec::<f32>().unwrap();
                (
                    host(y.inner()),
                    host(x.grad(&grads).expect("the input's gradient")),
                    w.grad(&grads).map(host),
                )
            };
            let close = |a: &[f32], b: &[f32], what: &str| {
                assert_eq!(a.len(), b.len(), "{name} {m}×{k}×{n} {what}");
                let scale = b.iter().fold(0f32, |s, v| s.max(v.abs())).max(1.0);
                for (i, (p, q)) in a.iter().zip(b).enumerate() {
                    assert!(
                        (p - q).abs() <= 1e-5 * scale,
                        "{name} {m}×{k}×{n} {what}[{i}]: {p} against {q}"
                    );
                }
            };
            let (ours, theirs) = (run(true, true), run(false, true));
            close(&ours.0, &theirs.0, "output");
            close(&ours.1, &theirs.1, "input gradient");
            close(&ours.2.unwrap(), &theirs.2.unwrap(), "weight gradient");
            let frozen = run(true, false);
            assert!(frozen.2.is_none(), "{name}: a frozen weight got a gradient");
            close(&frozen.1, &theirs.1, "input gradient, weight frozen");
        }
    }
    check::<Flex>("Flex");
    check::<NdArray>("NdArray");
}

/// The score bias is a buffer: it gets no gradient, moves only by `balance_score_bias`, and is
/// saved and loaded with the module's record.
#[test]
fn the_score_bias_is_a_buffer_saved_with_the_module() {
    use burn::module::Module;
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    let device = Default::default();
    let config = MoeLayerConfig::new(8, 16, 4, 2)
        .with_scoring(Scoring::Sigmoid)
        .with_score_bias(true)
        .with_seed(3);
    let mut layer = config.init::<B>(&device);
    let x = Tensor::<B, 2>::random([24, 8], burn::tensor::Distribution::Default, &device);
    let out = layer.forward(x.clone());
    let grads = out.output.sum().backward();
    let bias = layer.router.score_bias.as_ref().unwrap();
    assert!(
        bias.grad(&grads).is_none(),
        "the score bias must not receive a gradient"
    );
    let load = out.stats.routing.routed_per_expert.clone();
    assert_eq!(load.iter().sum::<usize>(), 48);
    layer.balance_score_bias(&load, 0.25).unwrap();
    let mean = 12.0;
    let moved: Vec<f32> = layer
        .router
        .score_bias
        .as_ref()
        .unwrap()
        .val()
        .into_data()
        .to_vec()
        .unwrap();
    for (e, (&l, &b)) in load.iter().zip(&moved).enumerate() {
        let want = if (l as f64) < mean {
            0.25
        } else if (l as f64) > mean {
            -0.25
        } else {
            0.0
        };
        assert_eq!(b, want, "expert {e} with load {l}");
    }
    let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
    let bytes = recorder.record(layer.clone().into_record(), ()).unwrap();
    let fresh = config.init::<B>(&device);
    let loaded = fresh.load_record(recorder.load(bytes, &device).unwrap());
    let restored: Vec<f32> = loaded
        .router
        .score_bias
        .as_ref()
        .unwrap()
        .val()
        .into_data()
        .to_vec()
        .unwrap();
    assert_eq!(restored, moved);
    assert!(!loaded.router.score_bias.as_ref().unwrap().val().is_require_grad());
    // A layer without a score bias says so.
    let mut plain = MoeLayerConfig::new(8, 16, 4, 2).init::<B>(&device);
    let err = plain
        .balance_score_bias(&[1, 2, 3, 4], 0.1)
        .unwrap_err()
        .to_string();
    assert!(err.contains("score_bias"), "{err}");
    let err = layer.balance_score_bias(&[1, 2], 0.1).unwrap_err().to_string();
    assert!(err.contains("one load per expert"), "{err}");
}

/// Flex's in-place row assignment writes what `slice_assign` writes, for owned and shared
/// destinations and for row blocks that are views of a larger tensor.
#[test]
fn flex_assign_rows_matches_slice_assign() {
    use burn::backend::Flex;
    use burn::tensor::Distribution;
    use mpipemoe::MoeBackend;
    let device = Default::default();
    let dst = Tensor::<Flex, 2>::random([10, 6], Distribution::Default, &device);
    let big = Tensor::<Flex, 2>::random([9, 6], Distribution::Default, &device);
    for (start, rows) in [
        (0usize, big.clone().slice([0..3, 0..6])),
        (4, big.clone().slice([5..9, 0..6])),
        (7, big.clone().slice([2..5, 0..6])),
        (3, big.clone().slice([0..3, 0..6]).transpose().transpose()),
    ] {
        let len = rows.dims()[0];
        let want = dst
            .clone()
            .slice_assign([start..start + len, 0..6], rows.clone())
            .into_data();
        // Shared destination (dst is still held here), then an owned copy.
        let shared = Flex::assign_rows(
            dst.clone().into_primitive().tensor(),
            start,
            rows.clone().into_primitive().tensor(),
        );
        let owned_dst = Tensor::<Flex, 2>::from_data(dst.to_data(), &device);
        let owned = Flex::assign_rows(
            owned_dst.into_primitive().tensor(),
            start,
            rows.into_primitive().tensor(),
        );
        for got in [shared, owned] {
            let got =
                Tensor::<Flex, 2>::from_primitive(burn::tensor::TensorPrimitive::Float(got)).into_data();
            assert_eq!(got, want, "rows at {start}");
        }
    }
    // The shared destination itself was not written.
    assert_ne!(
        dst.clone().slice([0..3, 0..6]).into_data(),
        big.slice([0..3, 0..6]).into_data()
    );
}

/// Every rank's model of every rank's rows (what the memory budget decides on) is exactly
/// what that rank's own exchange plan moves, for token splits and the split by rank, with
/// capacity drops.
#[test]
fn every_rank_knows_every_ranks_rows() {
    use mpipemoe::backend::RoutingCounts;
    use mpipemoe::backend::SplitScheme;
    for (n_ranks, n_experts, top_k, capacity) in [(2, 4, 2, None), (4, 8, 1, Some(0.7)), (3, 6, 2, Some(1.0))]
    {
        let results = mpipemoe::LocalGroup::run(n_ranks, |ctx| {
            let tokens = 5 + 7 * ctx.rank;
            let draws = mpipemoe::seeded_uniform(ctx.rank as u64, "routing", tokens * top_k, 1.0);
            // Skewed towards low experts, distinct within a token.
            let mut indices = Vec::new();
            for t in 0..tokens {
                let first = ((draws[t * top_k].abs() * draws[t * top_k].abs()) * n_experts as f32) as usize
                    % n_experts;
                for j in 0..top_k {
                    indices.push((first + j) % n_experts);
                }
            }
            let counts = RoutingCounts::gather(
                &indices,
                tokens,
                top_k,
                n_experts,
                capacity,
                ctx.comm.as_ref(),
                &mpipemoe::comm::SingleRank,
            )?;
            let mut seen = Vec::new();
            for scheme in [SplitScheme::Tokens(1), SplitScheme::Tokens(3), SplitScheme::Ranks] {
                let (_, plan) = counts.plans(scheme);
                let own = counts.rank_rows(ctx.rank, scheme);
                for (i, part) in plan.partitions.iter().enumerate() {
                    assert_eq!(own.send[i], part.send_rows(), "{scheme:?} partition {i}");
                    assert_eq!(own.recv[i], part.rows_per_expert, "{scheme:?} partition {i}");
                }
                assert_eq!(own.recv_rows(), plan.recv_rows());
                assert_eq!(counts.recv_rows_of(ctx.rank), plan.recv_rows());
                seen.push(
                    (0..ctx.n_ranks)
                        .map(|r| counts.rank_rows(r, scheme))
                        .collect::<Vec<_>>(),
                );
            }
            Ok(seen)
        })
        .unwrap();
        for r in &results[1..] {
            assert_eq!(r, &results[0], "ranks disagree about the rows");
        }
    }
}
