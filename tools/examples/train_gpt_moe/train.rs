//! One rank's training loop: data-parallel replicas of everything but the experts.

use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Int, Tensor, TensorData};
use mpipemoe::backend::StepExecutor;
use mpipemoe::comm::rank_range;
use mpipemoe::memory::Strategy;
use mpipemoe::optim::AdamWConfig;
use mpipemoe::parallel::ParallelGroups;
use mpipemoe::{
    seeded_uniform, MemoryReuse, MoeBackend, MoeLayerConfig, Partitions, RankContext, Scoring, Shadowing,
};
use serde::Serialize;

use super::data::Corpus;
use super::host_sync;
use super::model::{cross_entropy_sum, GptMoe, GptMoeConfig};

/// The MoE layers' router.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterChoice {
    /// Softmax top-k with the load-balancing and z losses (Switch / Mixtral style).
    Softmax,
    /// DeepSeek-V3: sigmoid scores, group-limited top-k (4 groups, 2 kept), an ungated shared
    /// expert, and auxiliary-loss-free balancing of the score bias by `bias_update` per step.
    DeepSeek {
        /// The bias update speed `gamma`.
        bias_update: f64,
    },
}

impl RouterChoice {
    /// The MoE layer config of this router family on `base`.
    pub fn apply(self, base: MoeLayerConfig) -> MoeLayerConfig {
        match self {
            RouterChoice::Softmax => base,
            RouterChoice::DeepSeek { .. } => {
                let h = base.d_hidden;
                base.with_scoring(Scoring::Sigmoid)
                    .with_score_bias(true)
                    .with_normalize_topk(true)
                    .with_n_group(4)
                    .with_topk_group(2)
                    .with_shared_expert(Some(h))
                    .with_shared_expert_gate(false)
                    .with_aux_loss_coef(0.0)
            }
        }
    }
}

/// What to train.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// The model.
    pub model: GptMoeConfig,
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per step over all ranks.
    pub batch: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// Seed of weights, batches and sampling.
    pub seed: u64,
    /// Partitions of every MoE layer's exchange.
    pub partitions: Partitions,
    /// Memory reuse of every MoE layer.
    pub memory_reuse: MemoryReuse,
    /// How every MoE layer's exchange runs its schedule (`None`: the backend's default).
    pub executor: Option<StepExecutor>,
    /// The MoE layers' GEMM precision where the communicator offers a device library.
    pub gemm_precision: mpipemoe::GemmPrecision,
    /// The MoE layers' router.
    pub router: RouterChoice,
    /// Device bytes per rank the exchange may use (for `MemoryReuse::Auto`).
    pub memory_budget: Option<usize>,
    /// Validate every this many steps (and at the end).
    pub eval_every: usize,
    /// Held-out batches per validation.
    pub eval_batches: usize,
    /// Bytes to generate at the end (0: none).
    pub sample_len: usize,
    /// Ranks per expert-parallel group (`None`: all ranks, no data-parallel replicas of the
    /// experts).
    pub expert_parallel: Option<usize>,
    /// How gradients are summed over the ranks.
    pub grad_sync: GradSync,
    /// Hot experts of every MoE layer replicated on its expert-parallel group's ranks.
    pub shadowing: Shadowing,
}

/// How the gradients of a step are summed over the ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradSync {
    /// The library's bucketed all-reduce on the device (`ParallelGroups::sync_grads`).
    Library,
    /// The host f64 all-gather this example used before, BENCHMARKS.md's comparator.
    HostF64,
}

/// One step, for the progress bar.
#[derive(Debug, Clone, Serialize)]
pub struct StepLog {
    /// Step index.
    pub step: usize,
    /// Mean cross-entropy over the global batch (nats per byte).
    pub loss: f64,
    /// Auxiliary losses (load balancing and z-loss, all layers).
    pub aux: f64,
    /// Tokens per second over all ranks.
    pub tokens_per_s: f64,
    /// Partitions the first MoE layer used.
    pub n_partitions: usize,
    /// Strategy the first MoE layer used.
    pub strategy: Strategy,
    /// Latest validation loss, if any.
    pub val_loss: Option<f64>,
    /// Per MoE layer: the most loaded expert's assignments over the mean, this step.
    pub imbalance: Vec<f64>,
    /// Seconds this step's gradient sync took on this rank.
    pub sync_s: f64,
}

