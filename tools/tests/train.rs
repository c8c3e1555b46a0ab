//! The toy GPT-MoE example trains the same model whatever the rank count, partitions and
//! memory strategy: the first 20 steps' losses agree to 1e-4 relative.
//!
//! The example's own modules are compiled in here, so this tests the code the README runs.

#[allow(dead_code)]
#[path = "../examples/train_gpt_moe/data.rs"]
mod data;
#[allow(dead_code)]
#[path = "../examples/train_gpt_moe/host_sync.rs"]
mod host_sync;
#[allow(dead_code)]
#[path = "../examples/train_gpt_moe/load.rs"]
mod load;
#[allow(dead_code)]
#[path = "../examples/train_gpt_moe/model.rs"]
mod model;
#[path = "../examples/train_gpt_moe/out.rs"]
mod out;
#[allow(dead_code)]
#[path = "../examples/train_gpt_moe/train.rs"]
mod train;

use burn::backend::{Autodiff, Flex};
use mpipemoe::{LocalGroup, MemoryReuse, Partitions, Shadowing};

fn losses(ranks: usize, partitions: Partitions, memory_reuse: MemoryReuse) -> Vec<f64> {
    run(ranks, partitions, memory_reuse, train::RouterChoice::Softmax, 20).losses
}

fn run(
    ranks: usize,
    partitions: Partitions,
    memory_reuse: MemoryReuse,
    router: train::RouterChoice,
    steps: usize,
) -> train::TrainReport {
    run_on::<Autodiff<Flex>>(ranks, partitions, memory_reuse, router, steps)
}

fn run_on<B>(
    ranks: usize,
    partitions: Partitions,
    memory_reuse: MemoryReuse,
    router: train::RouterChoice,
    steps: usize,
) -> train::TrainReport
where
    B: burn::tensor::backend::AutodiffBackend + mpipemoe::MoeBackend,
    B::InnerBackend: mpipemoe::MoeBackend,
{
    run_parallel::<B>(
        ranks,
        None,
        train::GradSync::Library,
        partitions,
        memory_reuse,
        router,
        steps,
        Shadowing::Off,
    )
}

#[allow(clippy::too_many_arguments)]
fn run_parallel<B>(
    ranks: usize,
    expert_parallel: Option<usize>,
    grad_sync: train::GradSync,
    partitions: Partitions,
    memory_reuse: MemoryReuse,
    router: train::RouterChoice,
    steps: usize,
    shadowing: Shadowing,
) -> train::TrainReport
where
    B: burn::tensor::backend::AutodiffBackend + mpipemoe::MoeBackend,
    B::InnerBackend: mpipemoe::MoeBackend,
{
    let corpus = data::Corpus::builtin().unwrap();
    let n_experts = match router {
        train::RouterChoice::Softmax => 4,
        train::RouterChoice::DeepSeek { .. } => 8,
    };
    let options = train::TrainOptions {
        model: model::GptMoeConfig::new()
            .with_seq_len(32)
            .with_d_model(32)
            .with_d_hidden(64)
            .with_n_experts(n_experts),
        steps,
        batch: 8,
        lr: 3e-3,
        seed: 11,
        partitions,
        memory_reuse,
        executor: None,
        gemm_precision: mpipemoe::GemmPrecision::F32,
        router,
        memory_budget: None,
        eval_every: 0,
        eval_batches: 1,
        sample_len: 0,
        expert_parallel,
        grad_sync,
        shadowing,
    };
    let reports = LocalGroup::run(ranks, |ctx| {
        train::train_rank::<B>(&ctx, &corpus, &options, &Default::default(), &|_| {})
    })
    .unwrap();
    // Every rank reports the same global losses and loads.
    for r in &reports[1..] {
        assert_eq!(r.losses, reports[0].losses);
        assert_eq!(r.load, reports[0].load);
    }
    reports[0].clone()
}

