//! One rank's training run with burn-train's `SupervisedTraining` and `Learner`.
//!
//! Every rank runs its own Learner (the way Megatron-Core or DeepSpeed run one trainer per
//! process): its own slice of every global batch, its own artifact folder `DIR/rank-R`
//! (metric logs, checkpoints of its experts), and the library's gradient sync inside the
//! model's `TrainStep::step`. burn-train 0.21's own multi-device strategies do not fit expert
//! parallelism: `MultiDevice` forks one model to every device (each device would hold the same
//! experts), and `ddp` all-reduces every parameter, expert weights included.

use std::ops::RangeInclusive;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::train::checkpoint::KeepLastNCheckpoints;
use burn::train::metric::LossMetric;
use burn::train::{Learner, SupervisedTraining};
use mpipemoe::comm::{rank_range, Payload};
use mpipemoe::optim::AdamWConfig;
use mpipemoe::parallel::ParallelGroups;
use mpipemoe::{MemoryReuse, MoeBackend, MoeError, Partitions, RankContext};
use serde::{Deserialize, Serialize};

use super::data::Corpus;
use super::logs::ResumedFileLogger;
use super::metrics::{ImbalanceMetric, LineRenderer, IMBALANCE};
use super::model::GptMoeConfig;
use super::step::{LmBatch, LmBatcher, LmModel};

/// What to train, the same on every rank.
#[derive(Debug, Clone)]
pub struct LearnerOptions {
    /// The model.
    pub model: GptMoeConfig,
    /// Epochs in all, counting those a resumed run has already done.
    pub epochs: usize,
    /// Optimizer steps per epoch (the epoch's batches are the same every epoch).
    pub steps_per_epoch: usize,
    /// Sequences per step over all ranks.
    pub batch: usize,
    /// AdamW learning rate (constant).
    pub lr: f64,
    /// Seed of the weights and of the batches' offsets.
    pub seed: u64,
    /// Partitions of every MoE layer's exchange.
    pub partitions: Partitions,
    /// Memory reuse of every MoE layer.
    pub memory_reuse: MemoryReuse,
    /// Ranks per expert-parallel group (`None`: all ranks).
    pub expert_parallel: Option<usize>,
    /// Held-out batches per validation.
    pub eval_batches: usize,
    /// The run's folder: `run.json`, and `rank-R/` for each rank's Learner.
    pub dir: PathBuf,
    /// Resume after this epoch's checkpoint.
    pub resume: Option<usize>,
    /// Checkpoints each rank keeps (the newest).
    pub keep_checkpoints: usize,
    /// Rank 0 prints a line every this many steps (0: never).
    pub print_every: usize,
}

/// `(epoch, one value per step)`, in epoch order.
pub type PerEpoch = Vec<(usize, Vec<f64>)>;

/// What one rank's metric logs say about the epochs this run trained.
#[derive(Debug, Clone, Default)]
pub struct LearnerReport {
    /// `(epoch, this rank's training loss of every step)`.
    pub train_loss: PerEpoch,
    /// `(epoch, this rank's validation loss of every held-out batch)`.
    pub valid_loss: PerEpoch,
    /// `(epoch, expert-load imbalance of every training step)`.
    pub imbalance: PerEpoch,
}

/// The layout a run's checkpoints were written for; a resumed run must match it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RunLayout {
    ranks: usize,
    expert_parallel: usize,
    model: GptMoeConfig,
}

/// The checkpoint file of rank `rank`'s model after `epoch` (burn-train's naming).
pub fn model_checkpoint(dir: &Path, rank: usize, epoch: usize) -> PathBuf {
    rank_dir(dir, rank)
        .join("checkpoint")
        .join(format!("model-{epoch}.mpk"))
}

/// Rank `rank`'s Learner folder: its metric logs and checkpoints.
pub fn rank_dir(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}"))
}

