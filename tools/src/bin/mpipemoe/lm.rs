//! `mpipemoe logits` and `mpipemoe generate`: a whole Hugging Face MoE model
//! (`mpipemoe-models`) on the chosen backend, at one rank or with its experts sharded over
//! thread ranks.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use clap::Args;
use mpipemoe::comm::GroupOptions;
use mpipemoe::format::TensorMap;
use mpipemoe::memory::Strategy;
use mpipemoe::{LocalGroup, MemoryReuse, MoeBackend, MoeError, MoeLayerConfig, Partitions, MAX_PARTITIONS};
use mpipemoe_models::{
    check_host_bytes, forward_floor_bytes, GenerateOptions, GenerationDefaults, MoeCausalLm, PeftAdapter,
    Sampling, TextTokenizer,
};
use mpipemoe_tools::backends::{
    device_paths, run_on, AddPaths, BackendArg, BackendJob, GemmArg, PrecisionArg,
};
use mpipemoe_tools::flags::{self, count, mass, may_write, positive};

use crate::check::StrategyArg;

/// How the model runs: backend, ranks and the MoE layers' exchange.
#[derive(Args, Debug, Clone)]
pub struct RunFlags {
    /// Backend (`wgpu` needs the tool built with `--features wgpu`).
    #[arg(long, value_enum, default_value_t = BackendArg::Flex)]
    pub(crate) backend: BackendArg,
    /// Expert-parallel ranks (threads, 1..=256): every MoE layer's experts are sharded over
    /// them; each rank runs the same tokens and rank 0 reports.
    #[arg(long, default_value_t = 1, value_parser = count(1, 256))]
    pub(crate) ranks: usize,
    /// Partitions of every MoE layer's exchange (the paper's n).
    #[arg(long, default_value_t = 1, value_parser = count(1, MAX_PARTITIONS))]
    pub(crate) partitions: usize,
    /// Memory-reuse strategy of every MoE layer.
    #[arg(long, value_enum, default_value_t = StrategyArg::None)]
    pub(crate) strategy: StrategyArg,
    /// The MoE layers' GEMM precision on the CUDA backends (with `--gemm cublas`): `f32`,
    /// `tf32` or `bf16`, f32 accumulation in all three.
    #[arg(long, value_enum, default_value_t = PrecisionArg::F32)]
    pub(crate) gemm_precision: PrecisionArg,
    /// Which library runs the MoE layers' GEMMs on the CUDA backends: `cublas` or `cubecl`.
    #[arg(long, value_enum, default_value_t = GemmArg::Cublas)]
    pub(crate) gemm: GemmArg,
    /// Issue each MoE layer's shared expert while its routing read is in flight (a GPU runs
    /// it while the host waits and plans), for what it keeps live through the exchange;
    /// layers without a shared expert are unchanged.
    #[arg(long)]
    pub(crate) shared_expert_overlap: bool,
}

impl RunFlags {
    /// Every MoE layer's configuration with these flags' partitions, strategy, precision and
    /// shared-expert overlap (where the layer has a shared expert).
    pub(crate) fn moe(&self, config: MoeLayerConfig) -> MoeLayerConfig {
        let overlap = self.shared_expert_overlap && config.shared_expert.is_some();
        config
            .with_partitions(Partitions::Fixed(self.partitions))
            .with_memory_reuse(MemoryReuse::from(self.strategy.strategy()))
            .with_gemm_precision(self.gemm_precision.precision())
            .with_shared_expert_overlap(overlap)
    }

    /// The communicator wrapper that adds the device library these flags ask for (cuBLAS on
    /// the CUDA backends, one for every rank thread on GPU 0).
    pub(crate) fn paths(&self) -> mpipemoe::Result<AddPaths> {
        device_paths(self.backend, self.gemm, 0).map_err(MoeError::Backend)
    }
}

