//! Forward + backward of the MoE layer under routing skew, with hot experts shadowed or not
//! (issue 45; Flex by default, `MPIPEMOE_BACKEND` picks another). Two ranks, each computing on
//! a pool of its own of `MPIPEMOE_THREADS_PER_RANK` threads (default 1), as each GPU has its
//! own SMs: without that, an idle rank's cores would absorb the skew and no balancing would
//! show. Two shapes: the toy GPT-MoE's layer (d_model 64, d_hidden 128, 4 experts, top-2,
//! 512 tokens per rank) and GPT3-S's experts (768, 3072, 4 experts, top-1, 1024 tokens per
//! rank). Routing: balanced, Zipf(1.2) and all-to-one (`inputs::Skew`), and the toy's own
//! measured routing where `MPIPEMOE_SKEW_MEASURED` gives it (`weights:W0,W1,...`, from
//! `train_gpt_moe --json`'s `early_routing`). Shadowing: `Off`,
//! `Auto` and every `Fixed(k)`, each configuration on the same batch, side by side in one run:
//! all of a shape's configurations are started together and timed in interleaved rounds
//! (`MPIPEMOE_SKEW_ROUNDS`, default 7), each row the median of its steps.
//!
//! `cargo bench --bench skew` prints criterion's report of balanced routing without shadows,
//! then a table of medians (with each row against `Off` on the same routing, and against `Off`
//! on balanced routing), and writes `target/bench/skew.json`.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use mpipemoe::{MoeLayerConfig, Partitions, Shadowing};
use mpipemoe_tools::backends::{run_on, BackendArg};
use mpipemoe_tools::bench_ranks::{RankSetup, StartRanks};
use mpipemoe_tools::inputs::Skew;
use serde::Serialize;

mod common;

#[derive(Debug, Clone, Serialize)]
struct Row {
    shape: String,
    routing: String,
    shadowing: String,
    /// The experts the layer shadowed on the last timed step.
    shadows: Vec<usize>,
    /// The most loaded rank's computed rows over the mean rank's, on the last timed step.
    rank_imbalance: f64,
    median_ms: f64,
    /// `Off` on the same routing over this row.
    vs_off: f64,
    /// This row over `Off` on balanced routing, same shape.
    vs_balanced_off: f64,
}

fn shadowings(n_experts: usize) -> Vec<Shadowing> {
    let mut out = vec![Shadowing::Off, Shadowing::Auto];
    out.extend((1..n_experts).map(Shadowing::Fixed));
    out
}

