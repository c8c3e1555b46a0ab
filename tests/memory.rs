//! Memory, measured with a counting allocator: the implementation's model against the
//! measured peak of every rank, host bytes against the rows each rank received, and the
//! memory budget under routing skew (every token routed to one rank's experts). The paper's
//! Eq. 1–9 are checked against hand-computed values.
//!
//! The allocator counts per rank (each rank thread and its stream workers carry the rank's
//! tag), and the ranks of concurrently running tests would share tags, so everything that
//! measures runs inside one test function, one configuration at a time.

use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::tensor::{Tensor, TensorData};
use mpipemoe::backend::StepExecutor;
use mpipemoe::comm::GroupOptions;
use mpipemoe::format::TensorMap;
use mpipemoe::harness::{
    agreement_error, check_case, expected, measure_layer_memory_with, Case, CheckOptions, CountingAllocator,
};
use mpipemoe::memory::Strategy;
use mpipemoe::memory::{ExpertRoute, LayerShape, PaperTerms};
use mpipemoe::tuning::Profile;
use mpipemoe::{LocalGroup, MemoryReuse, MoeError, MoeLayer, MoeLayerConfig, Partitions, Shadowing};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

type B = Autodiff<Flex>;

const M: usize = 128;
const H: usize = 512;
const TOKENS: usize = 1024;
const MIB: f64 = 1024.0 * 1024.0;

/// A 2-rank, 4-expert layer whose router sends every token to rank 0's experts 0 and 1 (zero
/// weights but for a small random part on those two, and a bias far below for experts 2, 3).
fn skewed(config: &MoeLayerConfig) -> TensorMap {
    let layer = config
        .clone()
        .try_init::<burn::backend::NdArray>(&Default::default())
        .unwrap();
    let mut weights = layer.gather_tensor_map().unwrap().unwrap();
    let mut w = mpipemoe::seeded_uniform(9, "skew", 4 * M, 0.5);
    w[2 * M..].iter_mut().for_each(|v| *v = 0.0);
    weights.insert("router.weight".into(), TensorData::new(w, [4, M]));
    weights.insert(
        "router.bias".into(),
        TensorData::new(vec![0.0f32, 0.0, -30.0, -30.0], [4]),
    );
    weights
}

fn base(n: Partitions, reuse: MemoryReuse) -> MoeLayerConfig {
    MoeLayerConfig::new(M, H, 4, 1)
        .with_router_bias(true)
        .with_seed(3)
        .with_partitions(n)
        .with_memory_reuse(reuse)
}

#[test]
fn memory_model_host_bytes_and_the_budget_under_skew() {
    let device = Default::default();
    // Warm-up: thread pools and allocator caches settle before anything is measured.
    let warm = base(Partitions::Fixed(1), MemoryReuse::Off);
    measure_layer_memory_with::<B>(&ALLOC, &warm, Some(&skewed(&warm)), None, 64, 2, true, &device).unwrap();
    model_tracks_every_rank(&device);
    model_follows_the_shared_expert_gate(&device);
    model_tracks_gpt_oss_and_llama4_rules(&device);
    model_tracks_experts_side_by_side(&device);
    budget_keeps_every_rank_under_it(&device);
    budget_below_the_floor_is_an_error_before_the_exchange(&device);
}

/// The model, evaluated on each rank's actual rows (through a budget so large that it only
/// reports), is within 15% of that rank's measured peak, balanced or skewed, for every
/// strategy; host bytes are exactly the offloaded rows that rank received.
/// GPT-OSS's clamped SwiGLU and Llama 4's weights on the expert input change what the
/// forward and backward hold; the model follows both (measured: without the unweighted `T_I`
/// that autodiff keeps for the weights' gradient, the model was 14% under the measurement,
/// past the budget's 10% headroom).
fn model_tracks_gpt_oss_and_llama4_rules(device: &burn::tensor::Device<B>) {
    let clamped = mpipemoe::Activation::clamped_swiglu(1.702, 7.0).unwrap();
    // The last element: Flex's own experts (the primitives' route is measured in
    // `model_tracks_every_rank`).
    for (activation, weights_on_input, own) in [
        (mpipemoe::Activation::Gelu, true, true),
        (clamped, false, true),
        (clamped, true, true),
    ] {
        for n in [1, 4] {
            for strategy in Strategy::ALL {
                let config = base(Partitions::Fixed(n), strategy.into())
                    .with_activation(activation)
                    .with_weights_on_input(weights_on_input)
                    .with_backend_experts(own)
                    .with_memory_budget(Some(usize::MAX / 4));
                let measured =
                    measure_layer_memory_with::<B>(&ALLOC, &config, None, None, TOKENS, 2, true, device)
                        .unwrap();
                for (rank, r) in measured.ranks.iter().enumerate() {
                    let modelled = r
                        .stats
                        .memory
                        .as_ref()
                        .expect("a budget reports its decision")
                        .peak_bytes[rank];
                    let ratio = r.peak_device_bytes as f64 / modelled;
                    // At most the budget's headroom above the model, so the budget holds.
                    assert!(
                        (0.85..=1.10).contains(&ratio),
                        "{} weights_on_input={weights_on_input} own={own} n={n} {strategy} rank {rank}: measured/model {ratio:.2}",
                        activation.name()
                    );
                }
            }
        }
    }
}

