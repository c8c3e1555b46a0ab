//! The paper's memory claim on one GPU: the layer's peak device memory over one forward +
//! backward, FastMoE-style (n = 1, no reuse), PipeMoE (n partitions, no reuse) and MPipeMoE
//! (n partitions, each strategy S1–S4), at the paper's GPT3-S, BERT-L and GPT3-XL expert
//! shapes, beside this implementation's memory model (the replay the memory budget runs): the
//! GPU's twin of BENCHMARKS §1, which the CPU's counting allocator measures
//! (`tools/examples/memory.rs`).
//!
//! As in §1, one expert per rank (the paper's E = N), here one rank on one card, top-1, every
//! token routed to it, the exchange skipped (`SingleRank`), the experts on cuBLAS in IEEE f32.
//! Then the same with eight experts on the rank (`--experts`), where the cuBLAS path's
//! scratch for a whole partition (the model's `partition-scratch` route) differs from the
//! primitives' one expert at a time: the rows that check the model's route on the device.
//! `--precision f32,bf16` runs each row at each GEMM precision: at bf16 the path also holds
//! bf16 copies of its operands (the route `partition-scratch bf16`), the experts' matrices
//! among them, which is most of the rank's peak at eight experts.
//! After one warm-up pass (kernels compiled, autotuned), the measured pass builds its partition
//! buffers afresh. Its peak is read from cubecl's device allocator
//! (`mpipemoe::harness::DeviceMemoryMeter`): `in use` is the most bytes in use that a sampler
//! reading the allocator saw (a lower bound where allocations come faster than its reads),
//! `reserved` the most bytes the allocator held from the device (its pages: an upper bound).
//! `model` is the memory model's peak for the same rows; `cut` the saving against FastMoE-style
//! at the same tokens; `reuse` the saving against PipeMoE at the same n. Offloaded partitions
//! (S1–S3) are in pinned host memory, reported apart.
//!
//! ```text
//! gpu_memory [--quick] [--shape GPT3-S|BERT-L|GPT3-XL] [--experts 1,8] [--precision f32,bf16]
//!            [--json FILE]
//! ```

use std::sync::Arc;
use std::time::Instant;

use burn::backend::Autodiff;
use burn_cubecl::cubecl::cuda::CudaRuntime;
use mpipemoe::harness::{measure_layer_peak, DeviceMemoryMeter};
use mpipemoe::memory::Strategy;
use mpipemoe::{Communicator, GemmPrecision, MemoryReuse, MoeLayerConfig, Partitions};
use mpipemoe_cuda::{cuda_available, with_cublas, CudaMoe};
use serde::Serialize;

type B = Autodiff<CudaMoe<f32>>;

/// The paper's expert shapes: name, `d_model`, `d_hidden`.
const SHAPES: [(&str, usize, usize); 3] = [
    ("GPT3-S", 768, 3072),
    ("BERT-L", 1024, 4096),
    ("GPT3-XL", 2048, 8192),
];

const MIB: f64 = 1024.0 * 1024.0;

#[derive(Serialize, Clone)]
struct Row {
    shape: String,
    experts: usize,
    /// The experts' GEMM precision (`f32` or `bf16`).
    precision: String,
    /// The route the memory model replayed (`partition-scratch`: the cuBLAS path).
    route: String,
    tokens: usize,
    n: usize,
    /// `fastmoe` (n = 1, no reuse), `pipemoe` (no reuse) or the strategy.
    what: String,
    in_use_bytes: u64,
    reserved_bytes: u64,
    model_bytes: f64,
    in_use_over_model: f64,
    host_bytes: usize,
    samples: u64,
    cut_bytes: i64,
    cut_percent: f64,
    reuse_saving_bytes: Option<i64>,
}

struct Args {
    quick: bool,
    shape: Option<String>,
    experts: Vec<usize>,
    precisions: Vec<GemmPrecision>,
    json: Option<String>,
}

