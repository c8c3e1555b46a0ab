//! The dense blocks' SwiGLU (a dense layer's MLP, the MoE layer's shared expert) forward and
//! backward under `Autodiff<Flex>`: the one-node op (`mpipemoe::decoder::gated_silu_of`: the
//! halves joined, then the experts' SwiGLU kernel each way on every core) against burn's
//! `silu(gate) · up` recorded one by one (what the blocks ran before, and what NdArray and
//! fusion still run), side by side in one run, on the same inputs and threads.
//!
//! Shapes: 1,024 tokens at the shared-expert widths of DeepSeek-V2-Lite (two experts of 1,408:
//! 2,816) and Qwen1.5-MoE-A2.7B (5,632), and a dense MLP's 1,408.
//!
//! `cargo bench -p mpipemoe-tools --bench dense_swiglu`.

use burn::backend::{Autodiff, Flex};
use burn::tensor::activation::silu;
use burn::tensor::{Distribution, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use mpipemoe::decoder::gated_silu_of;

mod common;

type A = Autodiff<Flex>;

/// One forward and backward; returns the gate's gradient's first value so that nothing is
/// left undone.
fn step(gate: &Tensor<A, 2>, up: &Tensor<A, 2>, weights: &Tensor<A, 2>, node: bool) -> f32 {
    let (gate, up) = (gate.clone().require_grad(), up.clone().require_grad());
    let y = match node {
        true => gated_silu_of(gate.clone(), up.clone()),
        false => silu(gate.clone()) * up.clone(),
    };
    let grads = (y * weights.clone()).sum().backward();
    let dgate = gate.grad(&grads).expect("the gate's gradient");
    let dup = up.grad(&grads).expect("the up half's gradient");
    (dgate.slice([0..1, 0..1]) + dup.slice([0..1, 0..1])).into_scalar()
}

fn dense_swiglu(c: &mut Criterion) {
    let device = Default::default();
    let tokens = 1024;
    let mut group = c.benchmark_group("dense_swiglu/1024tok");
    for d_hidden in [1408, 2816, 5632] {
        let random = |sd| Tensor::<A, 2>::random([tokens, d_hidden], Distribution::Normal(0.0, sd), &device);
        let (gate, up, weights) = (random(2.0), random(1.0), random(1.0));
        for (name, node) in [("burn ops", false), ("one node", true)] {
            group.bench_with_input(BenchmarkId::new(name, d_hidden), &node, |b, &node| {
                b.iter(|| step(&gate, &up, &weights, node))
            });
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = common::criterion();
    targets = dense_swiglu
}
criterion_main!(benches);
