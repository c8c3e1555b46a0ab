//! This crate's side of the side-by-side comparison with PyTorch eager
//! (`scripts/bench/torch_peer.py` runs it alternately with its own PyTorch layer).
//!
//! ```text
//! cargo run --release --example peer -- gelu [--elements 12582912] [--rounds 7] [--input uniform]
//! cargo run --release --example peer -- decode [--d-model 512 --d-hidden 768 --experts 32 --top-k 4]
//! cargo run --release --example peer -- layer --d-model 768 --d-hidden 3072 --tokens 4096 \
//!     [--experts 8] [--top-k 1] [--iters 3] [--partitions 1] [--executor default]
//! ```
//!
//! `gelu` times the exact GELU and its derivative over one `f32` buffer, three ways in
//! alternating rounds: this crate's Flex kernels (vectorised, every core), the kernels they
//! replaced (scalar `libm::erff` per element, every core; kept here as the "before"), and
//! Flex's own `gelu` / `gelu_backward` (burn's kernels). It prints nanoseconds per element.
//! `--input` draws the buffer uniform on `[-4, 4]` (half of it in the tails, where the exact
//! GELU costs most) or from a standard normal (the scale of a layer's pre-activations).
//!
//! `decode` times the layer's forward at one token on Flex without autodiff (a decode step's
//! MoE work: SwiGLU experts, top-k of them used), against its floor in plain burn tensors: the
//! router's product and the chosen experts' three products on separate weight tensors (no
//! copy of any expert's weights), with burn's matmul (`floor_us`) and with the crate's row
//! product, `MoeBackend::expert_matmul` (`floor_rows_us`: the same reads on the layer's own
//! kernel, so `layer_us - floor_rows_us` is the layer's machinery). Each timed pass starts
//! with its weights out of the caches. Medians in microseconds, with the bytes of expert
//! weights a step must read.
//!
//! `layer` times one forward + backward of a FastMoE-style `MoeLayer` (one rank, `n = 1` unless
//! `--partitions` says otherwise, no reuse, dropless, GELU experts; `--executor` picks how the
//! exchange runs its schedule) on Flex, with seeded tokens routed evenly over the experts (the
//! router and token scheme of `mpipemoe_tools::inputs`, which the PyTorch peer copies), after
//! one warm-up pass, and prints the median. One JSON object per run on stdout.

use std::time::{Duration, Instant};

use burn::backend::flex::Flex;
use burn::backend::Autodiff;
use burn::tensor::ops::{ActivationOps, FloatTensor};
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use clap::{Args, Parser, Subcommand};
use mpipemoe::backend::ActivationKernels;
use mpipemoe::{MoeBackend, MoeLayerConfig, Partitions};
use mpipemoe_tools::flags::{count, ExecutorArg};
use mpipemoe_tools::heap::Heap;
use mpipemoe_tools::inputs::{balance_router, balanced_tokens};
use rayon::prelude::*;
use serde_json::json;

type B = Autodiff<Flex>;

#[derive(Parser, Debug)]
struct Cli {
    #[command(subcommand)]
    what: What,
    /// `keep`: freed memory stays in the process between passes; `system`: glibc's defaults.
    #[arg(long, value_enum, default_value_t = Heap::Keep, global = true)]
    heap: Heap,
}

#[derive(Subcommand, Debug)]
enum What {
    /// GELU forward and backward, ns per element.
    Gelu {
        /// Elements of the buffer (default: a `[4096, 3072]` hidden tensor).
        #[arg(long, default_value_t = 4096 * 3072, value_parser = count(1, 1 << 28))]
        elements: usize,
        /// Alternating rounds; medians are reported.
        #[arg(long, default_value_t = 7, value_parser = count(1, 1000))]
        rounds: usize,
        /// How the input is drawn.
        #[arg(long, value_enum, default_value_t = GeluInput::Uniform)]
        input: GeluInput,
    },
    /// One forward + backward of the layer, ms.
    Layer(LayerArgs),
    /// The layer's forward at one token (a decode step), µs, beside its plain-tensor floor.
    Decode(DecodeArgs),
}