/// One rank's summary of a run.
#[derive(Debug, Clone, Serialize)]
pub struct TrainReport {
    /// Training loss of every step.
    pub losses: Vec<f64>,
    /// `(step, validation loss)`.
    pub val_losses: Vec<(usize, f64)>,
    /// Generated text.
    pub sample: String,
    /// Wall time, seconds.
    pub seconds: f64,
    /// Partitions and strategy of the last step (first MoE layer).
    pub n_partitions: usize,
    /// Strategy of the last step.
    pub strategy: Strategy,
    /// Per step, per MoE layer: assignments routed to each expert over the global batch.
    pub load: Vec<Vec<Vec<usize>>>,
    /// Per step: seconds this rank spent summing gradients over the ranks.
    pub sync_seconds: Vec<f64>,
}

/// Bytes `range` of every row as token ids. `[rows, range.len()]`
fn tokens<B: Backend>(
    rows: &[Vec<u8>],
    range: std::ops::Range<usize>,
    device: &B::Device,
) -> Tensor<B, 2, Int> {
    let values: Vec<i64> = rows
        .iter()
        .flat_map(|r| r[range.clone()].iter().map(|&b| b as i64))
        .collect();
    Tensor::from_data(
        TensorData::new(values, [rows.len(), range.len()]).convert::<B::IntElem>(),
        device,
    )
}

/// Trains this rank's replica; every rank must call it with the same options.
pub fn train_rank<B>(
    ctx: &RankContext,
    corpus: &Corpus,
    options: &TrainOptions,
    device: &B::Device,
    on_step: &(dyn Fn(&StepLog) + Sync),
) -> mpipemoe::Result<TrainReport>
where
    B: AutodiffBackend + MoeBackend,
    B::InnerBackend: MoeBackend,
{
    let o = options;
    let seq = o.model.seq_len;
    let moe = o
        .router
        .apply(o.model.moe())
        .with_partitions(o.partitions)
        .with_memory_reuse(o.memory_reuse)
        .with_memory_budget(o.memory_budget)
        .with_executor(o.executor)
        .with_shadowing(o.shadowing)
        .with_gemm_precision(o.gemm_precision);
    let groups = match o.expert_parallel {
        Some(ep) => ParallelGroups::new(ctx.comm.clone(), ep)?,
        None => ParallelGroups::expert_parallel(ctx.comm.clone()),
    };
    if o.grad_sync == GradSync::HostF64 && groups.data_parallel() > 1 {
        return Err(mpipemoe::MoeError::config(
            "grad_sync",
            "the host-f64 comparator sums replicated gradients only: it cannot run with data-parallel replicas of the experts",
        ));
    }
    let mut model = o.model.init::<B>(&moe, o.seed, device, &groups)?;
    let mut optimizer = AdamWConfig::new().with_weight_decay(0.01).init::<B, GptMoe<B>>();
    let mine = rank_range(o.batch, ctx.n_ranks, ctx.rank);
    let global_tokens = (o.batch * seq) as f64;
    let start = Instant::now();
    let mut losses = Vec::with_capacity(o.steps);
    let mut val_losses = Vec::new();
    let (mut n_partitions, mut strategy) = (1, Strategy::None);
    let mut load = Vec::with_capacity(o.steps);
    let mut sync_seconds = Vec::with_capacity(o.steps);

    // Validation and sampling run on the inner backend: no autodiff graph is recorded for
    // work that is never differentiated (burn's autodiff frees a graph only after a backward).
    let evaluate = |model: &GptMoe<B::InnerBackend>| -> mpipemoe::Result<f64> {
        let mut total = vec![0.0];
        for i in 0..o.eval_batches {
            let rows = corpus.val_batch(i, o.eval_batches, o.batch, seq);
            let rows = &rows[mine.clone()];
            let out = model.forward(tokens::<B::InnerBackend>(rows, 0..seq, device))?;
            let ce = cross_entropy_sum(out.logits, tokens::<B::InnerBackend>(rows, 1..seq + 1, device));
            total[0] += ce.into_scalar().into_f64_lossy();
        }
        ctx.comm.all_reduce_sum(&mut total)?;
        Ok(total[0] / (global_tokens * o.eval_batches as f64))
    };

    for step in 0..o.steps {
        let step_start = Instant::now();
        let rows = corpus.batch(o.seed, step, o.batch, seq);
        let rows = &rows[mine.clone()];
        let out = model.forward(tokens::<B>(rows, 0..seq, device))?;
        let ce = cross_entropy_sum(out.logits, tokens::<B>(rows, 1..seq + 1, device)) / global_tokens;
        let loss = ce.clone() + out.aux.clone();
        let mut logged = vec![
            ce.into_scalar().into_f64_lossy(),
            out.aux.into_scalar().into_f64_lossy(),
        ];
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        let sync_start = Instant::now();
        match o.grad_sync {
            GradSync::Library => {
                groups.sync_grads(&model, &mut grads)?;
            }
            GradSync::HostF64 => host_sync::all_reduce_replicated(&model, &mut grads, ctx.comm.as_ref())?,
        }
        let sync_s = sync_start.elapsed().as_secs_f64();
        sync_seconds.push(sync_s);
        model = optimizer.step(o.lr, model, grads);
        if let RouterChoice::DeepSeek { bias_update } = o.router {
            // Every rank has the same global load, so every replica moves its bias alike.
            model.balance_score_bias(&out.stats, bias_update)?;
        }
        load.push(
            out.stats
                .iter()
                .map(|s| s.routing.routed_per_expert.clone())
                .collect(),
        );
        ctx.comm.all_reduce_sum(&mut logged)?;
        losses.push(logged[0]);
        n_partitions = out.stats[0].n_partitions;
        strategy = out.stats[0].strategy;
        let last = step + 1 == o.steps;
        if (o.eval_every > 0 && (step + 1) % o.eval_every == 0) || last {
            val_losses.push((step + 1, evaluate(&model.valid())?));
        }
        on_step(&StepLog {
            step,
            loss: logged[0],
            aux: logged[1],
            tokens_per_s: global_tokens / step_start.elapsed().as_secs_f64(),
            n_partitions,
            strategy,
            val_loss: val_losses.last().map(|v| v.1),
            imbalance: out.stats.iter().map(|s| s.load_imbalance).collect(),
            sync_s,
        });
    }

    let sample = generate(&model.valid(), o, device)?;
    Ok(TrainReport {
        losses,
        val_losses,
        sample,
        seconds: start.elapsed().as_secs_f64(),
        n_partitions,
        strategy,
        load,
        sync_seconds,
    })
}