/// Trains this rank's replica with a Learner; every rank calls it with the same options.
///
/// # Errors
/// A resumed run whose folder was written by another rank layout, a missing checkpoint, a
/// checkpoint holding other experts than this rank's (each named with both sides), a
/// communicator failure, or a Learner that panicked (its message).
pub fn train_rank_with_learner<B>(
    ctx: &RankContext,
    corpus: &Corpus,
    o: &LearnerOptions,
    device: &B::Device,
) -> mpipemoe::Result<LearnerReport>
where
    B: AutodiffBackend + MoeBackend,
    B::InnerBackend: MoeBackend,
{
    let groups = match o.expert_parallel {
        Some(ep) => ParallelGroups::new(ctx.comm.clone(), ep)?,
        None => ParallelGroups::expert_parallel(ctx.comm.clone()),
    };
    let layout = RunLayout {
        ranks: ctx.n_ranks,
        expert_parallel: o.expert_parallel.unwrap_or(ctx.n_ranks),
        model: o.model.clone(),
    };
    let moe = o
        .model
        .moe()
        .with_partitions(o.partitions)
        .with_memory_reuse(o.memory_reuse);
    let gpt = o.model.init::<B>(&moe, o.seed, device, &groups)?;
    let model = LmModel::new(gpt, groups);
    // 1. A resumed run checks what it resumes before burn-train loads it (burn-train's loader
    //    panics on a missing file and cannot see whose experts a record holds).
    //    The ranks agree before any trains: one rank's refusal stops all of them here, not at
    //    their first collective.
    let checked = match o.resume {
        Some(epoch) => check_resume(&o.dir, ctx.rank, epoch, &layout, &model, device),
        None if ctx.rank == 0 => write_layout(&o.dir, &layout),
        None => Ok(()),
    };
    agree_to_start(ctx, checked)?;
    // 2. This rank's slice of every global batch, the same batches every epoch and in order,
    //    so that a resumed epoch sees what the uninterrupted run saw.
    let mine = rank_range(o.batch, ctx.n_ranks, ctx.rank);
    let seq = o.model.seq_len;
    let train: Vec<Vec<u8>> = (0..o.steps_per_epoch)
        .flat_map(|step| corpus.batch(o.seed, step, o.batch, seq)[mine.clone()].to_vec())
        .collect();
    let valid: Vec<Vec<u8>> = (0..o.eval_batches)
        .flat_map(|i| corpus.val_batch(i, o.eval_batches, o.batch, seq)[mine.clone()].to_vec())
        .collect();
    let train = DataLoaderBuilder::<B, Vec<u8>, LmBatch<B>>::new(LmBatcher)
        .batch_size(mine.len())
        .set_device(device.clone())
        .build(InMemDataset::new(train));
    let valid = DataLoaderBuilder::<B::InnerBackend, Vec<u8>, LmBatch<B::InnerBackend>>::new(LmBatcher)
        .batch_size(mine.len())
        .set_device(device.clone())
        .build(InMemDataset::new(valid));
    // 3. The Learner: the model with its sync, AdamW, a constant learning rate.
    let optimizer = AdamWConfig::new().with_weight_decay(0.01).init::<B, LmModel<B>>();
    let learner = Learner::new(model, optimizer, o.lr);
    let rank_dir = rank_dir(&o.dir, ctx.rank);
    let mut training = SupervisedTraining::new(&rank_dir, train, valid)
        .metric_train_numeric(LossMetric::<Flex>::new())
        .metric_valid_numeric(LossMetric::<Flex>::new())
        .metric_train_numeric(ImbalanceMetric::new())
        .metric_valid_numeric(ImbalanceMetric::new())
        .with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new())
        // Every rank must checkpoint the same epochs: a metric-based strategy would let the
        // ranks' own validation losses choose different ones.
        .with_checkpointing_strategy(KeepLastNCheckpoints::new(o.keep_checkpoints.max(1)))
        .with_application_logger(None)
        // burn-train's default file logger, but writing a resumed run's first epoch under its
        // own number rather than over epoch 1's logs (see logs.rs).
        .with_metric_logger(ResumedFileLogger::new(&rank_dir, o.resume.unwrap_or(0) + 1))
        .renderer(LineRenderer::new(if ctx.rank == 0 { o.print_every } else { 0 }))
        .num_epochs(o.epochs);
    if let Some(epoch) = o.resume {
        training = training.checkpoint(epoch);
    }
    // 4. Train. A step that fails panics (burn-train's steps return no errors); the panic
    //    becomes this rank's error, and the communicator tells the other ranks it has gone.
    catch_unwind(AssertUnwindSafe(|| training.launch(learner))).map_err(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "the Learner panicked".into());
        MoeError::Backend(format!("rank {}: {message}", ctx.rank))
    })?;
    // 5. What burn-train logged for the epochs this run trained, read back from its files.
    read_report(&rank_dir, o.resume.map_or(1, |e| e + 1)..=o.epochs)
}