#[derive(Args, Debug)]
pub struct LogitsArgs {
    /// A Hugging Face model folder (config.json, safetensors).
    dir: PathBuf,
    /// Token ids, comma-separated (e.g. `1,5,9`).
    #[arg(long, required = true, value_delimiter = ',', value_parser = flags::token_id)]
    ids: Vec<usize>,
    /// Where to write the logits: a safetensors file with `logits` `[T, vocab]` in f32.
    #[arg(long)]
    out: PathBuf,
    /// Replace `--out` if it exists.
    #[arg(long)]
    overwrite: bool,
    /// A LoRA adapter folder written by PEFT (`adapter_config.json`,
    /// `adapter_model.safetensors`) to run the model with. DIR is the base, whatever the
    /// adapter's `base_model_name_or_path` says, as in PEFT.
    #[arg(long)]
    adapter: Option<PathBuf>,
    #[command(flatten)]
    run: RunFlags,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// A Hugging Face model folder (config.json, safetensors).
    dir: PathBuf,
    /// The prompt's token ids, comma-separated (e.g. `1,5,9`).
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = flags::token_id,
        required_unless_present_any = ["prompt", "prompts_file", "ids_file"],
        conflicts_with_all = ["prompt", "prompts_file", "ids_file"]
    )]
    ids: Vec<usize>,
    /// The prompt as text, encoded with the folder's `tokenizer.json` (special tokens added as
    /// the tokenizer's template says, as transformers' `tokenizer(text)` does).
    #[arg(long, conflicts_with_all = ["prompts_file", "ids_file"])]
    prompt: Option<String>,
    /// Several prompts in one batch: a text file with one prompt per line, each encoded as
    /// `--prompt` is. The prompts are left-padded to the longest, as transformers pads them
    /// for batched generation, and each gets its own continuation. Prints one JSON object per
    /// prompt and line, in the file's order: `{"ids": [...], "text": "..."}`.
    #[arg(long, conflicts_with = "ids_file")]
    prompts_file: Option<PathBuf>,
    /// As `--prompts-file`, each line a prompt's token ids, comma-separated.
    #[arg(long)]
    ids_file: Option<PathBuf>,
    /// Most new tokens (fewer if a stop id comes: `generation_config.json`'s `eos_token_id`
    /// where the folder has one, else `config.json`'s).
    #[arg(long, default_value_t = 32, value_parser = count(0, 1 << 20))]
    max_new_tokens: usize,
    /// Sample at this temperature (turns sampling on). Without any sampling flag the
    /// folder's `generation_config.json` decides, as in transformers: sampling with its
    /// settings where it says `do_sample`, greedy otherwise.
    #[arg(long, value_parser = positive, conflicts_with = "greedy")]
    temperature: Option<f64>,
    /// Sample from the K most likely tokens (turns sampling on).
    #[arg(long, value_parser = count(1, 1 << 24), conflicts_with = "greedy")]
    top_k: Option<usize>,
    /// Sample from the most likely tokens whose probabilities sum past P (turns sampling on).
    #[arg(long, value_parser = mass, conflicts_with = "greedy")]
    top_p: Option<f64>,
    /// Seeds the draws when sampling: the same seed gives the same ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Greedy decoding, whatever `generation_config.json` says.
    #[arg(long)]
    greedy: bool,
    /// Load the weights onto transparent huge pages (2 MiB; with `--heap keep`, the default
    /// heap): each decode step reads every weight anew, and with 4 KiB pages it walks a page
    /// translation for every 4 KiB of them (1.04× the tokens/s on this project's VM). Loading
    /// can take longer where the kernel must compact memory to find huge pages.
    #[arg(long)]
    huge_pages: bool,
    /// Generate this many times in the one process and report each run's time: on a GPU the
    /// first run also compiles and tunes the kernels, so a benchmark times the later ones. The
    /// answer is the last run's. Every run starts afresh (sampling from `--seed` again), so
    /// each picks the same ids unless the backend's arithmetic changed between calls, which
    /// is noted.
    #[arg(long, default_value_t = 1, value_parser = count(1, 100))]
    repeats: usize,
    /// A LoRA adapter folder written by PEFT (`adapter_config.json`,
    /// `adapter_model.safetensors`) to run the model with, merged into its weights for
    /// generation (PEFT's `merge_and_unload`: the same function up to float rounding). DIR is the base, whatever the
    /// adapter's `base_model_name_or_path` says, as in PEFT.
    #[arg(long)]
    adapter: Option<PathBuf>,
    #[command(flatten)]
    run: RunFlags,
}

