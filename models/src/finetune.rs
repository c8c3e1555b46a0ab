//! Fine-tuning a whole model on a token stream, with its experts sharded over ranks (and the
//! expert-parallel groups replicated for data parallelism), then saving it as a Hugging Face
//! folder.
//!
//! Each step draws `batch` windows of `seq_len + 1` tokens from the stream (the same windows
//! on every rank, from the seed and the step), each rank takes its share of the rows, and the
//! loss is the mean next-token cross-entropy over the whole batch plus the MoE layers'
//! auxiliary and z-losses, each rank's share weighted by its share of the rows. The
//! gradients of the replicated parameters are summed over every rank and those of the experts
//! over their data-parallel replicas ([`ParallelGroups::sync_grads`]), so every rank takes the
//! same AdamW step and a model trained at any rank count equals the one trained at one rank
//! on the same batch, up to float rounding.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use mpipemoe::hf::ExportOptions;
use mpipemoe::optim::AdamWConfig;
use mpipemoe::parallel::ParallelGroups;
use mpipemoe::{Communicator, MoeBackend, MoeError, MoeLayerConfig, Result};

use crate::host_memory::{attention_weights_bytes, check_host_bytes};
use crate::lora::LoraSpec;
use crate::model::MoeCausalLm;
use crate::peft_config::PeftAdapter;

/// How to fine-tune. Every rank must pass the same options.
#[derive(Debug, Clone)]
pub struct FinetuneOptions {
    /// Optimizer steps.
    pub steps: usize,
    /// Sequences per step over all ranks (a multiple of the rank count).
    pub batch: usize,
    /// Tokens a sequence predicts (each window holds one more).
    pub seq_len: usize,
    /// AdamW's learning rate.
    pub lr: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f32,
    /// AdamW's epsilon (PyTorch's and transformers' default 1e-8; burn's own default is
    /// 1e-5, which damps the updates of parameters with small gradients).
    pub epsilon: f32,
    /// Seeds the windows drawn from the stream.
    pub seed: u64,
    /// Ranks per expert-parallel group (`None`: all of them); the groups are data-parallel
    /// replicas of each other.
    pub expert_parallel: Option<usize>,
    /// DeepSeek-V3's bias update speed `gamma`: after each step every MoE layer with a score
    /// bias moves it by `gamma · sign(mean_load − load[e])` from the step's load over the
    /// whole batch (DeepSeek-V3 pre-trained with 0.001). `0` (the default) leaves the biases
    /// as loaded, as transformers' training does (it holds them as a buffer).
    pub bias_update_speed: f64,
    /// LoRA fine-tuning with fresh adapters ([`MoeCausalLm::with_lora`]): every base weight
    /// frozen, the adapters alone trained; `out` then receives the adapters as a PEFT folder
    /// (or the merged model, with `merge`).
    pub lora: Option<LoraSpec>,
    /// LoRA fine-tuning that continues from a PEFT adapter (over `lora`).
    pub adapter: Option<PeftAdapter>,
    /// With adapters: write the merged model to `out` in the folder's own layout, not the
    /// adapter.
    pub merge: bool,
    /// Host bytes this rank's step may hold, where its tensors live in host memory (the CPU
    /// backends; the caller's share of what the machine has available): a step whose
    /// attention weights alone exceed it is refused before the model trains
    /// ([`attention_weights_bytes`](crate::attention_weights_bytes)). `None` checks nothing (a
    /// device's memory is its own).
    pub host_bytes: Option<u64>,
}

impl Default for FinetuneOptions {
    fn default() -> Self {
        Self {
            steps: 100,
            batch: 4,
            seq_len: 64,
            lr: 1e-4,
            weight_decay: 0.0,
            epsilon: 1e-8,
            seed: 0,
            expert_parallel: None,
            bias_update_speed: 0.0,
            lora: None,
            adapter: None,
            merge: false,
            host_bytes: None,
        }
    }
}

impl FinetuneOptions {
    /// The adapters' spec this run trains with, if it trains adapters.
    fn lora_spec(&self) -> Option<&LoraSpec> {
        self.adapter.as_ref().map(|a| &a.spec).or(self.lora.as_ref())
    }