/// The ranks' agreement to start: every rank hands its own check's error (or nothing) to
/// every other, so that whichever rank reports names every damaged file, not only its own.
/// A rank whose check failed returns its error (with several failing ranks, all of them in
/// one, rank by rank); a rank whose check passed returns a peer failure carrying them, which
/// `LocalGroup` and the NCCL runner rank below the failing rank's own error.
fn agree_to_start(ctx: &RankContext, checked: mpipemoe::Result<()>) -> mpipemoe::Result<()> {
    /// An error's text is cut here: a peer's message, not a file's contents.
    const MAX_MESSAGE: usize = 4096;
    let mut mine = checked
        .as_ref()
        .err()
        .map(ToString::to_string)
        .unwrap_or_default();
    if mine.len() > MAX_MESSAGE {
        let cut = (0..=MAX_MESSAGE)
            .rev()
            .find(|&i| mine.is_char_boundary(i))
            .unwrap_or(0);
        mine.truncate(cut);
    }
    let outgoing = vec![Payload::Bytes(mine.into_bytes()); ctx.n_ranks];
    let heard = ctx.comm.exchange("resume", outgoing)?;
    let failed: Vec<(usize, String)> = heard
        .iter()
        .enumerate()
        .filter_map(|(rank, p)| match p {
            Payload::Bytes(b) if !b.is_empty() => Some((rank, String::from_utf8_lossy(b).into_owned())),
            _ => None,
        })
        .collect();
    let Some((first, _)) = failed.first() else {
        return Ok(());
    };
    let all = failed
        .iter()
        .map(|(rank, e)| format!("rank {rank}: {e}"))
        .collect::<Vec<_>>()
        .join("; ");
    match checked {
        Err(own) if failed.len() == 1 => Err(own),
        Err(_) => Err(MoeError::config(
            "resume",
            format!("{} ranks could not start: {all}", failed.len()),
        )),
        Ok(()) => Err(MoeError::PeerFailed {
            op: "resume".into(),
            rank: ctx.rank,
            peer: *first,
            reason: all,
        }),
    }
}

/// The metrics burn-train logged in one rank's folder for `epochs`.
pub fn read_report(rank_dir: &Path, epochs: RangeInclusive<usize>) -> mpipemoe::Result<LearnerReport> {
    let mut report = LearnerReport::default();
    for epoch in epochs {
        let read = |split: &str, name: &str| read_metric(rank_dir, split, epoch, name);
        report.train_loss.push((epoch, read("train", "Loss")?));
        report.valid_loss.push((epoch, read("valid", "Loss")?));
        report.imbalance.push((epoch, read("train", IMBALANCE)?));
    }
    Ok(report)
}

fn write_layout(dir: &Path, layout: &RunLayout) -> mpipemoe::Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| MoeError::file(dir, e.to_string()))?;
    let json = serde_json::to_vec_pretty(layout).map_err(|e| MoeError::Backend(e.to_string()))?;
    mpipemoe::files::write_whole(&dir.join("run.json"), &json, true)
}

/// Refuses a resume into a folder written by another layout, from a missing checkpoint, or
/// from a checkpoint that holds other experts than this rank's.
fn check_resume<B: Backend>(
    dir: &Path,
    rank: usize,
    epoch: usize,
    layout: &RunLayout,
    model: &LmModel<B>,
    device: &B::Device,
) -> mpipemoe::Result<()> {
    let path = dir.join("run.json");
    let bytes = mpipemoe::files::read_bounded(&path, 1 << 20)?;
    let saved: RunLayout = serde_json::from_slice(&bytes)
        .map_err(|e| MoeError::file(&path, format!("not a run layout: {e}")))?;
    if (saved.ranks, saved.expert_parallel) != (layout.ranks, layout.expert_parallel) {
        return Err(MoeError::config(
            "resume",
            format!(
                "the checkpoints in {} were written by {} rank(s) (expert-parallel {}); this run has {} rank(s) (expert-parallel {})",
                dir.display(),
                saved.ranks,
                saved.expert_parallel,
                layout.ranks,
                layout.expert_parallel
            ),
        ));
    }
    let (saved_model, this_model) = (saved.model.to_string(), layout.model.to_string());
    if saved_model != this_model {
        return Err(MoeError::config(
            "resume",
            format!(
                "the checkpoints in {} are of another model: {saved_model} (this run: {this_model})",
                dir.display()
            ),
        ));
    }
    let file = model_checkpoint(dir, rank, epoch);
    if !file.is_file() {
        return Err(MoeError::file(
            &file,
            format!("no checkpoint of epoch {epoch} for rank {rank} (only the newest are kept)"),
        ));
    }
    let recorder = NamedMpkFileRecorder::<FullPrecisionSettings>::new();
    let loaded = model
        .clone()
        .load_file(file.with_extension(""), &recorder, device)
        .map_err(|e| MoeError::file(&file, e.to_string()))?;
    for block in &loaded.gpt.blocks {
        block.moe.experts.check_shard()?;
    }
    Ok(())
}

/// Every value burn-train's file logger wrote for metric `name` of `split` in `epoch`.
fn read_metric(rank_dir: &Path, split: &str, epoch: usize, name: &str) -> mpipemoe::Result<Vec<f64>> {
    let path = rank_dir
        .join(split)
        .join(format!("epoch-{epoch}"))
        .join(format!("{}.log", name.replace(' ', "_")));
    let bytes = mpipemoe::files::read_bounded(&path, 64 << 20)?;
    String::from_utf8_lossy(&bytes)
        .lines()
        .filter(|line| !line.is_empty())
        .map(|line| {
            line.split(',')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .ok_or_else(|| MoeError::file(&path, format!("not a metric entry: {line:?}")))
        })
        .collect()
}