/// How `generate` picks tokens, from its flags: forced greedy, flags that turn sampling on
/// (over the folder's defaults), or the folder's defaults alone.
#[derive(Clone, Copy)]
struct Pick {
    greedy: bool,
    temperature: Option<f64>,
    top_k: Option<usize>,
    top_p: Option<f64>,
    seed: u64,
}

impl Pick {
    /// The sampling for a model whose folder gives `defaults`.
    fn sampling(self, defaults: &GenerationDefaults) -> Option<Sampling> {
        if self.greedy {
            return None;
        }
        let flagged = self.temperature.is_some() || self.top_k.is_some() || self.top_p.is_some();
        let base = defaults.sampling(self.seed);
        if !flagged {
            return base;
        }
        let base = base.unwrap_or(Sampling {
            temperature: 1.0,
            top_k: None,
            top_p: None,
            seed: self.seed,
        });
        Some(Sampling {
            temperature: self.temperature.unwrap_or(base.temperature),
            top_k: self.top_k.or(base.top_k),
            top_p: self.top_p.or(base.top_p),
            seed: self.seed,
        })
    }
}

/// A prompt: token ids, or text for the folder's tokenizer.
#[derive(Clone)]
enum Prompt {
    Ids(Vec<usize>),
    Text(String),
}

/// What to do with the model once loaded.
#[derive(Clone)]
enum Task {
    Logits(Vec<usize>),
    /// The prompts (one batch), the most new tokens, how to pick them, how many times.
    Generate {
        prompts: Vec<Prompt>,
        max_new_tokens: usize,
        pick: Pick,
        repeats: usize,
    },
}

/// The model's answer: logits `[T, vocab]`, or each prompt's new ids (and their text where
/// the folder has a tokenizer).
enum Answer {
    Logits(Vec<f32>, [usize; 2]),
    Ids(Vec<(Vec<usize>, Option<String>)>),
}

/// The most prompts one `--prompts-file` or `--ids-file` may hold.
const MAX_PROMPTS: usize = 1024;

/// The most bytes of such a file.
const MAX_PROMPTS_BYTES: u64 = 16 << 20;

/// The most tokens a padded batch of prompts may hold (prompts × the longest): its prefill's
/// activations and logits are allocated from it.
const MAX_BATCH_TOKENS: usize = 1 << 20;

/// The prompts of a `--prompts-file` (text) or `--ids-file` (`ids` true): one a line, none
/// empty, at most [`MAX_PROMPTS`] in at most [`MAX_PROMPTS_BYTES`].
fn read_prompts(path: &Path, ids: bool) -> Result<Vec<Prompt>, String> {
    let flag = if ids { "--ids-file" } else { "--prompts-file" };
    let bytes = mpipemoe::files::read_bounded(path, MAX_PROMPTS_BYTES).map_err(|e| format!("{flag}: {e}"))?;
    let text =
        String::from_utf8(bytes).map_err(|_| format!("{flag}: {} is not UTF-8 text", path.display()))?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.strip_suffix('\r').unwrap_or(line);
        let at = || format!("{flag}: {} line {}", path.display(), i + 1);
        if line.trim().is_empty() {
            return Err(format!("{}: an empty prompt", at()));
        }
        if prompts.len() == MAX_PROMPTS {
            return Err(format!(
                "{flag}: {} holds over {MAX_PROMPTS} prompts",
                path.display()
            ));
        }
        prompts.push(match ids {
            false => Prompt::Text(line.to_string()),
            true => Prompt::Ids(
                line.split(',')
                    .map(|id| id.trim().parse::<usize>())
                    .collect::<Result<_, _>>()
                    .map_err(|e| format!("{}: not comma-separated token ids ({e})", at()))?,
            ),
        });
    }
    if prompts.is_empty() {
        return Err(format!("{flag}: {} holds no prompt", path.display()));
    }
    Ok(prompts)
}

struct LmJob<'a> {
    dir: &'a Path,
    run: &'a RunFlags,
    adapter: Option<&'a PeftAdapter>,
    task: Task,
    /// The heap grown and advised for huge pages before the load (`--huge-pages`).
    huge_pages: bool,
}

