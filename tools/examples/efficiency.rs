//! Efficiency of the MoE layer: its forward + backward FLOP rate divided by the same
//! backend's plain dense matmul rate at the same total FLOPs, measured side by side.
//!
//! ```text
//! cargo run --release --example efficiency -- [--tokens 2048] [--rounds 7] [--json]
//! ```
//!
//! The layer's useful work is its six expert GEMMs per routed row (two forward; the input
//! and weight gradients of both in backward): `12 · rows · M · H` FLOPs. The dense reference
//! runs exactly those six GEMMs on plain tensors (no autodiff, no routing). Rounds interleave
//! the two, and medians are compared. The rest of the layer's time is attributed by timing
//! the fused exchange op alone (its expert FFNs with slicing, bias, activation and
//! concatenation) and the router alone.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{Tensor, TensorData, TensorMetadata};
use clap::Parser;
use mpipemoe::backend::SplitScheme;
use mpipemoe::backend::{ExchangeRun, ExpertPart, HostStore, RoutingCounts};
use mpipemoe::comm::SingleRank;
use mpipemoe::memory::Strategy;
use mpipemoe::{MoeBackend, MoeLayerConfig};
use mpipemoe_tools::inputs::{balance_router, balanced_tokens};
use serde::Serialize;

type B = Autodiff<Flex>;
type Inner = Flex;

