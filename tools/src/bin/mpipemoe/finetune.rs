//! `mpipemoe finetune`: a whole Hugging Face MoE model fine-tuned on a text file with its
//! experts sharded over thread ranks, written back as a Hugging Face folder.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use burn::tensor::backend::AutodiffBackend;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use mpipemoe::comm::GroupOptions;
use mpipemoe::hf::{ExportOptions, HfCheckpoint};
use mpipemoe::{LocalGroup, LoraScaling, MoeBackend, MoeError};
use mpipemoe_models::family::decoder_config;
use mpipemoe_models::{
    finetune_rank, FinetuneOptions, FinetuneReport, FinetuneStep, LoraSpec, PeftAdapter, TextTokenizer,
};
use mpipemoe_tools::backends::{run_on, BackendJob};
use mpipemoe_tools::flags::{self, count, non_negative};
use serde::Serialize;

use crate::lm::RunFlags;

/// The largest `--data` file read (1 GiB of text is about 250 M tokens).
const MAX_DATA_BYTES: u64 = 1 << 30;

#[derive(Args, Debug)]
pub struct FinetuneArgs {
    /// A Hugging Face model folder (config.json, safetensors, tokenizer.json).
    dir: PathBuf,
    /// A UTF-8 text file to train on, tokenised with the folder's tokenizer.json.
    #[arg(long)]
    data: PathBuf,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100, value_parser = count(1, 1 << 30))]
    steps: usize,
    /// Where to write the trained model (a Hugging Face folder in DIR's layout): a new or empty
    /// folder apart from DIR (never DIR itself, a folder containing it or one inside it).
    #[arg(long, required_unless_present = "in_place")]
    out: Option<PathBuf>,
    /// Replace `--out` if it exists and is not empty (as a whole: files the new model lacks
    /// are gone). It never lets `--out` be DIR: that takes --in-place.
    #[arg(long)]
    overwrite: bool,
    /// Write the trained model over DIR itself. The new folder is built beside DIR and takes
    /// its place only once complete (unchanged files hard-linked), so a failed or interrupted
    /// run leaves DIR as it was.
    #[arg(long, conflicts_with = "out")]
    in_place: bool,
    /// Sequences per step over all ranks (a multiple of --ranks).
    #[arg(long, default_value_t = 4, value_parser = count(1, 1 << 16))]
    batch: usize,
    /// Tokens a sequence predicts.
    #[arg(long, default_value_t = 64, value_parser = count(1, 1 << 20))]
    seq_len: usize,
    /// AdamW's learning rate (finite, >= 0, as PyTorch's AdamW requires).
    #[arg(long, default_value_t = 1e-4, value_parser = non_negative)]
    lr: f64,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f32,
    /// Seeds the windows drawn from the data.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// The router load-balancing loss's weight (transformers' `router_aux_loss_coef`: one
    /// loss over every MoE layer's rows, as transformers computes it; default: none, as
    /// transformers adds none unless its config's `output_router_logits` is set).
    #[arg(long)]
    aux_loss_coef: Option<f64>,
    /// Every MoE layer's router z-loss weight (default: none).
    #[arg(long)]
    z_loss_coef: Option<f64>,
    /// Ranks per expert-parallel group (default: all); the groups are data-parallel replicas.
    #[arg(long, value_parser = count(1, 256))]
    expert_parallel: Option<usize>,
    /// DeepSeek-V3's auxiliary-loss-free balancing: after each step, move every MoE layer's
    /// score bias (`e_score_correction_bias`) by GAMMA towards balanced load (DeepSeek-V3
    /// pre-trained with 0.001). Default 0: the biases stay as loaded, as in transformers.
    #[arg(long, default_value_t = 0.0, value_name = "GAMMA", value_parser = non_negative)]
    bias_update_speed: f64,
    /// LoRA fine-tuning: adapters of rank R on `--lora-targets`, every base weight frozen (no
    /// gradient, no optimizer state); `--out` receives the adapters as a PEFT folder
    /// (`adapter_config.json`, `adapter_model.safetensors`) that `PeftModel.from_pretrained`
    /// loads, or the merged model with `--merge`.
    #[arg(long, value_parser = count(1, 1 << 16), conflicts_with = "adapter")]
    lora_rank: Option<usize>,
    /// PEFT's `lora_alpha`: the adapters' products are scaled by alpha / R (alpha / sqrt(R)
    /// with `--rslora`).
    #[arg(long, default_value_t = 8.0, requires = "lora_rank")]
    lora_alpha: f64,
    /// rsLoRA's scaling, alpha / sqrt(R).
    #[arg(long, requires = "lora_rank")]
    rslora: bool,
    /// What gets adapters, comma-separated: attention projections by name (`q_proj`,
    /// `k_proj`, `v_proj`, `o_proj`; DeepSeek-V3's `q_a_proj`, `q_b_proj`,
    /// `kv_a_proj_with_mqa`, `kv_b_proj`), `attention` for all a layer has, `experts` (one
    /// adapter per expert on both stacked weights) or `gate_up_proj` / `down_proj` alone.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = flags::name,
        default_value = "attention,experts",
        requires = "lora_rank"
    )]
    lora_targets: Vec<String>,
    /// PEFT's `lora_dropout`: the probability that an attention adapter's input value is
    /// zeroed in training, in [0, 1). PEFT refuses it with expert targets, and so does this
    /// (`--lora-targets attention` or names of projections alone).
    #[arg(long, default_value_t = 0.0, requires = "lora_rank")]
    lora_dropout: f64,
    /// Continue training a LoRA adapter folder written by PEFT (or by `--lora-rank`).
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// With adapters: write the merged model to `--out` in DIR's layout and dtype instead of
    /// the adapter folder.
    #[arg(long)]
    merge: bool,
    /// Print a JSON summary on stdout at the end.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    run: RunFlags,
}