impl BackendJob for LmJob<'_> {
    type Output = mpipemoe::Result<Answer>;

    fn run<B>(self, _device: &B::Device) -> Self::Output
    where
        B: AutodiffBackend + MoeBackend,
        B::InnerBackend: MoeBackend,
    {
        // Inference only: the backend without autodiff. Rank 0's answer (every rank computes
        // the same tokens).
        let paths = self.run.paths()?;
        if self.huge_pages {
            // Room for the checkpoint's tensors widened to f32 and the load's copies, or less
            // where the address space refuses that much (`mpipemoe::heap::reserve_huge_pages`).
            let files = weight_file_bytes(self.dir);
            let reserved = [3, 2, 1]
                .into_iter()
                .find_map(|times| mpipemoe::heap::reserve_huge_pages(files.saturating_mul(times)));
            if reserved.is_none() {
                eprintln!(
                    "note: --huge-pages: the heap could not be advised (see `--heap`); \
                     loading on 4 KiB pages"
                );
            }
        }
        // Each rank on a pool of its own: a decode step's products split over the threads, and
        // from a pool's worker those hand-offs are cheap (`GroupOptions::pool_per_rank`).
        let options = GroupOptions::pool_per_rank(self.run.ranks);
        // What a forward may hold on the host, each rank's share (the CPU backends).
        let host = self.run.backend.host_bytes_per_rank(self.run.ranks);
        let elem = std::mem::size_of::<B::FloatElem>();
        let answers = LocalGroup::run_with(options, self.run.ranks, |ctx| {
            let device = Default::default();
            let model = MoeCausalLm::<B::InnerBackend>::from_hf(self.dir, &device, paths(ctx.comm.clone()))?;
            if ctx.rank == 0 && !model.ignored_tensors().is_empty() {
                eprintln!(
                    "note: {} tensor(s) not loaded, as transformers skips them too (e.g. {})",
                    model.ignored_tensors().len(),
                    model.ignored_tensors()[0]
                );
            }
            let model = model.map_moe_configs(|c| self.run.moe(c))?;
            let model = match (self.adapter, &self.task) {
                (None, _) => model,
                (Some(adapter), Task::Logits(_)) => model.with_adapter(adapter)?,
                // Generation merges: each step then runs the weights alone, not the experts'
                // adapted weights rebuilt per token.
                (Some(adapter), Task::Generate { .. }) => model.with_adapter(adapter)?.merge_lora(),
            };
            // The ranks meet after loading under the arrival bound: one may load far slower.
            ctx.comm.arrival_barrier()?;
            match &self.task {
                Task::Logits(ids) => {
                    model.check_ids(ids, 0)?;
                    let t = ids.len();
                    let floor = forward_floor_bytes(model.config(), 1, t, true, elem);
                    check_host_bytes(floor, host, || {
                        format!("the logits of {t} ids, in one layer's attention weights or the logits,")
                    })?;
                    let tensor = Tensor::<B::InnerBackend, 2, Int>::from_data(
                        TensorData::new(ids.iter().map(|&i| i as i64).collect::<Vec<_>>(), [1, t]),
                        &device,
                    );
                    let vocab = model.config().vocab_size;
                    let logits = model.try_forward(tensor, None)?.logits;
                    let values = logits
                        .into_data()
                        .convert::<f32>()
                        .into_vec::<f32>()
                        .map_err(|e| MoeError::Input(format!("logits: {e:?}")))?;
                    Ok(Answer::Logits(values, [t, vocab]))
                }
                Task::Generate {
                    prompts,
                    max_new_tokens,
                    pick,
                    repeats,
                } => {
                    let vocab = model.config().vocab_size;
                    let tokenizer = TextTokenizer::from_dir(self.dir, vocab)?;
                    let prompts = prompts
                        .iter()
                        .map(|prompt| match (prompt, &tokenizer) {
                            (Prompt::Ids(ids), _) => Ok(ids.clone()),
                            (Prompt::Text(text), Some(tokenizer)) => tokenizer.encode(text, true),
                            (Prompt::Text(_), None) => Err(MoeError::file(
                                self.dir.join(TextTokenizer::FILE),
                                "a text prompt needs the folder's tokenizer, and there is none \
                                 (give token ids)",
                            )),
                        })
                        .collect::<mpipemoe::Result<Vec<_>>>()?;
                    let width = prompts.iter().map(Vec::len).max().unwrap_or(0);
                    if prompts.len().saturating_mul(width) > MAX_BATCH_TOKENS {
                        return Err(MoeError::Input(format!(
                            "{} prompts padded to {width} tokens are over the {MAX_BATCH_TOKENS} \
                             tokens one batch may hold",
                            prompts.len()
                        )));
                    }
                    let floor = forward_floor_bytes(model.config(), prompts.len(), width, false, elem);
                    check_host_bytes(floor, host, || {
                        format!(
                            "the prefill of {} prompts padded to {width} tokens, in one layer's attention weights,",
                            prompts.len()
                        )
                    })?;
                    let options = GenerateOptions {
                        max_new_tokens: *max_new_tokens,
                        sampling: pick.sampling(&model.config().generation),
                    };
                    if ctx.rank == 0 {
                        if let Some(s) = &options.sampling {
                            eprintln!(
                                "sampling: temperature {}, top-k {}, top-p {}, seed {}",
                                s.temperature,
                                s.top_k.map_or("off".into(), |k| k.to_string()),
                                s.top_p.map_or("off".into(), |p| p.to_string()),
                                s.seed
                            );
                        }
                    }
                    let batch: Vec<&[usize]> = prompts.iter().map(Vec::as_slice).collect();
                    let rows = generate_runs(&model, &batch, &options, &device, *repeats, ctx.rank == 0)?;
                    let answers = rows
                        .into_iter()
                        .map(|ids| {
                            let text = tokenizer.as_ref().map(|t| t.decode(&ids)).transpose()?;
                            Ok((ids, text))
                        })
                        .collect::<mpipemoe::Result<Vec<_>>>()?;
                    Ok(Answer::Ids(answers))
                }
            }
        })?;
        Ok(answers.into_iter().next().expect("at least one rank"))
    }
}

