//! The `mpipemoe` command-line tool.

mod check;
mod closed_stdout;
mod convert;
mod finetune;
mod inspect;
mod lm;
mod plan;
mod profile;
mod shape;
mod simulate;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use mpipemoe_tools::heap::Heap;

/// MoE layers with pipelined expert parallelism and memory reuse (MPipeMoE).
#[derive(Parser, Debug)]
#[command(name = "mpipemoe", version, about)]
struct Cli {
    /// The process's heap: `keep` keeps freed memory for the next step (`mpipemoe::heap`), as
    /// the training binaries do; `system` leaves glibc's defaults (for a comparison with
    /// another process under them).
    #[arg(long, global = true, value_enum, default_value_t = Heap::Keep)]
    heap: Heap,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check reference cases: forward, backward and every gradient against the expected tensors.
    Check(check::CheckArgs),
    /// A Hugging Face MoE layer to a canonical float32 layer file (--from-hf), or back (--to-hf).
    Convert(convert::ConvertArgs),
    /// List the MoE layers of a Hugging Face checkpoint folder.
    Inspect(inspect::InspectArgs),
    /// A Hugging Face MoE model's logits for token ids, written to a safetensors file.
    Logits(lm::LogitsArgs),
    /// A Hugging Face MoE model's continuation of token ids or text, greedy or sampled, one prompt or a batch (KV cache), printed as ids (and text).
    Generate(lm::GenerateArgs),
    /// Fine-tune a Hugging Face MoE model on a text file with expert parallelism; write it back as a folder.
    Finetune(finetune::FinetuneArgs),
    /// Memory plan: the paper's Eq. 1-9 and this implementation's model for a layer shape.
    Plan(plan::PlanArgs),
    /// Measure this machine's stream rates and slowdowns (a profile for the cost model).
    Profile(profile::ProfileArgs),
    /// Simulate forward + backward on three streams for every (n, strategy) on a profile.
    Simulate(simulate::SimulateArgs),
}

fn main() -> ExitCode {
    // `check`, `profile` and `finetune` run steps over and over: by default freed memory is
    // kept for them. Parsing the flags allocates nothing large, so the setting still comes
    // before the first large block.
    let cli = Cli::parse();
    cli.heap.apply();
    closed_stdout::ends_quietly(|| run(cli.command))
}

fn run(command: Command) -> ExitCode {
    match command {
        Command::Check(args) => check::run(args),
        Command::Convert(args) => convert::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Logits(args) => lm::logits(args),
        Command::Generate(args) => lm::generate(args),
        Command::Finetune(args) => finetune::run(args),
        Command::Plan(args) => plan::run(args),
        Command::Profile(args) => profile::run(args),
        Command::Simulate(args) => simulate::run(args),
    }
}