#[test]
fn losses_do_not_depend_on_ranks_partitions_or_strategy() {
    let one = losses(1, Partitions::Fixed(1), MemoryReuse::Off);
    let two = losses(2, Partitions::Fixed(4), MemoryReuse::S4);
    assert_eq!(one.len(), 20);
    let mut worst = 0f64;
    for (step, (a, b)) in one.iter().zip(&two).enumerate() {
        let rel = (a - b).abs() / a.abs();
        worst = worst.max(rel);
        assert!(
            rel <= 1e-4,
            "step {step}: {a} (1 rank) vs {b} (2 ranks, n=4, S4): {rel:e}"
        );
    }
    eprintln!("largest relative loss difference over 20 steps: {worst:.2e}");
    // And the model learns: the loss falls over the 20 steps.
    assert!(
        one[19] < one[0] - 0.5,
        "loss did not fall: {} -> {}",
        one[0],
        one[19]
    );
}

/// Mean over layers and steps of the most loaded expert's assignments over the mean.
fn mean_imbalance(load: &[Vec<Vec<usize>>]) -> f64 {
    let values: Vec<f64> = load
        .iter()
        .flatten()
        .map(|l| *l.iter().max().unwrap() as f64 * l.len() as f64 / l.iter().sum::<usize>() as f64)
        .collect();
    values.iter().sum::<f64>() / values.len() as f64
}

/// DeepSeek-V3's auxiliary-loss-free balancing evens out the load: the same run with the score
/// bias moving is better balanced over its second half than with the bias frozen, on one rank
/// and on two (where the update must be identical on both ranks to keep them in step).
/// Issue 34: the library's gradient sync at 4 ranks as 2 expert-parallel groups of 2 (data
/// parallelism over them), and the host f64 sync it replaced, both train the one-rank model.
#[test]
fn expert_and_data_parallel_ranks_and_either_sync_train_the_one_rank_model() {
    let setup = (
        Partitions::Fixed(2),
        MemoryReuse::Off,
        train::RouterChoice::Softmax,
        20,
    );
    let (p, m, r, steps) = setup;
    let sync = train::GradSync::Library;
    let off = Shadowing::Off;
    let one = run_parallel::<Autodiff<Flex>>(1, None, sync, p, m, r, steps, off).losses;
    let ep_dp = run_parallel::<Autodiff<Flex>>(4, Some(2), sync, p, m, r, steps, off);
    let host = run_parallel::<Autodiff<Flex>>(2, None, train::GradSync::HostF64, p, m, r, steps, off).losses;
    let library = run_parallel::<Autodiff<Flex>>(2, None, sync, p, m, r, steps, off).losses;
    // Issue 45: the hottest expert of each of the toy's MoE layers shadowed every step, at 2
    // ranks and within each expert-parallel group of EP 2 x DP 2; several layers' copies are
    // sent forward and their gradients returned in backward, in the same order on every rank.
    let shadowed = run_parallel::<Autodiff<Flex>>(2, None, sync, p, m, r, steps, Shadowing::Fixed(1)).losses;
    let ep_dp_shadowed =
        run_parallel::<Autodiff<Flex>>(4, Some(2), sync, p, m, r, steps, Shadowing::Fixed(2)).losses;
    for (step, a) in one.iter().enumerate() {
        for (name, b, bound) in [
            ("4 ranks, EP 2 x DP 2", ep_dp.losses[step], 1e-4),
            ("2 ranks, host f64 sync", host[step], 1e-4),
            // The two syncs differ only in f32 against f64 summation of two terms.
            ("2 ranks, library sync", library[step], 1e-4),
            ("2 ranks, hot expert shadowed", shadowed[step], 1e-4),
            ("EP 2 x DP 2, two experts shadowed", ep_dp_shadowed[step], 1e-4),
        ] {
            let rel = (a - b).abs() / a.abs();
            assert!(rel <= bound, "step {step}: {a} (1 rank) vs {b} ({name}): {rel:e}");
        }
        let rel = (host[step] - library[step]).abs() / host[step].abs();
        assert!(
            rel <= 1e-5,
            "step {step}: host f64 {} vs library {}: {rel:e}",
            host[step],
            library[step]
        );
    }
    assert_eq!(ep_dp.sync_seconds.len(), 20);
}