/// `model`'s continuations of `batch`, generated `repeats` times, each run timed on standard
/// error where `report` (rank 0; standard output stays ids and text): the last run's ids.
fn generate_runs<B: MoeBackend>(
    model: &MoeCausalLm<B>,
    batch: &[&[usize]],
    options: &GenerateOptions,
    device: &B::Device,
    repeats: usize,
    report: bool,
) -> mpipemoe::Result<Vec<Vec<usize>>> {
    let read: usize = batch.iter().map(|p| p.len()).sum();
    let mut last: Option<Vec<Vec<usize>>> = None;
    for run in 1..=repeats {
        let start = std::time::Instant::now();
        let rows = model.generate_batch(batch, options, device)?;
        let seconds = start.elapsed().as_secs_f64();
        if report {
            let new: usize = rows.iter().map(Vec::len).sum();
            let of = match repeats {
                1 => String::new(),
                _ => format!(" (run {run} of {repeats})"),
            };
            eprintln!(
                "generated {new} tokens after {} prompt(s) of {read} tokens in {seconds:.3} s \
                 ({:.2} tokens/s, prefill included){of}",
                batch.len(),
                new as f64 / seconds
            );
        }
        // Every run starts from the same prompts and seed, so a run that picks other ids says
        // that the backend's arithmetic changed between calls (on a GPU, an autotuned kernel
        // chosen after the first run sums in another order, which can break a near tie). That
        // is worth a word, not the loss of the runs: each run's tokens/s stays the rate of its
        // own work.
        if report && last.as_ref().is_some_and(|earlier| *earlier != rows) {
            eprintln!(
                "note: run {run} picked other ids than run {}: the backend's results changed \
                 between calls",
                run - 1
            );
        }
        last = Some(rows);
    }
    Ok(last.expect("--repeats is at least 1"))
}

fn check_ids(ids: &[usize]) -> Result<(), String> {
    if ids.is_empty() {
        return Err("--ids: give at least one token id".into());
    }
    Ok(())
}