impl FinetuneArgs {
    /// Where the trained model goes: `--out`, or DIR itself with `--in-place`.
    fn out_dir(&self) -> &Path {
        self.out.as_deref().unwrap_or(&self.dir)
    }
}

/// What `--json` prints.
#[derive(Serialize)]
struct Summary {
    steps: usize,
    ranks: usize,
    tokens: usize,
    data_tokens: usize,
    initial_loss: f64,
    final_loss: f64,
    seconds: f64,
    tokens_per_s: f64,
    /// The median step's time after the first two (kernel and allocator warm-up), or of all
    /// steps when there are three or fewer.
    median_step_s: f64,
    /// Every step's time and loss.
    step_seconds: Vec<f64>,
    losses: Vec<f64>,
    out: String,
}

struct FinetuneJob<'a> {
    args: &'a FinetuneArgs,
    tokens: &'a [u32],
    options: FinetuneOptions,
    bar: &'a ProgressBar,
}

impl BackendJob for FinetuneJob<'_> {
    type Output = mpipemoe::Result<FinetuneReport>;

    fn run<B>(self, _device: &B::Device) -> Self::Output
    where
        B: AutodiffBackend + MoeBackend,
        B::InnerBackend: MoeBackend,
    {
        let args = self.args;
        let export = ExportOptions {
            overwrite: args.overwrite,
            in_place: args.in_place,
        };
        let out = args.out_dir();
        // indicatif draws nothing when stderr is not a terminal (a log file, a batch job), so
        // there a plain line goes out at the first steps and about twenty times over the run.
        let plain = !std::io::stderr().is_terminal();
        let plain_every = (args.steps / 20).max(1);
        let on_step = |log: &FinetuneStep| {
            self.bar.set_position(log.step as u64 + 1);
            self.bar.set_message(format!(
                "loss {:.3} aux {:.4} | {:.0} tok/s",
                log.loss, log.aux, log.tokens_per_s
            ));
            if plain && (log.step < 3 || (log.step + 1).is_multiple_of(plain_every)) {
                eprintln!(
                    "[{:7.1} s] step {}/{} loss {:.3} aux {:.4} | {:.0} tok/s",
                    self.bar.elapsed().as_secs_f64(),
                    log.step + 1,
                    args.steps,
                    log.loss,
                    log.aux,
                    log.tokens_per_s
                );
            }
        };
        let paths = args.run.paths()?;
        // Each rank on a pool of its own (`GroupOptions::pool_per_rank`): its parallel regions
        // then start from one of the pool's workers.
        let options = GroupOptions::pool_per_rank(args.run.ranks);
        let reports = LocalGroup::run_with(options, args.run.ranks, |ctx| {
            let device = Default::default();
            let quiet = |_: &FinetuneStep| {};
            let log: &dyn Fn(&FinetuneStep) = if ctx.rank == 0 { &on_step } else { &quiet };
            let (_, report) = finetune_rank::<B>(
                paths(ctx.comm),
                &args.dir,
                self.tokens,
                &self.options,
                &|c| {
                    let c = args.run.moe(c);
                    let c = match args.aux_loss_coef {
                        Some(coef) => c.with_aux_loss_coef(coef),
                        None => c,
                    };
                    match args.z_loss_coef {
                        Some(coef) => c.with_z_loss_coef(coef),
                        None => c,
                    }
                },
                Some((out, &export)),
                &device,
                log,
            )?;
            Ok(report)
        })?;
        Ok(reports.into_iter().next().expect("at least one rank"))
    }
}

