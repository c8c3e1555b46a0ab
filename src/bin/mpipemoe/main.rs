//! The `mpipemoe` command-line tool.

mod check;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check(args) => check::run(args),
    }
}