fn answer(
    dir: &Path,
    run: &RunFlags,
    adapter: Option<&Path>,
    task: Task,
    huge_pages: bool,
) -> Result<Answer, ExitCode> {
    let adapter = match adapter.map(PeftAdapter::read).transpose() {
        Ok(adapter) => adapter,
        Err(e) => {
            eprintln!("error: --adapter: {e}");
            return Err(ExitCode::FAILURE);
        }
    };
    let job = LmJob {
        dir,
        run,
        adapter: adapter.as_ref(),
        task,
        huge_pages,
    };
    match run_on(run.backend, job) {
        Err(message) => {
            eprintln!("error: {message}");
            Err(ExitCode::from(2))
        }
        Ok(Err(e)) => {
            eprintln!("error: {e}");
            Err(ExitCode::FAILURE)
        }
        Ok(Ok(answer)) => Ok(answer),
    }
}

pub fn logits(args: LogitsArgs) -> ExitCode {
    if let Err(message) = check_ids(&args.ids).and_then(|()| may_write(&args.out, args.overwrite)) {
        eprintln!("error: {message}");
        return ExitCode::from(2);
    }
    // The logits file never lands among the model's own files.
    if let Err(e) = mpipemoe::files::check_apart(&args.dir, &args.out, "--out") {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    match answer(
        &args.dir,
        &args.run,
        args.adapter.as_deref(),
        Task::Logits(args.ids.clone()),
        false,
    ) {
        Ok(Answer::Logits(values, shape)) => {
            let mut tensors = TensorMap::new();
            tensors.insert("logits".to_string(), TensorData::new(values, shape));
            let meta =
                serde_json::json!({ "model": args.dir.display().to_string(), "ids": args.ids }).to_string();
            match mpipemoe::format::write_safetensors(&args.out, &tensors, &meta) {
                Ok(()) => {
                    println!(
                        "logits [{}, {}] written to {}",
                        shape[0],
                        shape[1],
                        args.out.display()
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Ok(Answer::Ids(..)) => unreachable!("a logits task answers logits"),
        Err(code) => code,
    }
}

pub fn generate(args: GenerateArgs) -> ExitCode {
    let batched = args.prompts_file.is_some() || args.ids_file.is_some();
    let prompts = match (args.prompt, &args.prompts_file, &args.ids_file) {
        (Some(text), ..) => Ok(vec![Prompt::Text(text)]),
        (None, Some(file), _) => read_prompts(file, false),
        (None, None, Some(file)) => read_prompts(file, true),
        (None, None, None) => check_ids(&args.ids).map(|()| vec![Prompt::Ids(args.ids.clone())]),
    };
    let prompts = match prompts {
        Ok(prompts) => prompts,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    let pick = Pick {
        greedy: args.greedy,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };
    match answer(
        &args.dir,
        &args.run,
        args.adapter.as_deref(),
        Task::Generate {
            prompts,
            max_new_tokens: args.max_new_tokens,
            pick,
            repeats: args.repeats,
        },
        args.huge_pages,
    ) {
        Ok(Answer::Ids(rows)) if batched => {
            // One JSON object a prompt and line: text may hold line breaks.
            for (ids, text) in rows {
                let mut line = serde_json::json!({ "ids": ids });
                if let Some(text) = text {
                    line["text"] = serde_json::Value::String(text);
                }
                println!("{line}");
            }
            ExitCode::SUCCESS
        }
        Ok(Answer::Ids(mut rows)) => {
            let (ids, text) = rows.pop().expect("one prompt, one answer");
            // The ids alone on the first line, for scripts; the text after it.
            let line: Vec<String> = ids.iter().map(usize::to_string).collect();
            println!("{}", line.join(","));
            if let Some(text) = text {
                println!("{text}");
            }
            ExitCode::SUCCESS
        }
        Ok(Answer::Logits(..)) => unreachable!("a generate task answers ids"),
        Err(code) => code,
    }
}

impl StrategyArg {
    /// The strategy the flag names.
    pub fn strategy(self) -> Strategy {
        match self {
            StrategyArg::None => Strategy::None,
            StrategyArg::S1 => Strategy::S1,
            StrategyArg::S2 => Strategy::S2,
            StrategyArg::S3 => Strategy::S3,
            StrategyArg::S4 => Strategy::S4,
        }
    }
}

/// The bytes of the folder's `.safetensors` files (0 where it cannot be listed): the size of
/// the heap the weights will take, near enough.
fn weight_file_bytes(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len() as usize)
        .fold(0, usize::saturating_add)
}
