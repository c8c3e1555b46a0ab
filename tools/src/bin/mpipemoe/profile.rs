//! `mpipemoe profile`: measure the stream rates and slowdowns on this machine's backend.

use std::path::PathBuf;
use std::process::ExitCode;

use burn::backend::{Flex, NdArray};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use mpipemoe::tuning::{measure_profile, ProfileOptions};
use mpipemoe_tools::flags::{count, may_write};

#[derive(ValueEnum, Clone, Copy, Debug)]
enum BackendArg {
    Flex,
    Ndarray,
}

#[derive(Args, Debug)]
pub struct ProfileArgs {
    /// Write the profile as JSON to this file (it is printed either way); an existing file
    /// needs --overwrite.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace an existing --out file.
    #[arg(long)]
    overwrite: bool,
    /// CPU backend to measure.
    #[arg(long, value_enum, default_value_t = BackendArg::Flex)]
    backend: BackendArg,
    /// GEMM token width (1..=65536).
    #[arg(long, default_value_t = 768, value_parser = count(1, 1 << 16))]
    d_model: usize,
    /// GEMM hidden width (1..=262144).
    #[arg(long, default_value_t = 3072, value_parser = count(1, 1 << 18))]
    d_hidden: usize,
    /// Rows of the large GEMM (1..=1048576).
    #[arg(long, default_value_t = 1024, value_parser = count(1, 1 << 20))]
    rows: usize,
    /// Timed repeats per measurement (1..=1000).
    #[arg(long, default_value_t = 5, value_parser = count(1, 1000))]
    repeats: usize,
}

/// The most elements one tensor of the measurement may have (2^28 f32 values: 1 GiB).
const MAX_ELEMENTS: usize = 1 << 28;

pub fn run(args: ProfileArgs) -> ExitCode {
    // Every tensor the measurement allocates: the input, the weights and the hidden rows.
    for (what, elements) in [
        ("--rows × --d-model", args.rows * args.d_model),
        ("--d-model × --d-hidden", args.d_model * args.d_hidden),
        ("--rows × --d-hidden", args.rows * args.d_hidden),
    ] {
        if elements > MAX_ELEMENTS {
            eprintln!("error: {what} is {elements} elements, over the {MAX_ELEMENTS} one tensor of the measurement may have");
            return ExitCode::from(2);
        }
    }
    if let Some(path) = &args.out {
        // Say it before minutes of measuring, not after.
        if let Err(e) = may_write(path, args.overwrite) {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
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
                if let Err(e) = profile.save(&path, args.overwrite) {
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