/// The shape of one `decode` measurement (default: the Qwen3-MoE shape of
/// `scripts/bench/models_peer.py`).
#[derive(Args, Debug)]
struct DecodeArgs {
    #[arg(long, default_value_t = 512, value_parser = count(1, 65_536))]
    d_model: usize,
    #[arg(long, default_value_t = 768, value_parser = count(1, 262_144))]
    d_hidden: usize,
    #[arg(long, default_value_t = 32, value_parser = count(1, 1024))]
    experts: usize,
    #[arg(long, default_value_t = 4, value_parser = count(1, 64))]
    top_k: usize,
    /// Timed steps after ten warm-up steps; the median is reported.
    #[arg(long, default_value_t = 300, value_parser = count(1, 100_000))]
    iters: usize,
}

/// The distribution of the GELU benchmark's input.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum GeluInput {
    /// Uniform on `[-4, 4]`.
    Uniform,
    /// Standard normal.
    Normal,
}

impl GeluInput {
    /// `elements` seeded draws.
    fn draw(self, elements: usize) -> Vec<f32> {
        match self {
            GeluInput::Uniform => mpipemoe::seeded_uniform(1, "gelu input", elements, 4.0),
            GeluInput::Normal => {
                // Box–Muller on two seeded uniform streams; `1 − v` keeps the logarithm's
                // argument in (0, 1].
                let a = mpipemoe::seeded_uniform(1, "gelu input", elements, 0.5);
                let b = mpipemoe::seeded_uniform(3, "gelu angle", elements, 0.5);
                a.iter()
                    .zip(&b)
                    .map(|(&a, &b)| {
                        let radius = (-2.0 * (1.0 - (a as f64 + 0.5)).max(f64::MIN_POSITIVE).ln()).sqrt();
                        (radius * (std::f64::consts::TAU * (b as f64 + 0.5)).cos()) as f32
                    })
                    .collect()
            }
        }
    }
}

/// The shape and configuration of one `layer` measurement.
#[derive(Args, Debug)]
struct LayerArgs {
    #[arg(long, value_parser = count(1, 65_536))]
    d_model: usize,
    #[arg(long, value_parser = count(1, 262_144))]
    d_hidden: usize,
    #[arg(long, value_parser = count(1, 1 << 20))]
    tokens: usize,
    #[arg(long, default_value_t = 8, value_parser = count(1, 1024))]
    experts: usize,
    #[arg(long, default_value_t = 1, value_parser = count(1, 64))]
    top_k: usize,
    /// Timed passes after one warm-up; the median is reported.
    #[arg(long, default_value_t = 3, value_parser = count(1, 1000))]
    iters: usize,
    /// Partitions of the exchange (1: FastMoE-style).
    #[arg(long, default_value_t = 1, value_parser = count(1, 64))]
    partitions: usize,
    /// How the exchange runs its schedule.
    #[arg(long, value_enum, default_value_t = ExecutorArg::Default)]
    executor: ExecutorArg,
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64()
}

fn primitive(values: &[f32]) -> FloatTensor<Flex> {
    let t = Tensor::<Flex, 1>::from_data(
        TensorData::new(values.to_vec(), [values.len()]),
        &Default::default(),
    );
    t.into_primitive().tensor()
}

/// The kernels this crate used before the vectorised ones: `libm::erff` per element.
mod before {
    use super::*;
    const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
    const INV_SQRT_2PI: f32 = 0.398_942_3;
    const MIN_CHUNK: usize = 1 << 13;

    fn cdf(x: f32) -> f32 {
        0.5 * (1.0 + libm::erff(x * FRAC_1_SQRT_2))
    }

    pub fn gelu(x: &[f32]) -> Vec<f32> {
        x.par_iter()
            .with_min_len(MIN_CHUNK)
            .map(|&x| x * cdf(x))
            .collect()
    }

    pub fn gelu_backward(x: &[f32], g: &mut [f32]) {
        g.par_iter_mut()
            .with_min_len(MIN_CHUNK)
            .zip(x.par_iter())
            .for_each(|(g, &x)| *g *= cdf(x) + x * INV_SQRT_2PI * (-0.5 * x * x).exp());
    }
}

