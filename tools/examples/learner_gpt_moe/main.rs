//! Train the toy GPT-MoE with burn-train's `Learner`: its metrics (the loss, and the
//! expert-load imbalance as a metric of its own), its checkpointer, and resuming from a
//! checkpoint, on one rank or several.
//!
//! ```text
//! cargo run --release -p mpipemoe-tools --features learner --example learner_gpt_moe --
//!     [--dir DIR] [--ranks 2] [--expert-parallel N]
//!     [--epochs 4] [--steps-per-epoch 50] [--resume EPOCH] [--backend flex|ndarray|wgpu|...]
//! ```
//!
//! Each rank runs its own Learner in `DIR/rank-R` (metric logs under `train/` and `valid/`,
//! checkpoints under `checkpoint/`), and the model's training step sums the gradients over the
//! ranks with the library's `ParallelGroups::sync_grads` before the Learner's optimizer sees
//! them (see `learner.rs` for why burn-train's own multi-device strategies do not fit expert
//! parallelism). `--resume E` continues after epoch E's checkpoints with the same rank layout;
//! another layout, or a checkpoint holding other experts, is refused with both named.
//!
//! Ranks are threads of this process (`--comm threads`), or GPUs joined by NCCL with
//! `--features cuda` (`--comm nccl`, as in `train_gpt_moe`).

#[allow(dead_code)]
#[path = "../train_gpt_moe/data.rs"]
mod data;
mod learner;
mod logs;
mod metrics;
#[allow(dead_code)]
#[path = "../train_gpt_moe/model.rs"]
mod model;
mod step;

use std::path::PathBuf;
use std::process::ExitCode;

use burn::tensor::backend::AutodiffBackend;
use clap::Parser;
use mpipemoe::{MemoryReuse, MoeBackend, Partitions, RankContext};
use mpipemoe_tools::backends::{run_on_gpu, BackendArg, BackendJob};
use mpipemoe_tools::flags::{count, non_negative};
use mpipemoe_tools::ranks::{check_comm, run_ranks, CommArg};

use data::Corpus;
use learner::{train_rank_with_learner, LearnerOptions, LearnerReport};
use model::GptMoeConfig;

#[derive(Parser, Debug)]
#[command(about = "Train the toy GPT-MoE with burn-train's Learner, on one rank or several")]
struct Args {
    /// The run's folder (metric logs and checkpoints of every rank).
    #[arg(long, default_value = "target/learner")]
    dir: PathBuf,
    /// Text to train on (default: this crate's sources and docs).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Ranks (1..=64).
    #[arg(long, default_value_t = 2, value_parser = count(1, 64))]
    ranks: usize,
    /// Ranks per expert-parallel group (default: all of them).
    #[arg(long, value_parser = count(1, 64))]
    expert_parallel: Option<usize>,
    /// Epochs in all (1..=10^5), counting those a resumed run already did.
    #[arg(long, default_value_t = 4, value_parser = count(1, 100_000))]
    epochs: usize,
    /// Steps per epoch (1..=10^6).
    #[arg(long, default_value_t = 50, value_parser = count(1, 1_000_000))]
    steps_per_epoch: usize,
    /// Sequences per step over all ranks (1..=4096).
    #[arg(long, default_value_t = 16, value_parser = count(1, 4096))]
    batch: usize,
    /// Learning rate (a finite number >= 0: NaN would train a model of NaNs).
    #[arg(long, default_value_t = 3e-3, value_parser = non_negative)]
    lr: f64,
    /// Seed of the weights and the batches.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Continue after this epoch's checkpoint (1..=10^5).
    #[arg(long, value_parser = count(1, 100_000))]
    resume: Option<usize>,
    /// Checkpoints each rank keeps (1..=10^5).
    #[arg(long, default_value_t = 2, value_parser = count(1, 100_000))]
    keep_checkpoints: usize,
    /// Print a line every N steps (0: only at the end of each epoch's phases).
    #[arg(long, default_value_t = 10)]
    print_every: usize,
    /// Backend.
    #[arg(long, value_enum, default_value_t = BackendArg::Flex)]
    backend: BackendArg,
    /// How ranks run: threads of this process, or GPUs joined by NCCL.
    #[arg(long, value_enum, default_value_t = CommArg::Threads)]
    comm: CommArg,
}