/// Samples `sample_len` bytes after a prompt, identically on every rank (same logits, same
/// seeded draws), so that the ranks' MoE collectives stay in step.
fn generate<B: Backend + MoeBackend>(
    model: &GptMoe<B>,
    o: &TrainOptions,
    device: &B::Device,
) -> mpipemoe::Result<String> {
    let seq = o.model.seq_len;
    let mut text: Vec<u8> = b"fn forward(".to_vec();
    let draws = seeded_uniform(o.seed, "sample", o.sample_len, 1.0);
    for &draw in &draws {
        let context: Vec<u8> = text[text.len().saturating_sub(seq)..].to_vec();
        let len = context.len();
        let out = model.forward(tokens::<B>(&[context], 0..len, device))?;
        let [_, _, vocab] = out.logits.dims();
        let last = out.logits.slice([0..1, len - 1..len, 0..vocab]).reshape([vocab]) / 0.8;
        let probs: Vec<f64> = burn::tensor::activation::softmax(last, 0)
            .into_data()
            .convert::<f64>()
            .into_vec()
            .expect("f64");
        let mut target = (draw as f64 + 1.0) / 2.0;
        let mut choice = vocab - 1;
        for (i, p) in probs.iter().enumerate() {
            if target < *p {
                choice = i;
                break;
            }
            target -= p;
        }
        text.push(choice as u8);
    }
    Ok(String::from_utf8_lossy(&text).into_owned())
}

/// f64 from a backend element.
trait IntoF64 {
    fn into_f64_lossy(self) -> f64;
}

impl<E: burn::tensor::ElementConversion> IntoF64 for E {
    fn into_f64_lossy(self) -> f64 {
        self.elem::<f64>()
    }
}