fn model_tracks_every_rank(device: &burn::tensor::Device<B>) {
    let mut report = Vec::new();
    // Each run: (skewed routing, the shared expert's width, `shared_expert_overlap`,
    // shadowing, Flex's own experts, the threaded executor).
    // - The overlap issues the shared expert before the exchange, so what autodiff keeps of
    //   it is live through the exchange; measured on both routes.
    // - Shadowing: the hot expert shadowed (issue 45), so every rank holds its copy, computes
    //   its own rows of it and returns the copy's gradients.
    // - Flex's own experts run as tasks, one at a time on a pool of one thread a rank; without
    //   them, as on the backends without such a path and for experts with adapters
    //   everywhere, the primitives run expert by expert. The model replays each.
    // - The threaded executor, CUDA's above one rank (a worker per stream; the assembled rows
    //   in a buffer of their own, what a step read held to its end, the gradients handed back
    //   as copies), here on the primitives, which it holds the most for.
    let runs = [
        (false, None, false, Shadowing::Off, true, false),
        (true, None, false, Shadowing::Off, true, false),
        (true, Some(2 * M), false, Shadowing::Off, true, false),
        (true, Some(2 * M), true, Shadowing::Off, true, false),
        (true, Some(2 * M), true, Shadowing::Off, false, false),
        (true, None, false, Shadowing::Fixed(1), true, false),
        (true, None, false, Shadowing::Off, false, false),
        (true, None, false, Shadowing::Off, false, true),
    ];
    for (skew, shared, overlap, shadowing, own, threaded) in runs {
        let route = match own {
            true => ExpertRoute::Tasks { concurrent: 1 },
            false => ExpertRoute::ExpertByExpert,
        };
        for n in [1, 4] {
            for strategy in Strategy::ALL {
                let config = base(Partitions::Fixed(n), strategy.into())
                    .with_shared_expert(shared)
                    .with_shared_expert_overlap(overlap)
                    .with_shadowing(shadowing)
                    .with_backend_experts(own)
                    .with_executor(threaded.then_some(StepExecutor::StreamThreads))
                    .with_memory_budget(Some(usize::MAX / 4));
                let weights = skew.then(|| skewed(&config));
                let measured = measure_layer_memory_with::<B>(
                    &ALLOC,
                    &config,
                    weights.as_ref(),
                    None,
                    TOKENS,
                    2,
                    true,
                    device,
                )
                .unwrap();
                for (rank, r) in measured.ranks.iter().enumerate() {
                    let decision = r.stats.memory.as_ref().expect("a budget reports its decision");
                    assert_eq!((decision.n_partitions, decision.strategy), (n, strategy));
                    assert_eq!(
                        decision.route, route,
                        "the route the model replays is the one measured"
                    );
                    assert_eq!(decision.threaded, threaded, "the executor the model replays");
                    let label = format!(
                        "skew={skew} shared={shared:?}{} {shadowing:?} {}{} n={n} {strategy} rank {rank} ({} rows)",
                        if overlap { " overlapped" } else { "" },
                        route.name(),
                        if threaded { ", threaded" } else { "" },
                        r.recv_rows
                    );
                    let modelled = decision.peak_bytes[rank];
                    let ratio = r.peak_device_bytes as f64 / modelled;
                    let line = format!(
                        "{label}: measured {:.2} MiB, model {:.2} MiB, {ratio:.2}",
                        r.peak_device_bytes as f64 / MIB,
                        modelled / MIB
                    );
                    eprintln!("{line}");
                    report.push(line);
                    assert!(
                        (0.85..=1.15).contains(&ratio),
                        "{label}: measured/model {ratio:.2}"
                    );
                    let width = match strategy {
                        Strategy::S1 => M + H,
                        Strategy::S2 => H,
                        Strategy::S3 => M,
                        _ => 0,
                    };
                    assert_eq!(r.host_bytes, r.recv_rows * width * 4, "{label}: host bytes");
                    assert_eq!(decision.recv_rows[rank], r.recv_rows, "{label}");
                }
                if skew && shadowing == Shadowing::Off {
                    assert_eq!(measured.ranks[1].recv_rows, 0, "every token goes to rank 0");
                }
                if shadowing != Shadowing::Off {
                    // Rank 1 computes its own rows of the shadowed expert.
                    assert_eq!(measured.ranks[0].stats.shadows.len(), 1);
                    assert!(measured.ranks[1].recv_rows > 0, "rank 1 computes its rows");
                }
            }
        }
    }
    assert!(!report.is_empty());
}

