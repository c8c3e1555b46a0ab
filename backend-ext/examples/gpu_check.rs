//! Every reference case on CUDA, through every strategy and n ∈ {1, 2, 4}, in f32 (1e-4) and
//! bf16 (at bf16's own tolerance), plus the reference path; then the f32 runs again with the rows
//! moved by NCCL on device pointers (a one-rank NCCL group whose all-to-alls are not skipped)
//! and S1–S3 offloading to pinned host memory through that group's offload path, and with the
//! in-order executor, which builds every partition in the partition arena (the threaded
//! executor, CUDA's default, does not use it), so each new path is checked against the cases
//! on its own.
//!
//! ```text
//! gpu_check [CASE_DIR]      # default: tests/data/cases (the repository's copy of the cases)
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use burn::backend::Autodiff;
use burn::tensor::bf16;
use std::sync::Arc;
use std::time::Duration;

use mpipemoe::backend::StepExecutor;
use mpipemoe::harness::{check_case, check_case_through, Case, CheckOptions};
use mpipemoe::memory::Strategy;
use mpipemoe::{Communicator, ExchangePath, MoeBackend, Partitions};
use mpipemoe_cuda::{cuda_available, CudaMoe, Nccl};

fn case_files(dir: Option<String>) -> Vec<PathBuf> {
    let dir = dir.map_or_else(|| PathBuf::from("tests/data/cases"), PathBuf::from);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// The fused path on one rank with `n` partitions and `strategy`, the backend's executor.
fn fused(n: usize, strategy: Strategy) -> CheckOptions {
    CheckOptions {
        path: ExchangePath::Fused,
        n_ranks: 1,
        partitions: Partitions::Fixed(n),
        strategy,
        memory_budget: None,
        executor: None,
    }
}

fn main() -> ExitCode {
    if let Err(e) = cuda_available() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let files = case_files(std::env::args().nth(1));
    if files.is_empty() {
        eprintln!("error: no case files found");
        return ExitCode::from(2);
    }
    let device = Default::default();
    println!(
        "executor on CUDA by default: {:?}",
        <CudaMoe<f32> as MoeBackend>::step_executor(&device)
    );
    // One rank, every all-to-all through NCCL's device path (a device copy of the own rows).
    let nccl: Arc<dyn Communicator> = match Nccl::from_env(Duration::from_secs(60)) {
        Ok(n) => Arc::new(n.with_emulated_network(true)),
        Err(e) => {
            eprintln!("error: NCCL: {e}");
            return ExitCode::from(2);
        }
    };
    let mut failed = 0;
    let mut total = 0;
    for file in &files {
        let case = match Case::load(file) {
            Ok(c) => c,
            Err(e) => {
                println!("{} FAIL error: {e}", file.display());
                failed += 1;
                continue;
            }
        };
        let mut runs = vec![(
            "f32",
            CheckOptions {
                path: ExchangePath::Reference,
                ..CheckOptions::default()
            },
        )];
        for n in [1, 2, 4] {
            for strategy in Strategy::ALL {
                runs.push(("f32", fused(n, strategy)));
                runs.push(("bf16", fused(n, strategy)));
            }
        }
        for n in [1, 3] {
            for strategy in Strategy::ALL {
                runs.push(("f32 nccl-rows", fused(n, strategy)));
                runs.push((
                    "f32 in-order arena",
                    CheckOptions {
                        executor: Some(StepExecutor::InOrder),
                        ..fused(n, strategy)
                    },
                ));
            }
        }
        for (dtype, options) in runs {
            total += 1;
            let (result, tolerance) = match dtype {
                "f32" | "f32 in-order arena" => (
                    check_case::<Autodiff<CudaMoe<f32>>>(&case, &options, &device),
                    1e-4,
                ),
                "f32 nccl-rows" => (
                    check_case_through::<Autodiff<CudaMoe<f32>>>(&case, &options, &device, &|_| nccl.clone()),
                    1e-4,
                ),
                // bf16 keeps 8 bits of mantissa: about 4e-3 relative per value, more after
                // two GEMMs and a softmax.
                _ => (
                    check_case::<Autodiff<CudaMoe<bf16>>>(&case, &options, &device),
                    3e-2,
                ),
            };
            let label = format!(
                "{} {dtype} {} n={:?} {}",
                case.name,
                options.path.name(),
                options.partitions,
                options.strategy
            );
            match result {
                Ok(r) if r.passed(tolerance) => println!("{label} ok max_rel_err={:.3e}", r.max_rel_err()),
                Ok(r) => {
                    failed += 1;
                    println!(
                        "{label} FAIL max_rel_err={:.3e} (worst: {})",
                        r.max_rel_err(),
                        r.worst().name
                    );
                }
                Err(e) => {
                    failed += 1;
                    println!("{label} FAIL error: {e}");
                }
            }
        }
    }
    println!("\n{} of {total} checks passed", total - failed);
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
