//! Every reference case on CUDA, through every strategy and n ∈ {1, 2, 4}, in f32 (1e-4) and
//! bf16 (at bf16's own tolerance), plus the reference path; then the f32 runs again with the
//! in-order executor, which builds every partition in the partition arena (the threaded
//! executor, CUDA's default, does not use it), and last with the rows moved by NCCL on device
//! pointers (a one-rank NCCL group whose all-to-alls are not skipped) and S1–S3 offloading to
//! pinned host memory through that group's offload path, so each path is checked against the
//! cases on its own (the plan: `mpipemoe_cuda::check_plan`). Where NCCL cannot be loaded or its
//! group cannot start, every other check still runs and the NCCL checks are reported as
//! skipped, with why. A check that panics inside burn or cubecl fails alone.
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
use mpipemoe_cuda::check_plan::{check_runs, CheckRun};
use mpipemoe_cuda::{cuda_available, nccl_available, CudaMoe, Nccl};

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

/// The NCCL group of one rank whose all-to-alls are not skipped, or why there is none.
fn nccl_group() -> Result<Arc<dyn Communicator>, String> {
    nccl_available().map_err(|e| e.to_string())?;
    let nccl = Nccl::from_env(Duration::from_secs(60)).map_err(|e| e.to_string())?;
    Ok(Arc::new(nccl.with_emulated_network(true)))
}

/// The checker's options and tolerance for one planned run.
fn options(run: CheckRun) -> (&'static str, CheckOptions, f64) {
    // bf16 keeps 8 bits of mantissa: about 4e-3 relative per value, more after two GEMMs and
    // a softmax.
    match run {
        CheckRun::Reference => (
            "f32",
            CheckOptions {
                path: ExchangePath::Reference,
                ..CheckOptions::default()
            },
            1e-4,
        ),
        CheckRun::Fused {
            n,
            strategy,
            bf16: false,
        } => ("f32", fused(n, strategy), 1e-4),
        CheckRun::Fused {
            n,
            strategy,
            bf16: true,
        } => ("bf16", fused(n, strategy), 3e-2),
        CheckRun::InOrderArena { n, strategy } => (
            "f32 in-order arena",
            CheckOptions {
                executor: Some(StepExecutor::InOrder),
                ..fused(n, strategy)
            },
            1e-4,
        ),
        CheckRun::NcclRows { n, strategy } => ("f32 nccl-rows", fused(n, strategy), 1e-4),
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
    let nccl = nccl_group();
    if let Err(why) = &nccl {
        println!("NCCL checks skipped: {why}");
    }
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
        for run in check_runs(nccl.is_ok()) {
            total += 1;
            let (dtype, options, tolerance) = options(run);
            let start = std::time::Instant::now();
            // A panic inside burn or cubecl (a kernel that does not compile, say) fails this
            // check, not the whole run.
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match run {
                CheckRun::NcclRows { .. } => {
                    let comm = nccl.as_ref().expect("NCCL runs only with a group").clone();
                    check_case_through::<Autodiff<CudaMoe<f32>>>(&case, &options, &device, &|_| comm.clone())
                }
                CheckRun::Fused { bf16: true, .. } => {
                    check_case::<Autodiff<CudaMoe<bf16>>>(&case, &options, &device)
                }
                _ => check_case::<Autodiff<CudaMoe<f32>>>(&case, &options, &device),
            }));
            let label = format!(
                "{} {dtype} {} n={:?} {} ({:.2} s)",
                case.name,
                options.path.name(),
                options.partitions,
                options.strategy,
                start.elapsed().as_secs_f64()
            );
            match outcome {
                Ok(Ok(r)) if r.passed(tolerance) => {
                    println!("{label} ok max_rel_err={:.3e}", r.max_rel_err())
                }
                Ok(Ok(r)) => {
                    failed += 1;
                    println!(
                        "{label} FAIL max_rel_err={:.3e} (worst: {})",
                        r.max_rel_err(),
                        r.worst().name
                    );
                }
                Ok(Err(e)) => {
                    failed += 1;
                    println!("{label} FAIL error: {e}");
                }
                Err(_) => {
                    failed += 1;
                    println!("{label} FAIL panicked");
                }
            }
        }
    }
    let skipped = match &nccl {
        Ok(_) => String::new(),
        Err(why) => format!(" (NCCL checks skipped: {why})"),
    };
    println!("\n{} of {total} checks passed{skipped}", total - failed);
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