/// Bytes `decode` reads between its timed passes to push their weights out of the caches:
/// four times the L3 of the VM of BENCHMARKS §13 (32 MiB); a CPU with a larger last-level
/// cache wants more.
const EVICT_BYTES: usize = 128 << 20;

fn time(f: impl FnOnce()) -> Duration {
    let start = Instant::now();
    f();
    start.elapsed()
}

fn gelu(elements: usize, rounds: usize, input: GeluInput) -> serde_json::Value {
    let x = input.draw(elements);
    let g = mpipemoe::seeded_uniform(2, "gelu grad", elements, 1.0);
    let mut t: [Vec<Duration>; 6] = Default::default();
    for _ in 0..rounds {
        let (xp, gp) = (primitive(&x), primitive(&g));
        t[0].push(time(|| drop(<Flex as ActivationKernels>::gelu_exact(xp.clone()))));
        t[1].push(time(|| {
            drop(<Flex as ActivationKernels>::gelu_backward_exact(xp.clone(), gp))
        }));
        t[2].push(time(|| drop(before::gelu(&x))));
        let mut gb = g.clone();
        t[3].push(time(|| before::gelu_backward(&x, &mut gb)));
        let gp = primitive(&g);
        t[4].push(time(|| drop(<Flex as ActivationOps<Flex>>::gelu(xp.clone()))));
        t[5].push(time(|| {
            drop(<Flex as ActivationOps<Flex>>::gelu_backward(xp, gp))
        }));
    }
    let ns = |i: usize| median(t[i].clone()) * 1e9 / elements as f64;
    json!({
        "what": "gelu", "elements": elements, "rounds": rounds, "input": format!("{input:?}"), "threads": rayon::current_num_threads(),
        "ours_forward_ns": ns(0), "ours_backward_ns": ns(1),
        "before_forward_ns": ns(2), "before_backward_ns": ns(3),
        "flex_forward_ns": ns(4), "flex_backward_ns": ns(5),
    })
}

fn layer(run: &LayerArgs) -> serde_json::Value {
    let (m, tokens, experts, top_k) = (run.d_model, run.tokens, run.experts, run.top_k);
    let device = Default::default();
    let mut layer = MoeLayerConfig::new(m, run.d_hidden, experts, top_k)
        .with_seed(3)
        .with_partitions(Partitions::Fixed(run.partitions))
        .with_executor(run.executor.executor())
        .init::<B>(&device);
    balance_router(&mut layer);
    let input = Tensor::<B, 2>::from_data(
        TensorData::new(balanced_tokens(5, 0, tokens, m, experts, top_k), [tokens, m]),
        &device,
    )
    .require_grad();
    let pass = || {
        let out = layer.forward(input.clone());
        let grads = out.output.sum().backward();
        // Every gradient is computed by now: Flex finishes each op on the calling thread.
        drop(layer.experts.w_in.grad(&grads));
    };
    pass();
    let times: Vec<Duration> = (0..run.iters).map(|_| time(pass)).collect();
    json!({
        "what": "layer", "d_model": m, "d_hidden": run.d_hidden, "tokens": tokens, "experts": experts,
        "top_k": top_k, "iters": run.iters, "partitions": run.partitions,
        "executor": format!("{:?}", run.executor), "median_ms": median(times) * 1e3,
    })
}