    /// The options' own checks, which need neither the model nor the data, for a world of
    /// `n_ranks`: [`finetune_rank`] runs them first, and a caller may run them before it
    /// reads either (the `mpipemoe` tool, for its usage errors).
    ///
    /// # Errors
    /// [`MoeError::Config`] naming the field: `steps`, `batch` or `seq_len` of 0; `lr`,
    /// `weight_decay` or `epsilon` not a finite number >= 0; a `batch` that does not split
    /// evenly over the ranks; an `expert_parallel` that does not divide them; what
    /// [`LoraSpec::validate`] refuses of `lora`; `merge` without adapters.
    pub fn validate(&self, n_ranks: usize) -> Result<()> {
        for (field, value) in [
            ("steps", self.steps),
            ("batch", self.batch),
            ("seq_len", self.seq_len),
        ] {
            if value == 0 {
                return Err(MoeError::config(field, "must be at least 1"));
            }
        }
        // PyTorch's AdamW refuses these too (`Invalid learning rate`, ...): NaN trains a model
        // of NaNs, and a negative rate trains uphill, both without a word.
        for (field, value) in [
            ("lr", self.lr),
            ("weight_decay", f64::from(self.weight_decay)),
            ("epsilon", f64::from(self.epsilon)),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(MoeError::config(
                    field,
                    format!("is {value}: a finite number >= 0"),
                ));
            }
        }
        if n_ranks == 0 || !self.batch.is_multiple_of(n_ranks) {
            return Err(MoeError::config(
                "batch",
                format!(
                    "{} sequences do not split evenly over {n_ranks} ranks",
                    self.batch
                ),
            ));
        }
        if let Some(ep) = self.expert_parallel {
            ParallelGroups::check_sizes(n_ranks, ep)?;
        }
        if let Some(spec) = &self.lora {
            spec.validate()?;
        }
        if self.merge && self.lora_spec().is_none() {
            return Err(MoeError::config(
                "merge",
                "needs adapters (lora or adapter) to merge",
            ));
        }
        Ok(())
    }
}

/// What one step did, the same on every rank.
#[derive(Debug, Clone)]
pub struct FinetuneStep {
    /// The step's index (from 0).
    pub step: usize,
    /// Mean next-token cross-entropy of the batch (nats).
    pub loss: f64,
    /// The MoE layers' auxiliary and z-losses, as added to the loss.
    pub aux: f64,
    /// Tokens of the whole batch over the step's wall time.
    pub tokens_per_s: f64,
}

/// The whole run, the same on every rank.
#[derive(Debug, Clone)]
pub struct FinetuneReport {
    /// Each step's cross-entropy.
    pub losses: Vec<f64>,
    /// Each step's wall time (seconds).
    pub step_seconds: Vec<f64>,
    /// Wall time of the steps (loading and saving excluded).
    pub seconds: f64,
    /// Tokens predicted over the run (all ranks).
    pub tokens: usize,
}