/// The shared expert with and without its gate (Qwen2-MoE's, and DeepSeek's): the gated one
/// keeps its output before the gate and the gate's scores for the gate's gradient,
/// `T · (M + 1)` values. Where they are live at the peak (the overlap holds them through the
/// exchange's forward, S4's peak) the measured peaks are that far apart; where the peak is in
/// the backward after the shared expert's (S1 without the overlap), they are not. In both the
/// model's difference must be the measured one within a quarter of `T · (M + 1)`: a model
/// that took every shared expert as gated, as it did, is the whole of it off in the first,
/// and one that counted the gate's gradients of x apart from the rest, 2 · T · M off in the
/// second. (Under `none` with the overlap the measured forward and backward peaks are close,
/// and the difference is what lies between them: not a measure of the gate.)
fn model_follows_the_shared_expert_gate(device: &burn::tensor::Device<B>) {
    let kept = (TOKENS * (M + 1) * 4) as f64;
    for (overlap, strategy) in [(true, Strategy::S4), (false, Strategy::S1)] {
        let run = |gated: bool| {
            let config = base(Partitions::Fixed(1), strategy.into())
                .with_shared_expert(Some(2 * M))
                .with_shared_expert_gate(gated)
                .with_shared_expert_overlap(overlap)
                .with_memory_budget(Some(usize::MAX / 4));
            let measured =
                measure_layer_memory_with::<B>(&ALLOC, &config, None, None, TOKENS, 2, true, device).unwrap();
            measured
                .ranks
                .iter()
                .enumerate()
                .map(|(rank, r)| {
                    let decision = r.stats.memory.as_ref().expect("a budget reports its decision");
                    (r.peak_device_bytes as f64, decision.peak_bytes[rank])
                })
                .collect::<Vec<_>>()
        };
        let (gated, ungated) = (run(true), run(false));
        for (rank, (g, u)) in gated.iter().zip(&ungated).enumerate() {
            let (measured, modelled) = (g.0 - u.0, g.1 - u.1);
            let line = format!(
                "shared expert gate, overlap={overlap} {strategy} rank {rank}: gated minus ungated measured {:.3} MiB, model {:.3} MiB (T·(M+1) is {:.3} MiB)",
                measured / MIB,
                modelled / MIB,
                kept / MIB
            );
            eprintln!("{line}");
            assert!((measured - modelled).abs() <= 0.25 * kept, "{line}");
        }
    }
}

/// One rank on a pool of three threads: Flex runs a partition's experts side by side, three
/// at once, each holding its own transients, and the model replays as many at once
/// ([`ExpertRoute::Tasks`]). Within 15% of the measured peak, as on one thread a rank (with a
/// route that replayed one expert at a time, the model was under the measurement).
fn model_tracks_experts_side_by_side(device: &burn::tensor::Device<B>) {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    // Then the threaded executor, which computes on the calling thread too (the experts side
    // by side on its pool), assembles every pass's rows in a buffer of its own and hands the
    // gradients back as copies made while the sums are held: the model replays that
    // (`MoeLayer::model_execution`).
    let in_order = [1, 4]
        .into_iter()
        .flat_map(|n| [Strategy::None, Strategy::S1, Strategy::S4].map(|s| (n, s, false)));
    let threaded = [1, 4].map(|n| (n, Strategy::None, true));
    for (n, strategy, threads) in in_order.chain(threaded) {
        let config = base(Partitions::Fixed(n), strategy.into())
            .with_executor(threads.then_some(StepExecutor::StreamThreads))
            .with_memory_budget(Some(usize::MAX / 4));
        let measured = pool
            .install(|| measure_layer_memory_with::<B>(&ALLOC, &config, None, None, TOKENS, 1, true, device))
            .unwrap();
        let r = &measured.ranks[0];
        let decision = r.stats.memory.as_ref().expect("a budget reports its decision");
        assert_eq!(decision.route, ExpertRoute::Tasks { concurrent: 3 });
        assert_eq!(decision.threaded, threads);
        let ratio = r.peak_device_bytes as f64 / decision.peak_bytes[0];
        let label = format!(
            "side by side{} n={n} {strategy}",
            if threads { ", threaded" } else { "" }
        );
        eprintln!(
            "{label}: measured {:.2} MiB, model {:.2} MiB, {ratio:.2}",
            r.peak_device_bytes as f64 / MIB,
            decision.peak_bytes[0] / MIB
        );
        assert!(
            (0.85..=1.15).contains(&ratio),
            "{label}: measured/model {ratio:.2}"
        );
    }
}

