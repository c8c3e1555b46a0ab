//! `mpipemoe profile`: measure the stream rates and slowdowns on this machine's backend.

use std::path::PathBuf;
use std::process::ExitCode;

use burn::backend::{Flex, NdArray};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use mpipemoe::tuning::{measure_profile, ProfileOptions};

#[derive(ValueEnum, Clone, Copy, Debug)]
enum BackendArg {
    Flex,
    Ndarray,
}

#[derive(Args, Debug)]
pub struct ProfileArgs {
    /// Write the profile as JSON to this file (it is printed either way).
    #[arg(long)]
    out: Option<PathBuf>,
    /// CPU backend to measure.
    #[arg(long, value_enum, default_value_t = BackendArg::Flex)]
    backend: BackendArg,
    /// GEMM token width.
    #[arg(long, default_value_t = 768)]
    d_model: usize,
    /// GEMM hidden width.
    #[arg(long, default_value_t = 3072)]
    d_hidden: usize,
    /// Rows of the large GEMM.
    #[arg(long, default_value_t = 1024)]
    rows: usize,
    /// Timed repeats per measurement.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
}

pub fn run(args: ProfileArgs) -> ExitCode {
    let options = ProfileOptions {
        d_model: args.d_model,
        d_hidden: args.d_hidden,
        rows: args.rows,
        repeats: args.repeats,
        ..ProfileOptions::default()
    };
    let bar = ProgressBar::new(12);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}").expect("template"),
    );
    let mut step = |what: &str| {
        bar.inc(1);
        bar.set_message(what.to_string());
    };
    let result = match args.backend {
        BackendArg::Flex => measure_profile::<Flex>(&Default::default(), &options, &mut step),
        BackendArg::Ndarray => measure_profile::<NdArray>(&Default::default(), &options, &mut step),
    };
    bar.finish_and_clear();
    match result {
        Ok(profile) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&profile).expect("profiles serialize")
            );
            if let Some(path) = args.out {
                if let Err(e) = profile.save(&path) {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
                eprintln!("written to {}", path.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