struct LearnerJob<'a> {
    ctx: &'a RankContext,
    corpus: &'a Corpus,
    options: &'a LearnerOptions,
}

impl BackendJob for LearnerJob<'_> {
    type Output = mpipemoe::Result<LearnerReport>;

    fn run<B>(self, device: &B::Device) -> Self::Output
    where
        B: AutodiffBackend + MoeBackend,
        B::InnerBackend: MoeBackend,
    {
        train_rank_with_learner::<B>(self.ctx, self.corpus, self.options, device)
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = args
        .backend
        .available()
        .and_then(|()| check_comm(args.comm, args.backend, args.ranks))
    {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    if args.batch < args.ranks {
        return Err(format!(
            "--batch {} must be at least --ranks {}",
            args.batch, args.ranks
        ));
    }
    if args.resume.is_some_and(|e| e >= args.epochs) {
        return Err(format!(
            "--resume {} leaves nothing to train: --epochs {} counts the epochs already done",
            args.resume.unwrap_or(0),
            args.epochs
        ));
    }
    let model = GptMoeConfig::new();
    let expert_parallel = args.expert_parallel.unwrap_or(args.ranks);
    if !args.ranks.is_multiple_of(expert_parallel) || !model.n_experts.is_multiple_of(expert_parallel) {
        return Err(format!(
            "--expert-parallel {expert_parallel} must divide --ranks {} and the {} experts",
            args.ranks, model.n_experts
        ));
    }
    let corpus = match &args.data {
        Some(path) => Corpus::from_file(path)?,
        None => Corpus::builtin()?,
    };
    let options = LearnerOptions {
        model,
        epochs: args.epochs,
        steps_per_epoch: args.steps_per_epoch,
        batch: args.batch,
        lr: args.lr,
        seed: args.seed,
        partitions: Partitions::Fixed(2),
        memory_reuse: MemoryReuse::Off,
        expert_parallel: args.expert_parallel,
        eval_batches: 4,
        dir: args.dir.clone(),
        resume: args.resume,
        keep_checkpoints: args.keep_checkpoints,
        print_every: args.print_every,
    };
    eprintln!(
        "corpus: {} ({} training bytes); {} ranks (expert-parallel {expert_parallel}); run folder {}",
        corpus.name,
        corpus.train_len(),
        args.ranks,
        args.dir.display()
    );
    let ranks = run_ranks(args.comm, args.ranks, None, |ctx, gpu| {
        let job = LearnerJob {
            ctx: &ctx,
            corpus: &corpus,
            options: &options,
        };
        run_on_gpu(args.backend, gpu, job).map_err(mpipemoe::MoeError::Backend)?
    })
    .map_err(|e| e.to_string())?;
    if ranks.first_rank != 0 {
        return Ok(());
    }
    // The global loss of a step is the mean of the ranks' losses (every rank has as many
    // tokens); under torchrun this process sees its own rank only.
    let reports = &ranks.results;
    for (i, (epoch, _)) in reports[0].train_loss.iter().enumerate() {
        let mean = |pick: &dyn Fn(&LearnerReport) -> &[f64]| {
            let values: Vec<f64> = reports.iter().flat_map(|r| pick(r).iter().copied()).collect();
            values.iter().sum::<f64>() / values.len().max(1) as f64
        };
        println!(
            "epoch {epoch}: train loss {:.4}, valid loss {:.4}, expert load imbalance {:.3} (mean over steps and the {} rank(s) here)",
            mean(&|r| r.train_loss[i].1.as_slice()),
            mean(&|r| r.valid_loss[i].1.as_slice()),
            mean(&|r| r.imbalance[i].1.as_slice()),
            reports.len()
        );
    }
    println!(
        "checkpoints and metric logs: {}/rank-*/ (resume with --resume EPOCH)",
        args.dir.display()
    );
    Ok(())
}