/// Fine-tunes the model of the Hugging Face folder `dir` on `tokens` (every rank the same
/// stream), calling `on_step` after each step, and, with `out`, saves it there as a Hugging
/// Face folder in `dir`'s layout (other files, the tokenizer among them, copied). A collective:
/// every rank of `world` calls it with the same arguments. `moe` adjusts every MoE layer's
/// configuration (partitions, memory reuse, executor). Returns this rank's trained model.
///
/// # Errors
/// [`MoeError::Config`] naming `steps`, `batch`, `seq_len` or `expert_parallel` if it is 0,
/// the batch does not split over the ranks or the groups do not divide them;
/// [`MoeError::Input`] if the stream is shorter than one window or holds an id outside the
/// vocabulary; [`MoeError::File`] naming `out` if it exists, is not empty and `overwrite` is
/// off (checked before the first step); the errors of loading and saving
/// ([`MoeCausalLm::from_hf`], [`MoeCausalLm::save_hf`]); [`MoeError::Comm`] if a peer fails.
#[allow(clippy::too_many_arguments)]
pub fn finetune_rank<B>(
    world: Arc<dyn Communicator>,
    dir: &Path,
    tokens: &[u32],
    options: &FinetuneOptions,
    moe: &dyn Fn(MoeLayerConfig) -> MoeLayerConfig,
    out: Option<(&Path, &ExportOptions)>,
    device: &B::Device,
    on_step: &dyn Fn(&FinetuneStep),
) -> Result<(MoeCausalLm<B>, FinetuneReport)>
where
    B: AutodiffBackend + MoeBackend,
    B::InnerBackend: MoeBackend,
{
    let o = options;
    let n_ranks = world.n_ranks();
    o.validate(n_ranks)?;
    if tokens.len() <= o.seq_len {
        return Err(MoeError::Input(format!(
            "the data holds {} tokens, fewer than one window of seq_len + 1 = {}",
            tokens.len(),
            o.seq_len + 1
        )));
    }
    if let Some((path, export)) = out {
        mpipemoe::hf::check_out_dir(dir, path, export)?;
    }
    let groups = match o.expert_parallel {
        Some(ep) => ParallelGroups::new(world.clone(), ep)?,
        None => ParallelGroups::expert_parallel(world.clone()),
    };
    let model = MoeCausalLm::<B>::from_hf(dir, device, groups.expert().clone())?;
    let vocab = model.config().vocab_size;
    // Each window is seq_len + 1 tokens: refused here if the model has fewer positions,
    // rather than in the first step.
    model.check_ids(&[0], o.seq_len)?;
    // Every rank decides alike: the same options, the same model, the same share of rows.
    let elem = std::mem::size_of::<B::FloatElem>();
    let floor = attention_weights_bytes(model.config(), o.batch / n_ranks, o.seq_len, elem);
    check_host_bytes(floor, o.host_bytes, || {
        format!(
            "a step of batch {} × seq_len {}, in the attention weights each rank keeps for its backward ({} layers × {} rows × {} heads × {}² values),",
            o.batch,
            o.seq_len,
            model.config().layers.len(),
            o.batch / n_ranks,
            model.config().n_heads,
            o.seq_len
        )
    })?;
    // Ranks load their checkpoints at different speeds (another disk, another node): they
    // meet here under the arrival bound, not the first step's transfer timeout.
    world.arrival_barrier()?;
    if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(MoeError::Input(format!(
            "the data holds token id {bad}, outside the model's vocabulary of {vocab}"
        )));
    }
    let model = model.map_moe_configs(moe)?;
    // With adapters the base is frozen: it takes no gradient and the optimizer no state for
    // it; the adapters of each rank's experts are that rank's, synchronised as experts.
    let mut model = match (&o.adapter, &o.lora) {
        (Some(adapter), _) => model.with_adapter(adapter)?,
        (None, Some(spec)) => model.with_lora(spec, o.seed)?,
        (None, None) => model,
    };
    // Adapter dropout draws from the backend's random stream: seeded from the run's seed and
    // the rank, so that a run repeats its masks (each rank its own, as its rows are its own).
    if o.lora_spec().is_some_and(|s| s.dropout > 0.0) {
        B::seed(
            device,
            o.seed ^ (world.rank() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
    }
    // The replicas' routing statistics summed, so that the losses and the loads are the
    // world's batch's, as each layer built with `init_groups` would have them.
    model.set_replicas(groups.expert_data());
    let gamma = o.bias_update_speed;
    if gamma != 0.0 {
        if !(gamma.is_finite() && gamma > 0.0) {
            return Err(MoeError::config(
                "bias_update_speed",
                format!("is {gamma}: a finite number > 0, or 0 to leave the biases"),
            ));
        }
        if !model.moe_layers().any(|(_, m)| m.config().score_bias) {
            return Err(MoeError::config(
                "bias_update_speed",
                "the model has no MoE layer with a score bias to balance (DeepSeek-V3's \
                 e_score_correction_bias)",
            ));
        }
    }
    let mut optimizer = AdamWConfig::new()
        .with_weight_decay(o.weight_decay)
        .with_epsilon(o.epsilon)
        .init::<B, MoeCausalLm<B>>();
    let rows = o.batch / n_ranks;
    let mine = world.rank() * rows..(world.rank() + 1) * rows;
    // Each rank's loss is the mean over its rows; weighted by its share of the batch, the
    // ranks' losses (and their gradients, summed by the sync) make the batch's mean.
    let share = 1.0 / n_ranks as f32;
    let global_tokens = o.batch * o.seq_len;
    let mut losses = Vec::with_capacity(o.steps);
    let mut step_seconds = Vec::with_capacity(o.steps);
    let start = Instant::now();
    for step in 0..o.steps {
        let step_start = Instant::now();
        let starts = window_starts(o.seed, step, o.batch, tokens.len() - o.seq_len);
        let ids: Vec<i64> = starts[mine.clone()]
            .iter()
            .flat_map(|&s| tokens[s..s + o.seq_len + 1].iter().map(|&t| i64::from(t)))
            .collect();
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [rows, o.seq_len + 1]), device);
        let (ce, out) = model.loss(ids).map_err(|e| match e {
            // The ids were checked up front, so after an update only the weights can have
            // put a NaN in the activations the layers check: the run diverged.
            MoeError::Input(reason) if step > 0 => MoeError::Input(format!(
                "step {step}: {reason}: the weights are no longer finite after {step} update(s) \
                 (training diverged: a learning rate too high?); nothing was saved"
            )),
            e => e,
        })?;
        let routed = out.routed_per_expert;
        let aux = out.aux_loss + out.z_loss;
        let mut logged = vec![
            ce.clone().into_scalar().elem::<f64>() * f64::from(share),
            aux.clone().into_scalar().elem::<f64>() * f64::from(share),
        ];
        let loss = (ce + aux) * share;
        let mut grads = GradientsParams::from_grads(loss.backward(), &model);
        groups.sync_grads(&model, &mut grads)?;
        model = optimizer.step(o.lr, model, grads);
        if gamma > 0.0 {
            model.balance_score_biases(&routed, gamma)?;
        }
        world.all_reduce_sum(&mut logged)?;
        // Every rank sees the same reduced loss, so all stop together; nothing is saved
        // from a model that diverged.
        if !logged[0].is_finite() {
            return Err(MoeError::Input(format!(
                "the loss is {} at step {step}: training diverged (a learning rate too high?); \
                 nothing was saved",
                logged[0]
            )));
        }
        losses.push(logged[0]);
        let seconds = step_start.elapsed().as_secs_f64();
        step_seconds.push(seconds);
        on_step(&FinetuneStep {
            step,
            loss: logged[0],
            aux: logged[1],
            tokens_per_s: global_tokens as f64 / seconds,
        });
    }
    // The optimizer's two moments are twice the weights' size, and nothing after the last
    // step reads them: freed before the model is gathered and written, they leave that room
    // to the export's copies instead of adding to them at the run's peak.
    drop(optimizer);
    let report = FinetuneReport {
        losses,
        step_seconds,
        seconds: start.elapsed().as_secs_f64(),
        tokens: global_tokens * o.steps,
    };
    if let Some((path, export)) = out {
        // One data-parallel replica writes; its ranks gather their experts for its rank 0.
        if groups.expert_data().rank() == 0 {
            match o.lora_spec() {
                Some(_) if o.merge => {
                    model.clone().merge_lora().save_hf(dir, path, export)?;
                }
                Some(spec) => model.save_adapter(spec, dir, path)?,
                None => {
                    model.save_hf(dir, path, export)?;
                }
            }
        }
        // No rank returns before the folder is written, so a caller that reads it after
        // this call (any rank) finds it complete. An arrival wait: the other ranks wait here
        // for as long as rank 0 takes to write the whole model, which may be far longer
        // than a transfer's timeout.
        world.arrival_barrier()?;
    }
    Ok((model, report))
}

/// Where the `batch` windows of `step` start in a stream with `span` possible starts: a
/// SplitMix64 sequence of the seed, the step and the row, the same on every rank.
pub fn window_starts(seed: u64, step: usize, batch: usize, span: usize) -> Vec<usize> {
    (0..batch)
        .map(|row| {
            let z = seed
                .wrapping_add((step as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
                .wrapping_add((row as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
            (mpipemoe::rng::mix64(z) % span as u64) as usize
        })
        .collect()
}
