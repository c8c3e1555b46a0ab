//! The router's choice of experts on the host (`harness::group_limited_top_k`: one pass a row,
//! the rows split over the cores where the batch is large) against its definition
//! (`harness::group_limited_top_k_reference`: a scan of the row for each expert chosen, the
//! twin the tests compare it with), side by side in one run, on the same values and threads.
//!
//! The layer makes this choice between reading the router's values and planning the
//! exchange; on a GPU the device waits for the host meanwhile. Shapes: 4,096 tokens at the
//! routers of the paper's shapes (8 experts, top-1 and top-2), Mixtral-like (8, top-2 is the
//! same), Qwen-style fine-grained experts (64 experts top-6, 128 top-8) and DeepSeek-V3's
//! group-limited routing (256 experts in 8 groups, top-8 of the best 4 groups).
//!
//! A second group times the finite check on the same values (`harness::all_finite`, a fold
//! in blocks) against `Iterator::all`, which the layer ran before.
//!
//! A third group times what the host does next at one rank, before the exchange's first
//! launch (`harness::plan_on_host`): the counts and capacity, the plans, and the row maps of
//! steps 4 and 6, on the same routers' choices.
//!
//! `cargo bench -p mpipemoe-tools --bench routing`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use mpipemoe::harness::{
    all_finite, group_limited_top_k, group_limited_top_k_reference, plan_on_host, BENCH_ROUTERS,
};
use mpipemoe::rng::SplitMix64;

mod common;

/// Logit-like router values, `[n_tokens, n_experts]`: uniform in [-2, 2), as distinct as f32
/// makes them, seeded by the expert count so that every group reads the same values.
fn logit_like(n_tokens: usize, n_experts: usize) -> Vec<f32> {
    let mut rng = SplitMix64::new(n_experts as u64);
    (0..n_tokens * n_experts)
        .map(|_| (rng.next_f64() * 4.0 - 2.0) as f32)
        .collect()
}

fn routing(c: &mut Criterion) {
    let tokens = 4096;
    let mut group = c.benchmark_group("expert_choice/4096tok");
    for (label, n_experts, top_k, n_group, topk_group) in BENCH_ROUTERS {
        let values = logit_like(tokens, n_experts);
        assert_eq!(
            group_limited_top_k(&values, n_experts, top_k, n_group, topk_group),
            group_limited_top_k_reference(&values, n_experts, top_k, n_group, topk_group),
            "{label}: the two choices differ"
        );
        group.bench_with_input(BenchmarkId::new("definition", label), &values, |b, v| {
            b.iter(|| group_limited_top_k_reference(v, n_experts, top_k, n_group, topk_group))
        });
        group.bench_with_input(BenchmarkId::new("one pass", label), &values, |b, v| {
            b.iter(|| group_limited_top_k(v, n_experts, top_k, n_group, topk_group))
        });
    }
    group.finish();
}

fn finite_check(c: &mut Criterion) {
    let tokens = 4096;
    let mut group = c.benchmark_group("finite_check/4096tok");
    for n_experts in [8, 128] {
        let values = logit_like(tokens, n_experts);
        let label = format!("{n_experts}e");
        group.bench_with_input(BenchmarkId::new("Iterator::all", &label), &values, |b, v| {
            b.iter(|| v.iter().all(|x| x.is_finite()))
        });
        group.bench_with_input(BenchmarkId::new("blocks", &label), &values, |b, v| {
            b.iter(|| all_finite(v))
        });
    }
    group.finish();
}

/// (label, experts, top_k, capacity factor, partitions)
const PLANS: [(&str, usize, usize, Option<f64>, usize); 6] = [
    ("8e-top1", 8, 1, None, 1),
    ("8e-top2", 8, 2, None, 1),
    ("8e-top2-n4", 8, 2, None, 4),
    ("8e-top2-cap1", 8, 2, Some(1.0), 1),
    ("64e-top6", 64, 6, None, 1),
    ("128e-top8", 128, 8, None, 1),
];

fn host_plan(c: &mut Criterion) {
    let tokens = 4096;
    let mut group = c.benchmark_group("host_plan/4096tok");
    for (label, n_experts, top_k, capacity, n_partitions) in PLANS {
        // The choices the router makes on the values the groups above read.
        let indices = group_limited_top_k(&logit_like(tokens, n_experts), n_experts, top_k, 1, 1);
        group.bench_with_input(BenchmarkId::new("plan", label), &indices, |b, idx| {
            b.iter(|| plan_on_host(idx, tokens, top_k, n_experts, capacity, n_partitions).unwrap())
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = common::criterion();
    targets = routing, finite_check, host_plan
}
criterion_main!(benches);