fn arguments() -> Result<Args, String> {
    let mut args = Args {
        quick: false,
        shape: None,
        experts: vec![1, 8],
        precisions: vec![GemmPrecision::F32],
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => args.quick = true,
            "--json" => args.json = Some(it.next().ok_or("--json needs a file")?),
            "--experts" => {
                let v = it.next().ok_or("--experts needs a list, such as 1,8")?;
                args.experts = v
                    .split(',')
                    .map(|e| match e.trim().parse::<usize>() {
                        Ok(n) if (1..=256).contains(&n) => Ok(n),
                        _ => Err(format!(
                            "--experts {v:?}: expected counts from 1 to 256, such as 1,8"
                        )),
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--precision" => {
                let v = it.next().ok_or("--precision needs a list, such as f32,bf16")?;
                args.precisions = v
                    .split(',')
                    .map(|p| {
                        GemmPrecision::parse(p.trim()).ok_or_else(|| {
                            format!("--precision {v:?}: expected f32, tf32 or bf16, such as f32,bf16")
                        })
                    })
                    .collect::<Result<_, _>>()?;
            }
            "--shape" => {
                let v = it.next().ok_or("--shape needs a name")?;
                if !SHAPES.iter().any(|(name, _, _)| *name == v) {
                    return Err(format!("--shape {v:?}: expected GPT3-S, BERT-L or GPT3-XL"));
                }
                args.shape = Some(v);
            }
            other => return Err(format!("unexpected argument {other:?}")),
        }
    }
    Ok(args)
}

fn fail(message: impl std::fmt::Display, code: i32) -> ! {
    eprintln!("error: {message}");
    std::process::exit(code)
}

fn main() {
    if let Err(e) = cuda_available() {
        fail(e, 2);
    }
    let args = arguments().unwrap_or_else(|e| fail(e, 2));
    let device = Default::default();
    let meter = DeviceMemoryMeter::<CudaRuntime>::new(&device);
    let wrap = |comm: Arc<dyn Communicator>| with_cublas(comm, 0).unwrap_or_else(|e| fail(e, 1));
    let (token_counts, partitions): (&[usize], &[usize]) = match args.quick {
        true => (&[4096], &[4]),
        false => (&[4096, 16384], &[2, 4, 8]),
    };
    let started = Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    let shapes: Vec<_> = SHAPES
        .iter()
        .filter(|(name, _, _)| args.shape.as_deref().is_none_or(|s| s == *name))
        .collect();
    println!(
        "{:8} {:>3} {:>6} {:>2} {:8} {:>10} {:>10} {:>10} {:>8} {:>10} {:>9} {:>10} {:>8}  route",
        "shape",
        "E",
        "tokens",
        "n",
        "what",
        "in use MiB",
        "reserved",
        "model MiB",
        "use/mdl",
        "cut MiB",
        "cut %",
        "reuse MiB",
        "samples"
    );
    let mut grid = Vec::new();
    for &precision in &args.precisions {
        for &experts in &args.experts {
            grid.extend(shapes.iter().map(|&&shape| (precision, experts, shape)));
        }
    }
    for (precision, experts, (name, m, h)) in grid {
        for &tokens in token_counts {
            let mut runs = vec![(1, None)];
            for &n in partitions {
                runs.push((n, Some(Strategy::None)));
                runs.extend([Strategy::S1, Strategy::S2, Strategy::S3, Strategy::S4].map(|s| (n, Some(s))));
            }
            let mut fastmoe = 0i64;
            let mut pipemoe = std::collections::HashMap::new();
            for (n, strategy) in runs {
                // §1's configuration at one rank (its router's bias included).
                let config = MoeLayerConfig::new(m, h, experts, 1)
                    .with_seed(1)
                    .with_router_bias(true)
                    .with_partitions(Partitions::Fixed(n))
                    .with_gemm_precision(precision)
                    .with_memory_reuse(MemoryReuse::from(strategy.unwrap_or(Strategy::None)))
                    // A budget no pass reaches: the layer reports the model's peak for its rows.
                    .with_memory_budget(Some(usize::MAX / 4));
                let measured =
                    measure_layer_peak::<B>(&meter, &config, None, None, tokens, 1, true, &device, &wrap)
                        .unwrap_or_else(|e| {
                            fail(
                                format!(
                            "{name} experts={experts} {precision} tokens={tokens} n={n} {strategy:?}: {e}"
                        ),
                                1,
                            )
                        });
                let rank = &measured.ranks[0];
                let sample = meter.last(0).unwrap_or_default();
                let model = rank.stats.memory.as_ref().map_or(f64::NAN, |d| d.peak_bytes[0]);
                let route = rank.stats.memory.as_ref().map_or("-".into(), |d| d.route.name());
                let in_use = rank.peak_device_bytes as i64;
                let what = match strategy {
                    None => "fastmoe".to_string(),
                    Some(Strategy::None) => "pipemoe".to_string(),
                    Some(s) => s.name().to_string(),
                };
                if strategy.is_none() {
                    fastmoe = in_use;
                }
                if strategy == Some(Strategy::None) {
                    pipemoe.insert(n, in_use);
                }
                let reuse = match strategy {
                    Some(s) if s != Strategy::None => pipemoe.get(&n).map(|&p| p - in_use),
                    _ => None,
                };
                let row = Row {
                    shape: name.to_string(),
                    experts,
                    precision: precision.name().to_string(),
                    route,
                    tokens,
                    n,
                    what,
                    in_use_bytes: in_use as u64,
                    reserved_bytes: sample.peak_reserved,
                    model_bytes: model,
                    in_use_over_model: in_use as f64 / model,
                    host_bytes: rank.host_bytes,
                    samples: sample.samples,
                    cut_bytes: fastmoe - in_use,
                    cut_percent: 100.0 * (fastmoe - in_use) as f64 / fastmoe as f64,
                    reuse_saving_bytes: reuse,
                };
                println!(
                    "{:8} {:>3} {:>6} {:>2} {:8} {:>10.1} {:>10.1} {:>10.1} {:>8.2} {:>10.1} {:>8.1}% {:>10} {:>8}  {}",
                    row.shape,
                    row.experts,
                    row.tokens,
                    row.n,
                    row.what,
                    row.in_use_bytes as f64 / MIB,
                    row.reserved_bytes as f64 / MIB,
                    row.model_bytes / MIB,
                    row.in_use_over_model,
                    row.cut_bytes as f64 / MIB,
                    row.cut_percent,
                    row.reuse_saving_bytes
                        .map_or("-".to_string(), |b| format!("{:.1}", b as f64 / MIB)),
                    row.samples,
                    row.route
                );
                rows.push(row);
            }
        }
    }
    eprintln!("{} rows in {:.0} s", rows.len(), started.elapsed().as_secs_f64());
    if let Some(path) = args.json {
        let json = serde_json::to_string_pretty(&rows).expect("rows serialise");
        std::fs::write(&path, json).unwrap_or_else(|e| fail(format!("--json {path}: {e}"), 1));
    }
}