fn decode(run: &DecodeArgs) -> serde_json::Value {
    type I = Flex;
    let (m, h, experts, top_k) = (run.d_model, run.d_hidden, run.experts, run.top_k);
    let device = Default::default();
    let layer = MoeLayerConfig::new(m, h, experts, top_k)
        .with_seed(3)
        .with_activation(mpipemoe::Activation::SwiGlu)
        .init::<I>(&device);
    let x = Tensor::<I, 2>::from_data(
        TensorData::new(mpipemoe::seeded_uniform(5, "decode token", m, 1.0), [1, m]),
        &device,
    );
    // The floor: the router's product, then top-k experts' gate, up and down products on
    // weights held apart (what a decode step must read), weighted and summed.
    let weight = |seed: u64, rows: usize, cols: usize| {
        Tensor::<I, 2>::from_data(
            TensorData::new(
                mpipemoe::seeded_uniform(seed, "decode weight", rows * cols, 0.05),
                [rows, cols],
            ),
            &device,
        )
    };
    let router = weight(1, m, experts);
    let chosen: Vec<[Tensor<I, 2>; 3]> = (0..top_k)
        .map(|e| {
            [
                weight(10 + e as u64, m, h),
                weight(20 + e as u64, m, h),
                weight(30 + e as u64, h, m),
            ]
        })
        .collect();
    // The same floor with each product on the layer's own row product (`expert_matmul`: on
    // Flex the streaming kernel, cut by depth over the threads): what the layer adds to the
    // reads themselves.
    let rows_product = |a: Tensor<I, 2>, w: &Tensor<I, 2>| {
        Tensor::<I, 2>::from_primitive(TensorPrimitive::Float(I::expert_matmul(
            a.into_primitive().tensor(),
            w.clone().into_primitive().tensor(),
        )))
    };
    // One product of the floor: an input row times a weight.
    type Product<'a> = dyn Fn(Tensor<I, 2>, &Tensor<I, 2>) -> Tensor<I, 2> + 'a;
    let floor_with = |product: &Product| {
        let probs = burn::tensor::activation::softmax(product(x.clone(), &router), 1);
        let (weights, _) = probs.topk_with_indices(top_k, 1);
        let mut y = Tensor::<I, 2>::zeros([1, m], &device);
        for (j, [gate, up, down]) in chosen.iter().enumerate() {
            let a = burn::tensor::activation::silu(product(x.clone(), gate)) * product(x.clone(), up);
            y = y + product(a, down) * weights.clone().slice([0..1, j..j + 1]);
        }
        drop(y.into_data());
    };
    let floor = || floor_with(&|a, w| a.matmul(w.clone()));
    let floor_rows = || floor_with(&rows_product);
    let step = || drop(layer.forward(x.clone()).output.into_data());
    // Each timed pass starts with its weights out of the caches, as a decode step finds its
    // experts (the rest of the token's 100 MB or so came between). Without this the three
    // passes read three fixed sets of weights, and the floor on the row product, right after
    // the plain floor's pass over the same weights, read them in part from the L3 (32 MiB on
    // the VM of BENCHMARKS §13): its two-thread floor read at 76 GB/s where the memory gives
    // 45, so the layer looked 1.6 times its floor in one sitting and 1.1 in another.
    let flush: Vec<f32> = vec![1.0; EVICT_BYTES / 4];
    let evict = || {
        std::hint::black_box(flush.iter().step_by(16).sum::<f32>());
    };
    for _ in 0..10 {
        step();
        floor();
        floor_rows();
    }
    // Alternating, so drift hits all three alike.
    let (mut ours, mut plain, mut rows) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..run.iters {
        evict();
        ours.push(time(step));
        evict();
        plain.push(time(floor));
        evict();
        rows.push(time(floor_rows));
    }
    let bytes = top_k * 3 * m * h * 4;
    json!({
        "what": "decode", "d_model": m, "d_hidden": h, "experts": experts, "top_k": top_k,
        "iters": run.iters, "threads": rayon::current_num_threads(),
        "layer_us": median(ours) * 1e6, "floor_us": median(plain) * 1e6,
        "floor_rows_us": median(rows) * 1e6, "expert_bytes": bytes,
    })
}

fn main() {
    let cli = Cli::parse();
    let keeps_freed_memory = cli.heap.apply();
    let mut row = match cli.what {
        What::Gelu {
            elements,
            rounds,
            input,
        } => gelu(elements, rounds, input),
        What::Layer(run) => {
            if run.d_model < run.experts {
                eprintln!(
                    "error: --d-model {} must be at least --experts {} (balanced routing)",
                    run.d_model, run.experts
                );
                std::process::exit(2);
            }
            layer(&run)
        }
        // On a pool's worker, as `mpipemoe generate` runs each rank (`GroupOptions::pool_per_rank`).
        What::Decode(run) => rayon::ThreadPoolBuilder::new()
            .num_threads(rayon::current_num_threads())
            .build()
            .expect("a rayon pool")
            .install(|| decode(&run)),
    };
    row["heap_keeps_freed_memory"] = keeps_freed_memory.into();
    println!("{row}");
}