#[derive(Parser, Debug)]
struct Args {
    /// Tokens per pass.
    #[arg(long, default_value_t = 2048)]
    tokens: usize,
    /// Interleaved rounds (medians are reported).
    #[arg(long, default_value_t = 7)]
    rounds: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Row {
    shape: String,
    tokens: usize,
    experts: usize,
    top_k: usize,
    gflop: f64,
    dense_ms: f64,
    layer_ms: f64,
    exchange_ms: f64,
    router_ms: f64,
    dense_gflops: f64,
    layer_gflops: f64,
    efficiency: f64,
    dense_forward_ms: f64,
    dense_backward_ms: f64,
    exchange_forward_ms: f64,
    exchange_backward_ms: f64,
    rows_per_expert: Vec<usize>,
    ffn_overhead_share: f64,
    layer_overhead_share: f64,
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64()
}

fn sync<Bk: Backend, const D: usize>(t: Tensor<Bk, D>) {
    // Reading one element waits for the work on asynchronous backends.
    let _ = t.flatten::<1>(0, D - 1).narrow(0, 0, 1).into_data();
}

fn main() {
    let args = Args::parse();
    mpipemoe::heap::keep_freed_memory();
    let device = Default::default();
    let mut rows = Vec::new();
    for (name, m, h) in [("GPT3-S", 768usize, 3072usize), ("BERT-L", 1024, 4096)] {
        let (experts, top_k) = (4, 1);
        let routed = args.tokens * top_k;
        let flops = 12.0 * (routed * m * h) as f64;

        // Dense reference: the six GEMMs of one FFN forward + backward over `routed` rows.
        let seeded = |key: &str, shape: [usize; 2]| {
            let values = mpipemoe::seeded_uniform(5, key, shape[0] * shape[1], 1.0);
            Tensor::<Inner, 2>::from_data(TensorData::new(values, shape), &device)
        };
        let x = seeded("x", [routed, m]);
        let w1 = seeded("w1", [m, h]);
        let w2 = seeded("w2", [h, m]);
        let a = x.clone().matmul(w1.clone());
        let y = a.clone().matmul(w2.clone());
        let dense_forward = || {
            let a = x.clone().matmul(w1.clone());
            sync(a.matmul(w2.clone()));
        };
        let dense_backward = || {
            let da = y.clone().matmul(w2.clone().transpose());
            let dw2 = a.clone().transpose().matmul(y.clone());
            let dx = da.clone().matmul(w1.clone().transpose());
            let dw1 = x.clone().transpose().matmul(da);
            sync(dx);
            sync(dw1);
            sync(dw2);
        };
        let dense = || {
            dense_forward();
            dense_backward();
        };

        // The layer: one rank, one partition, no reuse (its fastest configuration here).
        let layer = MoeLayerConfig::new(m, h, experts, top_k)
            .with_seed(3)
            .init::<B>(&device);
        // Seeded tokens routed evenly: every round and every shape times the same batch.
        let mut layer = layer;
        balance_router(&mut layer);
        let input = Tensor::<B, 2>::from_data(
            TensorData::new(
                balanced_tokens(5, 0, args.tokens, m, experts, top_k),
                [args.tokens, m],
            ),
            &device,
        )
        .require_grad();
        let layer_pass = || {
            let out = layer.forward(input.clone());
            let grads = out.output.sum().backward();
            sync(layer.experts.w_in.grad(&grads).unwrap());
        };

        // The fused exchange op alone (inner backend, no autodiff): the expert FFNs.
        let x_inner = input.clone().inner();
        let routing = layer
            .router
            .route(input.clone(), &mpipemoe::RoutingRule::top_k(top_k, false));
        let counts = RoutingCounts::gather(
            &routing.indices,
            args.tokens,
            top_k,
            experts,
            None,
            &SingleRank,
            &SingleRank,
        )
        .unwrap();
        let (dispatch, plan) = counts.plans(SplitScheme::Tokens(1));
        let t_i = x_inner.select(
            0,
            Tensor::from_data(
                TensorData::new(
                    dispatch.row_token.iter().map(|&t| t as i64).collect::<Vec<_>>(),
                    [dispatch.row_token.len()],
                ),
                &device,
            ),
        );
        let experts_inner = layer.clone().valid().experts.tensors();
        let run = ExchangeRun::new(
            Arc::new(SingleRank),
            layer.config().activation,
            Strategy::None,
            HostStore::default(),
        );
        let exchange_split = || -> (Duration, Duration) {
            let start = Instant::now();
            let (out, saved) = Inner::exchange_forward(
                t_i.clone().into_primitive().tensor(),
                experts_inner.clone(),
                &plan,
                &run,
            )
            .unwrap();
            sync(Tensor::<Inner, 2>::from_primitive(
                burn::tensor::TensorPrimitive::Float(out.clone()),
            ));
            let forward = start.elapsed();
            let start = Instant::now();
            let grad = Inner::float_ones(out.shape(), &device, out.dtype().into());
            let mut g = Inner::exchange_backward(grad, saved, &plan, &run).unwrap();
            let w_in = g.experts.take(ExpertPart::WIn).expect("the weights are trained");
            sync(Tensor::<Inner, 3>::from_primitive(
                burn::tensor::TensorPrimitive::Float(w_in),
            ));
            (forward, start.elapsed())
        };
        let exchange = || {
            exchange_split();
        };
        let router = || {
            let r = layer
                .router
                .route(input.clone(), &mpipemoe::RoutingRule::top_k(top_k, false));
            sync(r.weights);
        };

        let (mut t_dense, mut t_layer, mut t_exchange, mut t_router) = (vec![], vec![], vec![], vec![]);
        let (mut t_dense_fw, mut t_dense_bw, mut t_ex_fw, mut t_ex_bw) = (vec![], vec![], vec![], vec![]);
        let time = |f: &dyn Fn(), into: &mut Vec<Duration>| {
            let start = Instant::now();
            f();
            into.push(start.elapsed());
        };
        // Warm-up, then interleaved rounds.
        dense();
        layer_pass();
        exchange();
        for _ in 0..args.rounds {
            time(&dense, &mut t_dense);
            time(&layer_pass, &mut t_layer);
            time(&exchange, &mut t_exchange);
            time(&router, &mut t_router);
            time(&dense_forward, &mut t_dense_fw);
            time(&dense_backward, &mut t_dense_bw);
            let (fw, bw) = exchange_split();
            t_ex_fw.push(fw);
            t_ex_bw.push(bw);
        }
        let (dense_s, layer_s, exchange_s, router_s) = (
            median(t_dense),
            median(t_layer),
            median(t_exchange),
            median(t_router),
        );
        rows.push(Row {
            shape: name.into(),
            tokens: args.tokens,
            experts,
            top_k,
            gflop: flops / 1e9,
            dense_ms: dense_s * 1e3,
            layer_ms: layer_s * 1e3,
            exchange_ms: exchange_s * 1e3,
            router_ms: router_s * 1e3,
            dense_gflops: flops / dense_s / 1e9,
            layer_gflops: flops / layer_s / 1e9,
            efficiency: dense_s / layer_s,
            dense_forward_ms: median(t_dense_fw) * 1e3,
            dense_backward_ms: median(t_dense_bw) * 1e3,
            exchange_forward_ms: median(t_ex_fw) * 1e3,
            exchange_backward_ms: median(t_ex_bw) * 1e3,
            rows_per_expert: plan.partitions[0].rows_per_expert.clone(),
            ffn_overhead_share: (exchange_s - dense_s).max(0.0) / layer_s,
            layer_overhead_share: (layer_s - exchange_s).max(0.0) / layer_s,
        });
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows).unwrap());
        return;
    }
    println!(
        "{:<7} {:>6} {:>7} {:>9} {:>9} {:>11} {:>9} {:>10} {:>10} {:>10} {:>12} {:>12}",
        "shape",
        "tokens",
        "GFLOP",
        "dense ms",
        "layer ms",
        "exchange ms",
        "router ms",
        "dense GF/s",
        "layer GF/s",
        "efficiency",
        "FFN extra",
        "layer extra"
    );
    for r in &rows {
        println!(
            "{:<7} {:>6} {:>7.1} {:>9.1} {:>9.1} {:>11.1} {:>9.2} {:>10.1} {:>10.1} {:>10.2} {:>11.1}% {:>11.1}%",
            r.shape,
            r.tokens,
            r.gflop,
            r.dense_ms,
            r.layer_ms,
            r.exchange_ms,
            r.router_ms,
            r.dense_gflops,
            r.layer_gflops,
            r.efficiency,
            100.0 * r.ffn_overhead_share,
            100.0 * r.layer_overhead_share
        );
    }
    println!();
    for r in &rows {
        println!(
            "{}: forward dense {:.1} ms vs exchange {:.1} ms; backward dense {:.1} ms vs exchange {:.1} ms; rows per expert {:?}",
            r.shape, r.dense_forward_ms, r.exchange_forward_ms, r.dense_backward_ms, r.exchange_backward_ms, r.rows_per_expert
        );
    }
    println!("\nefficiency = dense time / layer time for the same 12·rows·M·H FLOPs (target >= 0.85).");
    println!(
        "FFN extra: exchange op over the dense GEMMs (activation, biases, per-expert slices, concatenation)."
    );
    println!(
        "layer extra: layer over the exchange op (router, plan, permute, unpermute, autodiff bookkeeping)."
    );
}
