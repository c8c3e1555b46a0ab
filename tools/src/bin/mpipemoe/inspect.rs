//! `mpipemoe inspect`: the MoE layers of a Hugging Face checkpoint.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use mpipemoe::hf;

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// A Hugging Face checkpoint folder (config.json and safetensors).
    dir: PathBuf,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(args: InspectArgs) -> ExitCode {
    let layers = match hf::inspect(&args.dir) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&layers).expect("summaries serialize")
        );
        return ExitCode::SUCCESS;
    }
    println!(
        "{:>5}  {:<11} {:>4} {:>3} {:>6} {:>6} {:>7} {:<8} {:>12}",
        "layer", "family", "E", "k", "M", "H", "shared", "scoring", "parameters"
    );
    for l in &layers {
        println!(
            "{:>5}  {:<11} {:>4} {:>3} {:>6} {:>6} {:>7} {:<8} {:>12}",
            l.layer,
            l.family.model_type(),
            l.n_experts,
            l.top_k,
            l.d_model,
            l.d_hidden,
            l.d_shared.map_or("-".to_string(), |h| h.to_string()),
            l.scoring,
            l.parameters
        );
    }
    let total: usize = layers.iter().map(|l| l.parameters).sum();
    println!("{} MoE layers, {total} parameters in them", layers.len());
    ExitCode::SUCCESS
}
