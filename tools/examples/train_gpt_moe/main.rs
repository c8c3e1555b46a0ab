//! Train a small byte-level GPT whose FFNs are MoE layers, with expert parallelism over
//! threads.
//!
//! ```text
//! cargo run --release --example train_gpt_moe -- [--data FILE] [--ranks 2] [--partitions N|auto]
//!     [--strategy none|s1|s2|s3|s4|auto] [--router softmax|deepseek] [--bias-update G]
//!     [--steps N] [--seed S] [--backend flex|ndarray|wgpu|wgpu-fusion|cuda|cuda-fusion]
//!     [--comm threads|nccl] [--expert-parallel N] [--grad-sync library|host-f64]
//!     [--out DIR | --no-chart] [--json]
//! ```
//!
//! On CUDA (`--features cuda`), `--comm nccl` makes each rank a GPU: `--ranks N` drives GPUs
//! `0..N` from this process, or, launched by torchrun (`torchrun --nproc-per-node N
//! target/release/examples/train_gpt_moe --backend cuda --comm nccl --ranks N`), each process
//! is rank `RANK` of `WORLD_SIZE` on GPU `LOCAL_RANK`; rank 0 prints. A backend or
//! communicator this build or machine lacks is refused with exit status 2.
//!
//! The progress bar shows the load imbalance of the MoE layers (the most loaded expert's
//! assignments over the mean); `DIR/load.png` (default `target/train`) is a heatmap of each
//! expert's load over the steps. With `--router deepseek` the layers route as DeepSeek-V3 does
//! (sigmoid scores, 8 experts in 4 groups of which 2 are kept, an ungated shared expert) and
//! balance their load without an auxiliary loss, by moving the score bias after every step.
//!
//! Every rank holds a replica of the non-expert parameters and `n_experts / ep` experts, where
//! `ep` is `--expert-parallel` (default `--ranks`; below it, the expert-parallel groups are
//! replicated `ranks / ep` times, data-parallel); the global batch is split over the ranks,
//! gradients are summed by the library's `ParallelGroups::sync_grads` (replicated parameters
//! over all ranks, experts over their replicas), and each rank takes the same AdamW step, so
//! the run computes the same losses for any rank count. Without `--data` the corpus is this
//! crate's own sources and docs.

mod data;
mod host_sync;
mod load;
mod model;
mod out;
mod train;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use mpipemoe::{MemoryReuse, MoeBackend, Partitions, RankContext};
use mpipemoe_tools::backends::{device_paths, run_on_gpu, BackendArg, BackendJob, GemmArg, PrecisionArg};
use mpipemoe_tools::flags::{count, non_negative, shadowing, ExecutorArg};
use mpipemoe_tools::heap::Heap;
use mpipemoe_tools::ranks::{check_comm, run_ranks, CommArg};
use serde::Serialize;

use data::Corpus;
use model::GptMoeConfig;
use train::{train_rank, GradSync, RouterChoice, StepLog, TrainOptions, TrainReport};

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq)]
enum GradSyncArg {
    /// `ParallelGroups::sync_grads`: bucketed, on the device.
    Library,
    /// Every replicated gradient through host f64 and an all-gather of the whole vector.
    HostF64,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq)]
enum RouterArg {
    /// Softmax top-k with the load-balancing loss.
    Softmax,
    /// DeepSeek-V3 routing with auxiliary-loss-free balancing.
    Deepseek,
}

/// One rank's training run, on the chosen backend.
struct TrainJob<'a> {
    ctx: &'a RankContext,
    corpus: &'a Corpus,
    options: &'a TrainOptions,
    log: &'a (dyn Fn(&StepLog) + Sync),
}

impl BackendJob for TrainJob<'_> {
    type Output = mpipemoe::Result<TrainReport>;

    fn run<B>(self, device: &B::Device) -> Self::Output
    where
        B: AutodiffBackend + MoeBackend,
        B::InnerBackend: MoeBackend,
    {
        train_rank::<B>(self.ctx, self.corpus, self.options, device, self.log)
    }
}

