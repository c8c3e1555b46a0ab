//! The layer's CubeCL path on burn's WGPU backend (feature `wgpu`), checked against every
//! reference case: ranks 1 and 2, n ∈ {1, 3}, every strategy, both paths, 1e-4. On a machine
//! without a GPU it runs on Mesa's software Vulkan driver ("llvmpipe"; Debian packages
//! `mesa-vulkan-drivers` and `libvulkan1`), which `.ci/run` installs.
//!
//! `cargo test -p mpipemoe --features wgpu --test wgpu`
#![cfg(feature = "wgpu")]

use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, Wgpu};
use mpipemoe::backend::StepExecutor;
use mpipemoe::harness::{check_case, Case, CheckOptions};
use mpipemoe::{ExchangePath, MoeBackend, Partitions, Strategy};

type B = Autodiff<Wgpu>;

fn case_files() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<PathBuf> = [
        "tests/data/cases",
        "tests/data/hf",
        "../shared/cases",
        "../shared/hf",
    ]
    .iter()
    .filter_map(|dir| std::fs::read_dir(root.join(dir)).ok())
    .flat_map(|entries| entries.filter_map(|e| e.ok()).map(|e| e.path()))
    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
    .collect();
    // The shared folder's copy of a case wins; each case once.
    files.sort_by_key(|p| {
        (
            p.file_name().map(|n| n.to_owned()),
            !p.starts_with(root.join("../shared")),
        )
    });
    files.dedup_by_key(|p| p.file_name().map(|n| n.to_owned()));
    assert!(files.len() >= 7, "{files:?}");
    files
}

/// WGPU runs the schedule in order: cubecl gives each OS thread its own stream, and on WGPU a
/// tensor one thread's stream writes is not fenced against another's reading it. (CUDA, whose
/// streams are fenced by events, gets a worker per stream; the GPU check prints it.)
#[test]
fn cubecl_backends_run_in_order() {
    let device = Default::default();
    assert_eq!(
        <Wgpu as MoeBackend>::step_executor(&device),
        StepExecutor::InOrder
    );
    assert_eq!(<B as MoeBackend>::step_executor(&device), StepExecutor::InOrder);
}

#[test]
fn every_case_on_wgpu() {
    let device = Default::default();
    let mut failures = Vec::new();
    let mut runs = 0;
    for file in case_files() {
        let case = Case::load(&file).unwrap_or_else(|e| panic!("{e}"));
        for n_ranks in [1, 2].into_iter().filter(|r| case.config.n_experts % r == 0) {
            let mut options = vec![CheckOptions {
                path: ExchangePath::Reference,
                n_ranks,
                ..CheckOptions::default()
            }];
            for n in [1, 3] {
                for strategy in Strategy::ALL {
                    options.push(CheckOptions {
                        path: ExchangePath::Fused,
                        n_ranks,
                        partitions: Partitions::Fixed(n),
                        strategy,
                        memory_budget: None,
                        executor: None,
                    });
                }
            }
            for o in options {
                let label = format!(
                    "{} {} ranks={} {:?} {}",
                    case.name,
                    o.path.name(),
                    o.n_ranks,
                    o.partitions,
                    o.strategy
                );
                match check_case::<B>(&case, &o, &device) {
                    Ok(report) if report.passed(1e-4) => {}
                    Ok(report) => failures.push(format!("{label}: {:?}", report.worst())),
                    Err(e) => failures.push(format!("{label}: {e}")),
                }
                runs += 1;
            }
        }
    }
    eprintln!("{runs} configurations checked on wgpu");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
