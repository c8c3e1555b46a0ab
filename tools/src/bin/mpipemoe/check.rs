//! `mpipemoe check`: run reference cases through a configuration of the layer.

use std::path::PathBuf;
use std::process::ExitCode;

use burn::tensor::backend::AutodiffBackend;
use clap::{Args, ValueEnum};
use mpipemoe::harness::{check_case_through, Case, CheckOptions, CheckReport};
use mpipemoe::MoeBackend;
use mpipemoe::MAX_PARTITIONS;
use mpipemoe::{ExchangePath, Partitions};
use mpipemoe_tools::backends::{
    device_paths, run_on, AddPaths, BackendArg, BackendJob, GemmArg, PrecisionArg,
};
use mpipemoe_tools::flags::{count, shadowing, ExecutorArg};

/// Tolerance on the relative error of y, dx and every gradient.
const TOLERANCE: f64 = 1e-4;

#[derive(Args, Debug)]
pub struct CheckArgs {
    /// Case files (canonical safetensors with expected outputs and gradients), or canonical
    /// layer files with weights only (as `convert` writes them): for those, x is 64 seeded
    /// random tokens and the expected tensors come from the float64 oracle of the spec.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Which implementation of the exchange to run.
    #[arg(long, value_enum, default_value_t = PathArg::Fused)]
    path: PathArg,
    /// Expert-parallel ranks (threads, 1..=256); tokens are split contiguously over them.
    #[arg(long, default_value_t = 1, value_parser = count(1, 256))]
    ranks: usize,
    /// Partitions of the exchange (the paper's n; at most the case's tokens).
    #[arg(long, default_value_t = 1, value_parser = count(1, MAX_PARTITIONS))]
    partitions: usize,
    /// Memory-reuse strategy.
    #[arg(long, value_enum, default_value_t = StrategyArg::None)]
    strategy: StrategyArg,
    /// Backend (`wgpu` needs the tool built with `--features wgpu`).
    #[arg(long, value_enum, default_value_t = BackendArg::Flex)]
    backend: BackendArg,
    /// How the exchange runs its schedule: `threads` (one per stream), `in-order`, or the
    /// backend's default.
    #[arg(long, value_enum, default_value_t = ExecutorArg::Default)]
    executor: ExecutorArg,
    /// Hot experts replicated on every rank: `off`, `auto` (the cost model's choice each
    /// step) or a count k (the k most loaded experts each step). Changes no result.
    #[arg(long, default_value = "off", value_parser = shadowing)]
    shadowing: mpipemoe::Shadowing,
    /// The experts' GEMM precision on the CUDA backends (with `--gemm cublas`): `f32` holds
    /// the cases to 1e-4; `tf32` and `bf16` are checked at the same 1e-4 here, so expect them
    /// to fail it by their rounding.
    #[arg(long, value_enum, default_value_t = PrecisionArg::F32)]
    gemm_precision: PrecisionArg,
    /// Which library runs the experts' GEMMs on the CUDA backends: `cublas` or `cubecl`.
    #[arg(long, value_enum, default_value_t = GemmArg::Cublas)]
    gemm: GemmArg,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum PathArg {
    Fused,
    Reference,
}

/// `--strategy`: the memory-reuse strategy of the exchange.
#[derive(ValueEnum, Clone, Copy, Debug)]
pub(crate) enum StrategyArg {
    None,
    S1,
    S2,
    S3,
    S4,
}

/// One case through one configuration, on the chosen backend.
struct CheckJob<'a> {
    case: &'a Case,
    options: &'a CheckOptions,
    paths: &'a AddPaths,
}

impl BackendJob for CheckJob<'_> {
    type Output = mpipemoe::Result<CheckReport>;

    fn run<B>(self, device: &B::Device) -> Self::Output
    where
        B: AutodiffBackend + MoeBackend,
        B::InnerBackend: MoeBackend,
    {
        check_case_through::<B>(self.case, self.options, device, &|comm| (self.paths)(comm))
    }
}

pub fn run(args: CheckArgs) -> ExitCode {
    let options = CheckOptions {
        path: match args.path {
            PathArg::Fused => ExchangePath::Fused,
            PathArg::Reference => ExchangePath::Reference,
        },
        n_ranks: args.ranks,
        partitions: Partitions::Fixed(args.partitions),
        strategy: args.strategy.strategy(),
        memory_budget: None,
        executor: args.executor.executor(),
        shadowing: args.shadowing,
        gemm_precision: args.gemm_precision.precision(),
    };
    let paths = match device_paths(args.backend, args.gemm, 0) {
        Ok(paths) => paths,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    let mut failed = false;
    for file in &args.files {
        let name = file
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        // Results go to standard output, one line a file; errors to standard error, naming
        // the file (a load error names it already).
        let case = match Case::load_or_oracle(file, 64, 0) {
            Ok(case) => case,
            Err(err) => {
                failed = true;
                println!("{name} FAIL");
                eprintln!("error: {err}");
                continue;
            }
        };
        // More partitions than tokens only adds empty ones: a count beyond the batch is a
        // mistyped flag, and saying so beats running it. (The library allows it; its tests
        // use empty partitions on purpose.)
        if args.partitions > case.n_tokens() {
            failed = true;
            println!("{name} FAIL");
            eprintln!(
                "error: {}: --partitions {} is more than the case's {} tokens",
                file.display(),
                args.partitions,
                case.n_tokens()
            );
            continue;
        }
        let job = CheckJob {
            case: &case,
            options: &options,
            paths: &paths,
        };
        let result = match run_on(args.backend, job) {
            Ok(result) => result.map(|report| (report, case.expected_by_oracle)),
            // A backend this build lacks is a usage error for every file alike: say it once.
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::from(2);
            }
        };
        match result {
            Ok((report, oracle)) if report.passed(TOLERANCE) => {
                let source = if oracle {
                    " (expected from the float64 oracle)"
                } else {
                    ""
                };
                println!("{name} ok max_rel_err={:.3e}{source}", report.max_rel_err());
            }
            Ok((report, _)) => {
                failed = true;
                let worst = report.worst();
                println!(
                    "{name} FAIL max_rel_err={:.3e} (worst: {})",
                    worst.rel_err, worst.name
                );
            }
            Err(err) => {
                failed = true;
                println!("{name} FAIL");
                eprintln!("error: {}: {err}", file.display());
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