/// The folder's tokenizer (required) and the data file's tokens.
fn tokens(args: &FinetuneArgs) -> Result<Vec<u32>, MoeError> {
    let ckpt = HfCheckpoint::open(&args.dir)?;
    let vocab = decoder_config(&ckpt)?.vocab_size;
    let tokenizer = TextTokenizer::from_dir(&args.dir, vocab)?.ok_or_else(|| {
        MoeError::file(
            args.dir.join(TextTokenizer::FILE),
            "finetune tokenises --data with the folder's tokenizer, and there is none",
        )
    })?;
    let text = read_text(&args.data)?;
    let ids = tokenizer.encode(&text, false)?;
    // Every id is under the vocabulary (checked by `encode`), which fits u32 in any
    // published model.
    ids.into_iter()
        .map(|id| u32::try_from(id).map_err(|_| MoeError::Input(format!("token id {id} is too large"))))
        .collect()
}

fn read_text(path: &Path) -> Result<String, MoeError> {
    let bytes = mpipemoe::files::read_bounded(path, MAX_DATA_BYTES)?;
    String::from_utf8(bytes).map_err(|e| MoeError::file(path, format!("not UTF-8 text: {e}")))
}

fn median_after_warm_up(seconds: &[f64]) -> f64 {
    let skip = if seconds.len() > 3 { 2 } else { 0 };
    let mut steady = seconds[skip..].to_vec();
    steady.sort_by(f64::total_cmp);
    match steady.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => steady[n / 2],
        n => 0.5 * (steady[n / 2 - 1] + steady[n / 2]),
    }
}

/// The adapters' spec the flags give, if they ask for fresh adapters.
fn lora_spec(args: &FinetuneArgs) -> Option<LoraSpec> {
    args.lora_rank.map(|rank| LoraSpec {
        rank,
        alpha: args.lora_alpha,
        scaling: if args.rslora {
            LoraScaling::RsLora
        } else {
            LoraScaling::Standard
        },
        targets: args.lora_targets.clone(),
        dropout: args.lora_dropout,
    })
}

/// An error of [`FinetuneOptions::validate`] as a usage error: the flag that gave the field,
/// with its value, and the reason.
fn usage_error(e: MoeError, args: &FinetuneArgs) -> String {
    let MoeError::Config { field, reason } = e else {
        return e.to_string();
    };
    let ranks = args.run.ranks;
    let flag = match field {
        "steps" => format!("--steps {}", args.steps),
        "batch" => format!("--batch {} (--ranks {ranks})", args.batch),
        "seq_len" => format!("--seq-len {}", args.seq_len),
        "lr" => format!("--lr {}", args.lr),
        "weight_decay" => format!("--weight-decay {}", args.weight_decay),
        "expert_parallel" => format!(
            "--expert-parallel {} (--ranks {ranks})",
            args.expert_parallel.unwrap_or(ranks)
        ),
        "rank" => "--lora-rank".into(),
        "alpha" => "--lora-alpha".into(),
        "targets" => "--lora-targets".into(),
        "lora_dropout" => "--lora-dropout".into(),
        "merge" => "--merge".into(),
        other => format!("`{other}`"),
    };
    format!("{flag}: {reason}")
}