/// All tokens go to rank 0's experts. Without a budget, at n = 1 and no reuse, rank 0's peak
/// is above the budget; with the budget every rank stays under it, and the result is the
/// unbudgeted one.
fn budget_keeps_every_rank_under_it(device: &burn::tensor::Device<B>) {
    let plain = base(Partitions::Fixed(1), MemoryReuse::Off);
    let weights = skewed(&plain);
    let unbudgeted =
        measure_layer_memory_with::<B>(&ALLOC, &plain, Some(&weights), None, TOKENS, 2, false, device)
            .unwrap();
    let rank0 = unbudgeted.ranks[0].peak_device_bytes;
    let budget = rank0 * 55 / 100;
    assert!(rank0 > budget);
    let budgeted_config = base(Partitions::Adaptive, MemoryReuse::Auto)
        .with_adaptive_candidates(vec![1, 2, 4, 8])
        .with_memory_budget(Some(budget));
    let budgeted = measure_layer_memory_with::<B>(
        &ALLOC,
        &budgeted_config,
        Some(&weights),
        None,
        TOKENS,
        2,
        true,
        device,
    )
    .unwrap();
    let decision = budgeted.ranks[0].stats.memory.clone().unwrap();
    eprintln!(
        "budget {budget} B (rank 0 unbudgeted: {rank0} B): chose n={} {} ({}); measured {:?}",
        decision.n_partitions,
        decision.strategy,
        decision.reason,
        budgeted
            .ranks
            .iter()
            .map(|r| r.peak_device_bytes)
            .collect::<Vec<_>>()
    );
    assert!(
        decision.n_partitions > 1 || decision.strategy != Strategy::None,
        "{decision:?}"
    );
    assert_eq!(
        budgeted.ranks[1].stats.memory.as_ref(),
        Some(&decision),
        "both ranks decide alike"
    );
    for (rank, r) in budgeted.ranks.iter().enumerate() {
        assert!(
            r.peak_device_bytes <= budget,
            "rank {rank}: {} B over the budget of {budget} B",
            r.peak_device_bytes
        );
    }

    // The same outputs and gradients as without the budget (the generated case's expected
    // tensors come from the float64 oracle; both runs are compared with each other).
    let mut inputs = weights.clone();
    for name in ["x", "probe"] {
        let values = mpipemoe::seeded_uniform(11, name, 2 * TOKENS * M, 1.0);
        inputs.insert(name.into(), TensorData::new(values, [2 * TOKENS, M]));
    }
    let case = Case::from_parts("skewed", &plain, inputs).unwrap();
    let run = |budget: Option<usize>, partitions| {
        let options = CheckOptions {
            n_ranks: 2,
            partitions,
            memory_budget: budget,
            ..CheckOptions::default()
        };
        let config = case.config.clone().with_adaptive_candidates(vec![1, 2, 4, 8]);
        let case = Case {
            config,
            ..case.clone()
        };
        check_case::<B>(&case, &options, device).unwrap()
    };
    let free = run(None, Partitions::Fixed(1));
    let bounded = run(Some(budget), Partitions::Adaptive);
    assert!(
        free.passed(1e-4) && bounded.passed(1e-4),
        "{:?} {:?}",
        free.worst(),
        bounded.worst()
    );
    for (name, got) in &bounded.tensors {
        let err = agreement_error(got, &free.tensors[name], &expected(&case, name));
        assert!(err <= 1e-6, "{name}: budgeted vs unbudgeted {err:e}");
    }
}