fn skew(c: &mut Criterion) {
    let backend = BackendArg::from_env().unwrap_or_else(|e| panic!("{e}"));
    let threads = std::env::var("MPIPEMOE_THREADS_PER_RANK")
        .ok()
        .map(|t| {
            t.parse::<usize>()
                .expect("MPIPEMOE_THREADS_PER_RANK: a thread count")
        })
        .unwrap_or(1);
    let n_ranks = 2;
    let shapes = [
        ("toy", MoeLayerConfig::new(64, 128, 4, 2), 512),
        ("GPT3-S", MoeLayerConfig::new(768, 3072, 4, 1), 1024),
    ];
    let mut skews = vec![Skew::Balanced, Skew::Zipf(1.2), Skew::AllToOne];
    // The toy's own measured routing (`train_gpt_moe --json`'s `early_routing`), when given.
    if let Ok(measured) = std::env::var("MPIPEMOE_SKEW_MEASURED") {
        skews.push(Skew::parse(&measured).unwrap_or_else(|e| panic!("MPIPEMOE_SKEW_MEASURED: {e}")));
    }
    let rounds = std::env::var("MPIPEMOE_SKEW_ROUNDS")
        .ok()
        .map(|r| r.parse::<usize>().expect("MPIPEMOE_SKEW_ROUNDS: a round count"))
        .unwrap_or(7);
    let only = std::env::var("MPIPEMOE_SKEW_ONLY").ok();
    let mut rows: Vec<Row> = Vec::new();
    for (shape, base, tokens) in shapes {
        // Every configuration of a shape is started at once and timed in interleaved rounds
        // (each round a few steps of every configuration in turn), so that a drift of the
        // machine during the run touches all of them alike. Timed one after another, as
        // criterion runs its benchmarks, identical configurations differed by up to 29% here
        // (BENCHMARKS §11), more than the effects the comparison is for.
        let mut runs = Vec::new();
        for routing in &skews {
            for shadowing in shadowings(base.n_experts) {
                // `MPIPEMOE_SKEW_ONLY=GPT3-S/all-to-one` (a prefix of `shape/routing/Fixed(1)`)
                // runs only the matching configurations, e.g. to profile one.
                let name = format!("{shape}/{}/{shadowing:?}", routing.name());
                if !only.as_deref().is_none_or(|p| name.starts_with(p)) {
                    continue;
                }
                // Two partitions: the pipeline the shadowed rows join.
                let config = base
                    .clone()
                    .with_partitions(Partitions::Fixed(2))
                    .with_shadowing(shadowing);
                let setup = RankSetup {
                    config,
                    n_ranks,
                    tokens,
                    skew: routing.clone(),
                    threads_per_rank: Some(threads),
                };
                let ranks = run_on(backend, StartRanks(&setup)).unwrap_or_else(|e| panic!("{e}"));
                // Two untimed steps first: the first steps of a configuration fault in its
                // buffers (and `Auto` measures its profile).
                for _ in 0..2 {
                    ranks.step();
                }
                runs.push((routing.name(), shadowing, ranks));
            }
        }
        // About a second of steps per configuration and round.
        let steps = if shape == "toy" { 20 } else { 1 };
        for round in 0..rounds {
            // Each round starts one configuration later, so that no configuration always
            // follows the same one (a configuration's step can pay for its predecessor's
            // freed memory or cache state: identical configurations differed by up to 10%
            // between fixed positions).
            for i in 0..runs.len() {
                let (_, _, ranks) = &runs[(round + i) % runs.len()];
                ranks.run(steps);
            }
            eprintln!("{shape}: round {} of {rounds}", round + 1);
        }
        if runs.is_empty() {
            continue;
        }
        // criterion's own report of one configuration, so that the harness still measures
        // something comparable across runs: the first (balanced routing without shadows
        // unless filtered).
        let mut group = c.benchmark_group(shape);
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(200))
            .measurement_time(Duration::from_secs(2));
        let first = &runs[0].2;
        group.bench_function(format!("{}/{:?}", runs[0].0, runs[0].1), |b| {
            b.iter_custom(|iters| (0..iters).map(|_| first.step().0).sum())
        });
        group.finish();
        let median = |routing: &str, shadowing: Shadowing| {
            runs.iter()
                .find(|(r, s, _)| r == routing && *s == shadowing)
                .map_or(f64::NAN, |(_, _, ranks)| ranks.median_ms())
        };
        let balanced_off = median(&Skew::Balanced.name(), Shadowing::Off);
        for (routing, shadowing, ranks) in &runs {
            let stats = ranks.last_stats();
            let ms = ranks.median_ms();
            rows.push(Row {
                shape: shape.to_string(),
                routing: routing.clone(),
                shadowing: format!("{shadowing:?}"),
                shadows: stats[0].shadows.clone(),
                rank_imbalance: rank_imbalance(&stats),
                median_ms: ms,
                vs_off: median(routing, Shadowing::Off) / ms,
                vs_balanced_off: ms / balanced_off,
            });
        }
    }
    report(&rows, backend, threads);
}

/// The most loaded rank's computed rows (its expert slots' received rows) over the mean.
fn rank_imbalance(stats: &[mpipemoe::MoeStats]) -> f64 {
    let rows: Vec<f64> = stats.iter().map(|s| s.recv_rows as f64).collect();
    let mean = rows.iter().sum::<f64>() / rows.len().max(1) as f64;
    rows.iter().cloned().fold(0.0, f64::max) / mean.max(1e-9)
}

fn report(rows: &[Row], backend: BackendArg, threads: usize) {
    println!("\n{backend:?}, 2 ranks x {threads} thread(s) each, n = 2");
    println!(
        "{:<7} {:<11} {:<9} {:<9} {:>9} {:>10} {:>8} {:>12}",
        "shape", "routing", "shadowing", "shadows", "rank max", "median ms", "vs Off", "vs bal. Off"
    );
    for r in rows {
        println!(
            "{:<7} {:<11} {:<9} {:<9} {:>9.2} {:>10.1} {:>7.2}x {:>11.2}x",
            r.shape,
            r.routing,
            r.shadowing,
            format!("{:?}", r.shadows),
            r.rank_imbalance,
            r.median_ms,
            r.vs_off,
            r.vs_balanced_off
        );
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("skew.json"), serde_json::to_string_pretty(rows).unwrap()).unwrap();
}

criterion_group! {
    name = benches;
    config = common::criterion();
    targets = skew
}
criterion_main!(benches);
