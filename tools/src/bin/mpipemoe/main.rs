//! The `mpipemoe` command-line tool.

mod check;
mod convert;
mod inspect;
mod lm;
mod plan;
mod profile;
mod shape;
mod simulate;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// MoE layers with pipelined expert parallelism and memory reuse (MPipeMoE).
#[derive(Parser, Debug)]
#[command(name = "mpipemoe", version, about)]
struct Cli {
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
    /// A Hugging Face MoE model's greedy continuation of token ids (KV cache), printed as ids.
    Generate(lm::GenerateArgs),
    /// Memory plan: the paper's Eq. 1-9 and this implementation's model for a layer shape.
    Plan(plan::PlanArgs),
    /// Measure this machine's stream rates and slowdowns (a profile for the cost model).
    Profile(profile::ProfileArgs),
    /// Simulate forward + backward on three streams for every (n, strategy) on a profile.
    Simulate(simulate::SimulateArgs),
}

fn main() -> ExitCode {
    // `check` and `profile` run the layer's steps over and over: keep freed memory for them.
    mpipemoe_tools::heap::keep_freed_memory();
    let cli = Cli::parse();
    match cli.command {
        Command::Check(args) => check::run(args),
        Command::Convert(args) => convert::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Logits(args) => lm::logits(args),
        Command::Generate(args) => lm::generate(args),
        Command::Plan(args) => plan::run(args),
        Command::Profile(args) => profile::run(args),
        Command::Simulate(args) => simulate::run(args),
    }
}
