//! Forward + backward of the MoE layer (Flex by default; `MPIPEMOE_BACKEND` picks another),
//! with seeded tokens and balanced routing, for the paper's GPT3-S and BERT-L
//! expert shapes at token counts the CPU can run, 1 and 2 ranks, against its baselines on the
//! same code path:
//!
//! - FastMoE-style: one partition, no reuse;
//! - FasterMoE-style: the exchange split by destination rank (`Partitions::ByRank`);
//! - PipeMoE: `n` partitions, no reuse;
//! - MPipeMoE's strategies S1–S4 at `n` partitions.
//!
//! `cargo bench --bench layer` prints criterion's report, then a table of medians, and writes
//! `target/bench/layer.json` and `target/bench/layer.png`.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use mpipemoe::memory::Strategy;
use mpipemoe::{MemoryReuse, MoeLayerConfig, Partitions};
use mpipemoe_tools::backends::{run_on, BackendArg};
use mpipemoe_tools::bench_ranks::{RankSetup, StartRanks};
use mpipemoe_tools::inputs::Skew;
use mpipemoe_tools::report::{write_panels, Panel, Series};
use serde::Serialize;

mod common;

#[derive(Debug, Clone, Serialize)]
struct Row {
    shape: String,
    tokens: usize,
    ranks: usize,
    system: String,
    n: usize,
    strategy: String,
    median_ms: f64,
    vs_fastmoe: f64,
}

fn configs(n_ranks: usize) -> Vec<(String, Partitions, Strategy)> {
    let mut out = vec![("FastMoE".to_string(), Partitions::Fixed(1), Strategy::None)];
    if n_ranks > 1 {
        out.push(("FasterMoE".to_string(), Partitions::ByRank, Strategy::None));
    }
    for n in [2, 4] {
        out.push(("PipeMoE".to_string(), Partitions::Fixed(n), Strategy::None));
        for s in [Strategy::S1, Strategy::S2, Strategy::S3, Strategy::S4] {
            out.push(("MPipeMoE".to_string(), Partitions::Fixed(n), s));
        }
    }
    out
}

fn layer(c: &mut Criterion) {
    // `MPIPEMOE_BACKEND=wgpu cargo bench --features wgpu --bench layer` for the WGPU backend.
    let backend = BackendArg::from_env().unwrap_or_else(|e| panic!("{e}"));
    let shapes = [("GPT3-S", 768, 3072), ("BERT-L", 1024, 4096)];
    let tokens = 1024;
    let mut rows = Vec::new();
    for (name, m, h) in shapes {
        for n_ranks in [1usize, 2] {
            let mut group = c.benchmark_group(format!("{name}/{tokens}tok/{n_ranks}rank"));
            group
                .sample_size(10)
                .warm_up_time(Duration::from_millis(500))
                .measurement_time(Duration::from_secs(3));
            let mut baseline = None;
            for (system, partitions, strategy) in configs(n_ranks) {
                // Two experts per rank, top-1 (the paper's k): each rank's experts see its
                // tokens' worth of rows.
                let config = MoeLayerConfig::new(m, h, 2 * n_ranks, 1)
                    .with_partitions(partitions)
                    .with_memory_reuse(MemoryReuse::from(strategy));
                let setup = RankSetup {
                    config,
                    n_ranks,
                    tokens,
                    skew: Skew::Balanced,
                    threads_per_rank: None,
                };
                let ranks = run_on(backend, StartRanks(&setup)).unwrap_or_else(|e| panic!("{e}"));
                let n = match partitions {
                    Partitions::Fixed(n) => n,
                    _ => n_ranks,
                };
                let id = format!("{system}/n{n}/{}", strategy.name());
                group.bench_function(&id, |b| b.iter_custom(|iters| ranks.run(iters)));
                let median = ranks.median_ms();
                let base = *baseline.get_or_insert(median);
                rows.push(Row {
                    shape: name.to_string(),
                    tokens,
                    ranks: n_ranks,
                    system,
                    n,
                    strategy: strategy.name().to_string(),
                    median_ms: median,
                    vs_fastmoe: base / median,
                });
            }
            group.finish();
        }
    }
    report(&rows, backend);
}

fn report(rows: &[Row], backend: BackendArg) {
    println!(
        "\n{:<7} {:>6} {:>5} {:<10} {:>2} {:<5} {:>10} {:>11}",
        "shape", "tokens", "ranks", "system", "n", "strat", "median ms", "vs FastMoE"
    );
    for r in rows {
        println!(
            "{:<7} {:>6} {:>5} {:<10} {:>2} {:<5} {:>10.1} {:>10.2}x",
            r.shape, r.tokens, r.ranks, r.system, r.n, r.strategy, r.median_ms, r.vs_fastmoe
        );
    }
    // The workspace's target folder, where the README and BENCHMARKS.md say the rows are.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("layer.json"),
        serde_json::to_string_pretty(rows).unwrap(),
    )
    .unwrap();
    let mut panels = Vec::new();
    for shape in ["GPT3-S", "BERT-L"] {
        for ranks in [1, 2] {
            let group: Vec<&Row> = rows
                .iter()
                .filter(|r| r.shape == shape && r.ranks == ranks)
                .collect();
            if group.is_empty() {
                continue;
            }
            let fast = group
                .iter()
                .find(|r| r.system == "FastMoE")
                .map(|r| r.median_ms)
                .unwrap_or(0.0);
            let mut series = vec![Series {
                name: "FastMoE (n=1)".into(),
                points: vec![(1.0, fast), (4.0, fast)],
            }];
            if let Some(f) = group.iter().find(|r| r.system == "FasterMoE") {
                series.push(Series {
                    name: "FasterMoE (by rank)".into(),
                    points: vec![(1.0, f.median_ms), (4.0, f.median_ms)],
                });
            }
            for strategy in ["none", "s1", "s2", "s3", "s4"] {
                let points: Vec<(f64, f64)> = group
                    .iter()
                    .filter(|r| r.strategy == strategy && r.system != "FastMoE" && r.system != "FasterMoE")
                    .map(|r| (r.n as f64, r.median_ms))
                    .collect();
                series.push(Series {
                    name: if strategy == "none" {
                        "PipeMoE".into()
                    } else {
                        strategy.to_uppercase()
                    },
                    points,
                });
            }
            panels.push(Panel {
                title: format!("{shape}, 1024 tokens/rank, {ranks} rank(s)"),
                x_label: "partitions n".into(),
                y_label: "fwd+bwd ms (median)".into(),
                series,
                log_x: true,
            });
        }
    }
    if let Err(e) = write_panels(
        &dir.join("layer.png"),
        &format!("MoE layer forward + backward ({backend:?}, 2-core build machine)"),
        &panels,
        2,
    ) {
        eprintln!("chart not written: {e}");
    }
}

criterion_group! {
    name = benches;
    config = common::criterion();
    targets = layer
}
criterion_main!(benches);