#[test]
fn deepseek_routing_balances_load_without_an_auxiliary_loss() {
    let steps = 60;
    for ranks in [1, 2] {
        let frozen = run(
            ranks,
            Partitions::Fixed(2),
            MemoryReuse::Off,
            train::RouterChoice::DeepSeek { bias_update: 0.0 },
            steps,
        );
        let moving = run(
            ranks,
            Partitions::Fixed(2),
            MemoryReuse::Off,
            train::RouterChoice::DeepSeek { bias_update: 0.02 },
            steps,
        );
        let (before, after) = (
            mean_imbalance(&frozen.load[steps / 2..]),
            mean_imbalance(&moving.load[steps / 2..]),
        );
        eprintln!("ranks {ranks}: load max/mean over steps {}..{steps}: frozen bias {before:.3}, balancing {after:.3}", steps / 2);
        assert!(
            after < before - 0.05,
            "ranks {ranks}: balancing did not even the load: {before:.3} -> {after:.3}"
        );
        // The model still learns.
        assert!(moving.losses[steps - 1] < moving.losses[0] - 0.5);
    }
}

/// Validation and sampling run on the inner backend (`model.valid()`, no autodiff graph): that
/// model computes the autodiff model's logits and auxiliary loss, on one rank and on two.
#[test]
fn the_inner_backend_model_computes_the_autodiff_models_logits() {
    use burn::module::AutodiffModule;
    use burn::tensor::{Int, Tensor, TensorData};
    type Ad = Autodiff<Flex>;

    let config = model::GptMoeConfig::new()
        .with_seq_len(16)
        .with_d_model(32)
        .with_d_hidden(64);
    for ranks in [1, 2] {
        let results = LocalGroup::run(ranks, |ctx| {
            let device = Default::default();
            let moe = config.moe().with_partitions(Partitions::Fixed(2));
            let groups = mpipemoe::parallel::ParallelGroups::expert_parallel(ctx.comm.clone());
            let model = config.init::<Ad>(&moe, 5, &device, &groups)?;
            // Each rank its own rows, as in training.
            let ids: Vec<i64> = (0..2 * 16)
                .map(|i| ((i * 37 + ctx.rank * 11) % 256) as i64)
                .collect();
            let data = TensorData::new(ids, [2, 16]);
            let tracked = model.forward(Tensor::<Ad, 2, Int>::from_data(data.clone(), &device))?;
            let inner = model
                .valid()
                .forward(Tensor::<Flex, 2, Int>::from_data(data, &device))?;
            let a = tracked.logits.into_data().to_vec::<f32>().unwrap();
            let b = inner.logits.into_data().to_vec::<f32>().unwrap();
            let aux = (tracked.aux.into_scalar(), inner.aux.into_scalar());
            Ok::<_, mpipemoe::MoeError>((a, b, aux))
        })
        .unwrap();
        for (a, b, (aux_a, aux_b)) in results {
            let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                scale > 0.1 && worst <= 1e-5 * scale,
                "ranks {ranks}: logits differ by {worst:e} (scale {scale})"
            );
            assert!(
                (aux_a - aux_b).abs() <= 1e-5 * aux_a.abs().max(1e-3),
                "ranks {ranks}: aux {aux_a} vs {aux_b}"
            );
        }
    }
}

/// The toy trains on burn's default WGPU backend (fusion) at two ranks: its loss falls over 20
/// steps, and its losses are the raw WGPU backend's (the exchange runs on the inner backend;
/// fusion only regroups the element-wise work around it).
#[cfg(feature = "wgpu")]
#[test]
fn the_toy_trains_on_wgpu_with_fusion() {
    use mpipemoe_tools::backends::WgpuFusion;
    let run = |fusion: bool| {
        let args = (
            2,
            Partitions::Fixed(2),
            MemoryReuse::S4,
            train::RouterChoice::Softmax,
            20,
        );
        match fusion {
            true => run_on::<Autodiff<WgpuFusion>>(args.0, args.1, args.2, args.3, args.4),
            false => run_on::<Autodiff<burn::backend::Wgpu>>(args.0, args.1, args.2, args.3, args.4),
        }
    };
    let (fused, raw) = (run(true).losses, run(false).losses);
    eprintln!("wgpu-fusion losses: {fused:?}");
    assert!(
        fused[19] < fused[0] - 0.5,
        "loss did not fall under fusion: {} -> {}",
        fused[0],
        fused[19]
    );
    for (step, (a, b)) in fused.iter().zip(&raw).enumerate() {
        let rel = (a - b).abs() / b.abs();
        assert!(rel <= 1e-4, "step {step}: fusion {a} vs raw {b} ({rel:e})");
    }
}
