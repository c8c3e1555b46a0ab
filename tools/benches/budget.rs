//! What a memory budget costs the layer on the CPU: forward + backward under a budget that
//! every pass fits (so that only the route differs), with the experts on Flex's own path, as
//! the memory model now replays it, beside the same budget with the experts on the
//! primitives, one after another (`.with_backend_experts(false)`: the route a budget took
//! before the model replayed Flex's), and without a budget. GPT3-S's expert shape, 1,024
//! tokens a rank, two experts a rank, top-1, n = 4 with S3, one and two ranks.
//!
//! `cargo bench -p mpipemoe-tools --bench budget` prints criterion's report, then a table of
//! medians with each row's time over the primitives' under the same budget.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use mpipemoe::memory::Strategy;
use mpipemoe::{MemoryReuse, MoeLayerConfig, Partitions};
use mpipemoe_tools::backends::{run_on, BackendArg};
use mpipemoe_tools::bench_ranks::{RankSetup, StartRanks};
use mpipemoe_tools::inputs::Skew;

mod common;

/// The systems compared: name, budget, experts on the backend's own path.
const SYSTEMS: [(&str, Option<usize>, bool); 3] = [
    ("budget, primitives", Some(usize::MAX / 4), false),
    ("budget, own path", Some(usize::MAX / 4), true),
    ("no budget", None, true),
];

fn budget(c: &mut Criterion) {
    let backend = BackendArg::from_env().unwrap_or_else(|e| panic!("{e}"));
    let (m, h, tokens) = (768, 3072, 1024);
    let mut rows = Vec::new();
    for n_ranks in [1usize, 2] {
        let mut group = c.benchmark_group(format!("GPT3-S/{tokens}tok/{n_ranks}rank/n4/s3"));
        group
            .sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3));
        let mut primitives = None;
        for (system, limit, own) in SYSTEMS {
            let config = MoeLayerConfig::new(m, h, 2 * n_ranks, 1)
                .with_partitions(Partitions::Fixed(4))
                .with_memory_reuse(MemoryReuse::from(Strategy::S3))
                .with_memory_budget(limit)
                .with_backend_experts(own);
            let setup = RankSetup {
                config,
                n_ranks,
                tokens,
                skew: Skew::Balanced,
                threads_per_rank: None,
            };
            let ranks = run_on(backend, StartRanks(&setup)).unwrap_or_else(|e| panic!("{e}"));
            group.bench_function(system, |b| b.iter_custom(|iters| ranks.run(iters)));
            let median = ranks.median_ms();
            let base = *primitives.get_or_insert(median);
            rows.push((n_ranks, system, median, median / base));
        }
        group.finish();
    }
    println!(
        "\n{:>5} {:<20} {:>10} {:>18}",
        "ranks", "system", "median ms", "/ budget, primitives"
    );
    for (ranks, system, median, ratio) in rows {
        println!("{ranks:>5} {system:<20} {median:>10.1} {ratio:>17.2}x");
    }
}

criterion_group! {
    name = benches;
    config = common::criterion();
    targets = budget
}
criterion_main!(benches);