/// A budget below what the skewed batch needs even at the largest n with S4: every rank
/// returns the same memory error, promptly, and nothing of the exchange was allocated.
fn budget_below_the_floor_is_an_error_before_the_exchange(device: &burn::tensor::Device<B>) {
    let config = base(Partitions::Adaptive, MemoryReuse::Auto)
        .with_adaptive_candidates(vec![1, 2, 4, 8])
        .with_memory_budget(Some(64 * 1024));
    let weights = skewed(&config);
    let start = Instant::now();
    let results = LocalGroup::run_each(
        GroupOptions {
            timeout: Duration::from_secs(20),
            ..GroupOptions::default()
        },
        2,
        |ctx| {
            CountingAllocator::tag_thread(Some(ctx.rank));
            let layer = MoeLayer::<B>::from_tensor_map(
                &config,
                &weights,
                "skewed".as_ref(),
                device,
                ctx.comm.clone(),
            )?;
            // A profile for the cost model is given, so nothing is measured on the first call.
            layer.context().set_profile(Profile::a100_cluster(2));
            let values = mpipemoe::seeded_uniform(ctx.rank as u64, "x", TOKENS * M, 1.0);
            let x = Tensor::<B, 2>::from_data(TensorData::new(values, [TOKENS, M]), device).require_grad();
            ctx.comm.barrier()?;
            if ctx.rank == 0 {
                ALLOC.reset_peak();
            }
            ctx.comm.barrier()?;
            let before = ALLOC.rank_current(ctx.rank);
            let result = layer.try_forward(x).map(|_| ());
            let peak = ALLOC.rank_peak(ctx.rank).saturating_sub(before);
            CountingAllocator::tag_thread(None);
            Ok((result, peak))
        },
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    let input_bytes = TOKENS * M * 4;
    let mut messages = Vec::new();
    for (rank, r) in results.into_iter().enumerate() {
        let (result, peak) = r.unwrap();
        match result {
            Err(MoeError::Memory(msg)) => {
                assert!(
                    msg.contains("rank 0 receives 2048 rows") && msg.contains("65536 bytes"),
                    "{msg}"
                );
                messages.push(msg);
            }
            other => panic!("rank {rank}: expected a memory error, got {other:?}"),
        }
        // The input check and the router only: T_I alone would be another input's worth.
        eprintln!("rank {rank}: {peak} B allocated before the memory error (the input is {input_bytes} B)");
        assert!(
            peak < input_bytes * 3 / 2,
            "rank {rank} allocated {peak} B before failing"
        );
    }
    assert_eq!(messages[0], messages[1], "both ranks report the same decision");
}

#[test]
fn paper_equations_match_hand_computation() {
    let shape = |tokens, m, h, ranks, n| LayerShape::paper(tokens, m, h, ranks, n);
    // B = 4096 tokens, M = 1024, H = 4096, E = N = 8, n = 4 (BERT-L expert shape).
    let terms = PaperTerms::new(&shape(4096, 1024, 4096, 8, 4));
    let (b, m, h, e, n) = (4096.0, 1024.0, 4096.0, 8.0, 4.0);
    assert_eq!(terms.m_ms, 4.0 * (e * m + 2.0 * h * m));
    assert_eq!(terms.m_act, 4.0 * b * m + b * h);
    assert_eq!(terms.m_buf, b * m + b * h);
    assert_eq!(terms.m_act_pipe, 4.0 * b * m + b * h);
    assert_eq!(terms.m_buf_pipe, terms.m_act_pipe);
    let delta = b * (2.0 * m * (n - 2.0) / n + h * (n - 1.0) / n);
    assert_eq!(terms.delta_m_act, delta);
    assert_eq!(terms.delta_m_buf, delta);
    assert_eq!(terms.phi, 2.0 * delta / (terms.m_ms + 2.0 * terms.m_act_pipe));
    // 4096 · (1024 + 3072) = 16_777_216 elements each; φ = 33_554_432 / 100_696_064.
    assert_eq!(delta, 16_777_216.0);
    assert!((terms.phi - 0.333_224_9).abs() < 1e-6, "phi {}", terms.phi);
    // Bytes scale by the dtype size; φ does not.
    let bytes = terms.to_bytes(2);
    assert_eq!(bytes.m_act, 2.0 * terms.m_act);
    assert_eq!(bytes.phi, terms.phi);
    // With E/N local experts the model states count this rank's experts only.
    let mut sharded = shape(4096, 1024, 4096, 8, 4);
    sharded.n_experts = 64;
    assert_eq!(
        PaperTerms::new(&sharded).m_ms,
        4.0 * (64.0 * m + 2.0 * h * m * 8.0)
    );
}