pub fn run(args: FinetuneArgs) -> ExitCode {
    if let Err(message) = args.run.backend.available() {
        eprintln!("error: {message}");
        return ExitCode::from(2);
    }
    // The training text is an input too: an --out that is it, or a folder holding it, would
    // replace or delete it.
    if let Err(e) = mpipemoe::files::check_apart(&args.data, args.out_dir(), "--out") {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let adapters = args.lora_rank.is_some() || args.adapter.is_some();
    if args.in_place && adapters && !args.merge {
        eprintln!("error: --in-place with adapters writes the merged model over DIR: add --merge, or give --out for the adapter folder");
        return ExitCode::from(2);
    }
    let adapter = match args.adapter.as_deref().map(PeftAdapter::read).transpose() {
        Ok(adapter) => adapter,
        Err(e) => {
            eprintln!("error: --adapter: {e}");
            return ExitCode::FAILURE;
        }
    };
    let options = FinetuneOptions {
        steps: args.steps,
        batch: args.batch,
        seq_len: args.seq_len,
        lr: args.lr,
        weight_decay: args.weight_decay,
        epsilon: 1e-8,
        seed: args.seed,
        expert_parallel: args.expert_parallel,
        bias_update_speed: args.bias_update_speed,
        lora: lora_spec(&args),
        adapter,
        merge: args.merge,
        // On the CPU backends every rank's step lives in this process's memory: each gets its
        // share of what the machine has available, and a step whose attention weights alone
        // exceed it is refused before the first step rather than ended by a failed allocation.
        host_bytes: args.run.backend.host_bytes_per_rank(args.run.ranks),
    };
    // The options' own checks before the model or the data is read: a mistake in them is a
    // usage error naming the flag.
    if let Err(e) = options.validate(args.run.ranks) {
        eprintln!("error: {}", usage_error(e, &args));
        return ExitCode::from(2);
    }
    let tokens = match tokens(&args) {
        Ok(tokens) => tokens,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    eprintln!(
        "data: {} ({} tokens); {} ranks, expert-parallel {}, batch {} x {} tokens",
        args.data.display(),
        tokens.len(),
        args.run.ranks,
        args.expert_parallel.unwrap_or(args.run.ranks),
        args.batch,
        args.seq_len
    );
    let bar = ProgressBar::new(args.steps as u64);
    if let Ok(style) = ProgressStyle::with_template("{elapsed_precise} [{bar:25}] {pos}/{len} {msg}") {
        bar.set_style(style);
    }
    let job = FinetuneJob {
        args: &args,
        tokens: &tokens,
        options,
        bar: &bar,
    };
    let report = match run_on(args.run.backend, job) {
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(2);
        }
        Ok(Err(e)) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
        Ok(Ok(report)) => report,
    };
    bar.finish();
    let initial = report.losses.first().copied().unwrap_or(f64::NAN);
    // The last few steps' mean: one batch's loss is noisy.
    let tail = &report.losses[report.losses.len().saturating_sub(10)..];
    let last = tail.iter().sum::<f64>() / tail.len().max(1) as f64;
    let tokens_per_s = report.tokens as f64 / report.seconds;
    eprintln!(
        "trained {} steps in {:.1} s ({tokens_per_s:.0} tokens/s): loss {initial:.3} -> {last:.3} (mean of the last {}); written to {}",
        args.steps,
        report.seconds,
        tail.len(),
        args.out_dir().display()
    );
    if args.json {
        let summary = Summary {
            steps: args.steps,
            ranks: args.run.ranks,
            tokens: report.tokens,
            data_tokens: tokens.len(),
            initial_loss: initial,
            final_loss: last,
            seconds: report.seconds,
            tokens_per_s,
            median_step_s: median_after_warm_up(&report.step_seconds),
            step_seconds: report.step_seconds.clone(),
            losses: report.losses.clone(),
            out: args.out_dir().display().to_string(),
        };
        match serde_json::to_string(&summary) {
            Ok(line) => println!("{line}"),
            Err(e) => eprintln!("error: summary: {e}"),
        }
    }
    ExitCode::SUCCESS
}