#[derive(Parser, Debug)]
#[command(about = "Train a toy GPT-MoE on bytes with mpipemoe MoE layers")]
struct Args {
    /// Text to train on (default: this crate's sources and docs).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Ranks (threads, 1..=64).
    #[arg(long, default_value_t = 2, value_parser = count(1, 64))]
    ranks: usize,
    /// Ranks per expert-parallel group (default: all of them); the world is that many times
    /// data-parallel replicas, and the group size must divide the experts and the ranks.
    #[arg(long, value_parser = count(1, 64))]
    expert_parallel: Option<usize>,
    /// How gradients are summed over the ranks: the library's bucketed all-reduce, or the
    /// host f64 all-gather this example used before (the benchmark's comparator).
    #[arg(long, value_enum, default_value_t = GradSyncArg::Library)]
    grad_sync: GradSyncArg,
    /// Partitions of the exchange: a number, or `auto` (Algorithm 1).
    #[arg(long, default_value = "2")]
    partitions: String,
    /// Memory reuse: none, s1..s4, or auto (the cost model, with --memory-budget-mib).
    #[arg(long, default_value = "none")]
    strategy: String,
    /// Per-rank device memory budget of each MoE exchange, MiB (for --strategy auto).
    #[arg(long)]
    memory_budget_mib: Option<f64>,
    /// The MoE layers' router.
    #[arg(long, value_enum, default_value_t = RouterArg::Softmax)]
    router: RouterArg,
    /// Score-bias update speed of auxiliary-loss-free balancing (`--router deepseek`).
    #[arg(long, default_value_t = 0.001)]
    bias_update: f64,
    /// Folder for load.png (the load of every expert over the steps).
    #[arg(long, default_value = "target/train")]
    out: PathBuf,
    /// No load chart: neither `--out` nor a TrueType font is needed (a headless machine).
    #[arg(long)]
    no_chart: bool,
    /// Optimizer steps (1..=10^7).
    #[arg(long, default_value_t = 3000, value_parser = count(1, 10_000_000))]
    steps: usize,
    /// Sequences per step over all ranks (1..=4096).
    #[arg(long, default_value_t = 16, value_parser = count(1, 4096))]
    batch: usize,
    /// Learning rate (a finite number >= 0: NaN would train a model of NaNs).
    #[arg(long, default_value_t = 3e-3, value_parser = non_negative)]
    lr: f64,
    /// Seed of weights, batches and sampling.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Validate every N steps (1..=10^7).
    #[arg(long, default_value_t = 250, value_parser = count(1, 10_000_000))]
    eval_every: usize,
    /// Backend (`wgpu`, `wgpu-fusion` need `--features wgpu`; `cuda`, `cuda-fusion` need
    /// `--features cuda`).
    #[arg(long, value_enum, default_value_t = BackendArg::Flex)]
    backend: BackendArg,
    /// How ranks run: `threads` of this process (any backend), or `nccl`, a GPU per rank
    /// (CUDA backends; torchrun's environment where `WORLD_SIZE` is set).
    #[arg(long, value_enum, default_value_t = CommArg::Threads)]
    comm: CommArg,
    /// How the exchange runs its schedule: `threads`, `in-order`, or the backend's default.
    #[arg(long, value_enum, default_value_t = ExecutorArg::Default)]
    executor: ExecutorArg,
    /// The MoE layers' GEMM precision on the CUDA backends (with `--gemm cublas`): `f32`,
    /// `tf32` or `bf16`, f32 accumulation in all three.
    #[arg(long, value_enum, default_value_t = PrecisionArg::F32)]
    gemm_precision: PrecisionArg,
    /// Which library runs the MoE layers' GEMMs on the CUDA backends: `cublas` or `cubecl`.
    #[arg(long, value_enum, default_value_t = GemmArg::Cublas)]
    gemm: GemmArg,
    /// Hot experts replicated on every rank of an expert-parallel group: `off`, `auto` (the
    /// cost model's choice each step) or a count k (the k most loaded experts each step).
    #[arg(long, default_value = "off", value_parser = shadowing)]
    shadowing: mpipemoe::Shadowing,
    /// Each thread rank computes on a pool of this many threads of its own (1..=1024), as each
    /// GPU has its own cores; default: all ranks share the machine's cores. Not with
    /// `--comm nccl`.
    #[arg(long, value_parser = count(1, 1024))]
    threads_per_rank: Option<usize>,
    /// `keep`: freed memory stays in the process for the next step (no page faults on the
    /// large tensors every step); `system`: glibc's defaults.
    #[arg(long, value_enum, default_value_t = Heap::Keep)]
    heap: Heap,
    /// Print a JSON summary instead of the final line.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct Summary<'a> {
    corpus: &'a str,
    unigram_entropy: f64,
    ranks: usize,
    partitions: &'a str,
    strategy: &'a str,
    steps: usize,
    initial_loss: f64,
    train_loss: f64,
    val_loss: f64,
    tokens_per_s: f64,
    seconds: f64,
    /// Seconds from the process's start to the end of the first training step (of the first
    /// rank to finish one).
    first_step_s: Option<f64>,
    n_partitions: usize,
    chosen_strategy: String,
    router: String,
    load_imbalance_first: f64,
    load_imbalance_last: f64,
    /// Each expert's share of the routing over the first tenth of the steps (all layers):
    /// `MPIPEMOE_SKEW_MEASURED=weights:...` replays it in the skew benchmark.
    early_routing: Vec<f64>,
    expert_parallel: usize,
    grad_sync: String,
    /// Median over the steps of rank 0's gradient-sync time, seconds.
    sync_s_median: f64,
    losses: &'a [f64],
    val_losses: &'a [(usize, f64)],
    sample: &'a str,
}

fn parse_partitions(s: &str) -> Result<Partitions, String> {
    match s {
        "auto" => Ok(Partitions::Adaptive),
        n => count(1, mpipemoe::MAX_PARTITIONS)(n)
            .map(Partitions::Fixed)
            .map_err(|e| format!("--partitions {e} or be `auto`, not {s:?}")),
    }
}

fn parse_strategy(s: &str) -> Result<MemoryReuse, String> {
    match s.to_ascii_lowercase().as_str() {
        "none" => Ok(MemoryReuse::Off),
        "s1" => Ok(MemoryReuse::S1),
        "s2" => Ok(MemoryReuse::S2),
        "s3" => Ok(MemoryReuse::S3),
        "s4" => Ok(MemoryReuse::S4),
        "auto" => Ok(MemoryReuse::Auto),
        _ => Err(format!(
            "--strategy must be none, s1, s2, s3, s4 or auto, not {s:?}"
        )),
    }
}

fn main() -> ExitCode {
    // The process's first moment this program sees: the first step's time is counted from
    // here (issue 56's goal for a fresh machine: a first step within 10 s), so it includes
    // the backend's start, the model's initialisation and every kernel the step compiles.
    let started = Instant::now();
    let args = Args::parse();
    // A backend or communicator this build or machine lacks is a usage error, said before
    // any work starts.
    if let Err(e) = args
        .backend
        .available()
        .and_then(|()| check_comm(args.comm, args.backend, args.ranks))
    {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    // Flags that disagree with their range or with each other are usage errors too.
    let options = match train_options(&args) {
        Ok(options) => options,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    args.heap.apply();
    match run(&args, options, started) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The training options the flags give, or the usage error that names the flag.
fn train_options(args: &Args) -> Result<TrainOptions, String> {
    if args.threads_per_rank.is_some() && args.comm == CommArg::Nccl {
        return Err(
            "--threads-per-rank sizes thread ranks' pools; with --comm nccl each rank is a GPU".into(),
        );
    }
    let partitions = parse_partitions(&args.partitions)?;
    let memory_reuse = parse_strategy(&args.strategy)?;
    if args.ranks == 0 || args.batch < args.ranks {
        return Err(format!(
            "--batch {} must be at least --ranks {} (>= 1)",
            args.batch, args.ranks
        ));
    }
    let router = match args.router {
        RouterArg::Softmax => RouterChoice::Softmax,
        RouterArg::Deepseek => RouterChoice::DeepSeek {
            bias_update: args.bias_update,
        },
    };
    // DeepSeek-style routing keeps 2 of 4 groups: 8 experts make groups of 2.
    let model = match args.router {
        RouterArg::Softmax => GptMoeConfig::new(),
        RouterArg::Deepseek => GptMoeConfig::new().with_n_experts(8),
    };
    let expert_parallel = args.expert_parallel.unwrap_or(args.ranks);
    if !args.ranks.is_multiple_of(expert_parallel) {
        return Err(format!(
            "--expert-parallel {expert_parallel} does not divide --ranks {}",
            args.ranks
        ));
    }
    if model.n_experts % expert_parallel != 0 {
        return Err(format!(
            "{} experts cannot be split over expert-parallel groups of {expert_parallel} (--ranks, or --expert-parallel)",
            model.n_experts
        ));
    }
    if args.grad_sync == GradSyncArg::HostF64 && expert_parallel != args.ranks {
        return Err("--grad-sync host-f64 sums replicated gradients only: it cannot run with --expert-parallel below --ranks".into());
    }
    Ok(TrainOptions {
        model,
        steps: args.steps,
        batch: args.batch,
        lr: args.lr,
        seed: args.seed,
        partitions,
        memory_reuse,
        executor: args.executor.executor(),
        gemm_precision: args.gemm_precision.precision(),
        router,
        memory_budget: args
            .memory_budget_mib
            .map(|m| match m.is_finite() && m > 0.0 && m <= 1e9 {
                true => Ok((m * 1024.0 * 1024.0) as usize),
                false => Err(format!("--memory-budget-mib {m} must be in (0, 1e9]")),
            })
            .transpose()?,
        eval_every: args.eval_every,
        eval_batches: 4,
        sample_len: 160,
        expert_parallel: args.expert_parallel,
        grad_sync: match args.grad_sync {
            GradSyncArg::Library => GradSync::Library,
            GradSyncArg::HostF64 => GradSync::HostF64,
        },
        shadowing: args.shadowing,
    })
}

fn run(args: &Args, options: TrainOptions, started: Instant) -> Result<(), String> {
    let corpus = match &args.data {
        Some(path) => Corpus::from_file(path)?,
        None => Corpus::builtin()?,
    };
    // The outputs this run promises are checked before the first step, so a bad `--out` or a
    // machine without a font for the chart's text costs nothing; the chart itself is written
    // at the end.
    let png = if args.no_chart {
        None
    } else {
        let png = out::check_out(&args.out)?;
        mpipemoe_tools::report::chart_font().map_err(|e| {
            format!(
                "the load chart {} cannot be drawn: {e}; or pass --no-chart",
                png.display()
            )
        })?;
        Some(png)
    };
    let entropy = corpus.unigram_entropy();
    eprintln!(
        "corpus: {} ({} training bytes, unigram entropy {entropy:.3} nats/byte); {} ranks, partitions {}, strategy {}, router {:?}",
        corpus.name,
        corpus.train_len(),
        args.ranks,
        args.partitions,
        args.strategy,
        args.router
    );
    // Under torchrun every process runs this; only rank 0 (`RANK` unset or 0) shows progress.
    let leader = !matches!(std::env::var("RANK"), Ok(r) if r.trim() != "0");
    let bar = match leader {
        true => ProgressBar::new(args.steps as u64),
        false => ProgressBar::hidden(),
    };
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:25}] {pos}/{len} {msg}")
            .map_err(|e| e.to_string())?,
    );
    // indicatif draws nothing when stderr is not a terminal (a log file, a batch job, a GPU
    // machine's captured output), so there a plain line goes out at the first steps, where
    // kernel compilation shows, and about twenty times over the run.
    let plain = leader && !std::io::stderr().is_terminal();
    let plain_every = (args.steps / 20).max(1);
    let first_step = std::sync::OnceLock::<f64>::new();
    let on_step = |log: &StepLog| {
        first_step.get_or_init(|| started.elapsed().as_secs_f64());
        bar.set_position(log.step as u64 + 1);
        let imbalance: Vec<String> = log.imbalance.iter().map(|v| format!("{v:.2}")).collect();
        let evaluated = args.eval_every > 0 && (log.step + 1).is_multiple_of(args.eval_every);
        if plain && (log.step < 3 || (log.step + 1).is_multiple_of(plain_every) || evaluated) {
            eprintln!(
                "[{:7.1} s] step {}/{} loss {:.3} val {} | {:.0} tok/s",
                bar.elapsed().as_secs_f64(),
                log.step + 1,
                args.steps,
                log.loss,
                log.val_loss.map_or("-".into(), |v| format!("{v:.3}")),
                log.tokens_per_s
            );
        }
        bar.set_message(format!(
            "loss {:.3} val {} | load max/mean {} | {:.0} tok/s | n={} {}",
            log.loss,
            log.val_loss.map_or("-".into(), |v| format!("{v:.3}")),
            imbalance.join("/"),
            log.tokens_per_s,
            log.n_partitions,
            log.strategy
        ));
    };
    // The device library (cuBLAS on CUDA) for each GPU a rank of this process runs on, made
    // once per GPU and shared by its rank threads.
    let libraries: std::sync::Mutex<std::collections::HashMap<usize, mpipemoe_tools::backends::AddPaths>> =
        Default::default();
    let ranks = run_ranks(args.comm, args.ranks, args.threads_per_rank, |ctx, gpu| {
        let paths = {
            let mut libraries = libraries.lock().unwrap_or_else(|e| e.into_inner());
            match libraries.get(&gpu) {
                Some(p) => p.clone(),
                None => {
                    let p =
                        device_paths(args.backend, args.gemm, gpu).map_err(mpipemoe::MoeError::Backend)?;
                    libraries.insert(gpu, p.clone());
                    p
                }
            }
        };
        let ctx = mpipemoe::RankContext {
            comm: paths(ctx.comm.clone()),
            ..ctx
        };
        let quiet = |_: &StepLog| {};
        let log: &(dyn Fn(&StepLog) + Sync) = if ctx.rank == 0 { &on_step } else { &quiet };
        let job = TrainJob {
            ctx: &ctx,
            corpus: &corpus,
            options: &options,
            log,
        };
        run_on_gpu(args.backend, gpu, job).map_err(mpipemoe::MoeError::Backend)?
    })
    .map_err(|e| e.to_string())?;
    bar.finish();
    // Every rank computes the same global losses; under torchrun only rank 0 reports them.
    if ranks.first_rank != 0 {
        return Ok(());
    }
    let reports: Vec<TrainReport> = ranks.results;
    let report = &reports[0];
    let initial = report.losses.first().copied().unwrap_or(f64::NAN);
    // The last few steps' mean: one batch's loss is noisy.
    let tail = &report.losses[report.losses.len().saturating_sub(10)..];
    let train_loss = tail.iter().sum::<f64>() / tail.len().max(1) as f64;
    let val_loss = report.val_losses.last().map_or(f64::NAN, |v| v.1);
    let tokens_per_s = (args.steps * args.batch * options.model.seq_len) as f64 / report.seconds;
    let (imbalance_first, imbalance_last) = load::imbalance_first_and_last(&report.load);
    let chart = match &png {
        Some(png) => {
            load::write_heatmap(png, &report.load).map_err(|e| format!("load chart not written: {e}"))
        }
        None => Ok(()),
    };
    if args.json {
        let summary = Summary {
            corpus: &corpus.name,
            unigram_entropy: entropy,
            ranks: args.ranks,
            partitions: &args.partitions,
            strategy: &args.strategy,
            steps: args.steps,
            initial_loss: initial,
            train_loss,
            val_loss,
            tokens_per_s,
            seconds: report.seconds,
            first_step_s: first_step.get().copied(),
            n_partitions: report.n_partitions,
            chosen_strategy: report.strategy.to_string(),
            router: format!("{:?}", args.router).to_lowercase(),
            load_imbalance_first: imbalance_first,
            load_imbalance_last: imbalance_last,
            early_routing: load::early_routing(&report.load),
            expert_parallel: args.expert_parallel.unwrap_or(args.ranks),
            grad_sync: format!("{:?}", args.grad_sync).to_lowercase(),
            sync_s_median: median(&report.sync_seconds),
            losses: &report.losses,
            val_losses: &report.val_losses,
            sample: &report.sample,
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&summary).map_err(|e| e.to_string())?
        );
        // A promised output that was not written fails the run, after what was measured.
        return chart;
    }
    chart?;
    if let Some(png) = &png {
        eprintln!("load per expert over the steps: {}", png.display());
    }
    println!("sample: {}", report.sample.replace('\n', "\n        "));
    println!(
        "load max/mean (mean over layers and the first / last tenth of the steps): {imbalance_first:.3} -> {imbalance_last:.3}"
    );
    println!(
        "{:.1} s, {tokens_per_s:.0} tokens/s; last step: n={} strategy={}; unigram entropy {entropy:.3}",
        report.seconds, report.n_partitions, report.strategy
    );
    if let Some(first) = first_step.get() {
        println!("first step done {first:.1} s after the process started");
    }
    println!(
        "gradient sync ({:?}): median {:.2} ms a step",
        args.grad_sync,
        median(&report.sync_seconds) * 1e3
    );
    println!("final: initial_loss={initial:.4} train_loss={train_loss:.4} val_loss={val_loss:.4}");
    Ok(())
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}
