//! The reference cases (the function they encode: `tests/data/cases/README.md`): every case
//! file through both paths, every strategy, n ∈ {1, 2, 3} and FasterMoE's split by rank,
//! ranks ∈ {1, 2, 4} where the experts divide, on NdArray and Flex.
//!
//! Cases are read from `tests/data/cases` and `tests/data/hf` (the project's copies) and from
//! `../shared/cases` and `../shared/hf` when those folders exist, so new shared cases are
//! checked as soon as they appear; a separate test fails while a copy differs from its shared
//! folder.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::backend::{Autodiff, Flex, NdArray};
use burn::tensor::backend::AutodiffBackend;
use mpipemoe::backend::StepExecutor;
use mpipemoe::harness::{agreement_error, check_case, expected, relative_error, Case, CheckOptions};
use mpipemoe::memory::Strategy;
use mpipemoe::{ExchangePath, MoeBackend, Partitions};

const TOLERANCE: f64 = 1e-4;
const STRATEGY_AGREEMENT: f64 = 1e-5;

/// The case folders: (the project's copy, the shared folder it copies).
fn folders() -> [(PathBuf, PathBuf); 2] {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    [
        (root.join("tests/data/cases"), root.join("../shared/cases")),
        (root.join("tests/data/hf"), root.join("../shared/hf")),
    ]
}

fn files_in(dir: &Path) -> BTreeMap<String, PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), p))
                .collect()
        })
        .unwrap_or_default()
}

/// The union of the local copies and the shared folders (shared wins on a name clash).
fn case_files() -> Vec<PathBuf> {
    let mut files = BTreeMap::new();
    for (local, shared) in folders() {
        files.extend(files_in(&local));
        files.extend(files_in(&shared));
    }
    // The cases of the checkpoints this project wrote with transformers (families the given
    // ones do not cover); the FP8 folder's companion file holds dequantised weights, not a case.
    let generated = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf/generated");
    files.extend(
        files_in(&generated)
            .into_iter()
            .filter(|(name, _)| name.contains(".layer")),
    );
    assert!(
        files.len() >= 8,
        "expected the 4 cases, 3 Hugging Face cases and the Llama 4 case, found {files:?}"
    );
    files.into_values().collect()
}

/// Every file under `dir`, as paths relative to it.
fn tree(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        for entry in std::fs::read_dir(dir.join(&rel)).unwrap().filter_map(|e| e.ok()) {
            let path = rel.join(entry.file_name());
            // `hf/generated/` holds checkpoints this project wrote itself with transformers
            // (each with the script that wrote it), not copies of the given ones.
            if path == Path::new("generated") {
                continue;
            }
            if entry.path().is_dir() {
                stack.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn local_copies_match_the_shared_folders() {
    for (local, shared) in folders() {
        if !shared.is_dir() {
            eprintln!("{} not present: nothing to compare", shared.display());
            continue;
        }
        let names = tree(&shared);
        for name in &names {
            let want = std::fs::read(shared.join(name)).unwrap();
            let got = std::fs::read(local.join(name)).unwrap_or_default();
            assert!(
                got == want,
                "{} differs from {}: copy it again",
                local.join(name).display(),
                shared.join(name).display()
            );
        }
        for name in tree(&local) {
            assert!(
                names.contains(&name),
                "{} is not in {}",
                local.join(&name).display(),
                shared.display()
            );
        }
    }
}

/// Every configuration a case must pass in: the reference path at each rank count, and the
/// fused path at each rank count × partitions × strategy, run by `executor` (`None`: the
/// backend's default).
fn configurations(n_experts: usize, executor: Option<StepExecutor>) -> Vec<CheckOptions> {
    let mut out = Vec::new();
    for n_ranks in [1, 2, 4].into_iter().filter(|r| n_experts.is_multiple_of(*r)) {
        out.push(CheckOptions {
            path: ExchangePath::Reference,
            n_ranks,
            ..CheckOptions::default()
        });
        let splits = [1, 2, 3].map(Partitions::Fixed).into_iter();
        // FasterMoE's split by destination rank is its own schedule only with several ranks.
        let by_rank = (n_ranks > 1).then_some(Partitions::ByRank);
        for partitions in splits.chain(by_rank) {
            for strategy in Strategy::ALL {
                out.push(CheckOptions {
                    path: ExchangePath::Fused,
                    n_ranks,
                    partitions,
                    strategy,
                    executor,
                    ..CheckOptions::default()
                });
            }
        }
    }
    out
}

fn check_all<B: AutodiffBackend + MoeBackend>(backend: &str, executor: Option<StepExecutor>) {
    let device = Default::default();
    let mut failures = Vec::new();
    for file in case_files() {
        let case = Case::load(&file).unwrap_or_else(|e| panic!("{e}"));
        // The strategy-agreement baseline for each (ranks, n): strategy `none`.
        let mut baseline: BTreeMap<(usize, String), BTreeMap<String, Vec<f64>>> = BTreeMap::new();
        for options in configurations(case.config.n_experts, executor) {
            let label = format!(
                "{backend} {} {} ranks={} {:?} {}",
                case.name,
                options.path.name(),
                options.n_ranks,
                options.partitions,
                options.strategy
            );
            let report = check_case::<B>(&case, &options, &device).unwrap_or_else(|e| panic!("{label}: {e}"));
            if !report.passed(TOLERANCE) {
                let worst = report.worst();
                failures.push(format!("{label}: {} rel err {:.3e}", worst.name, worst.rel_err));
            }
            if options.path == ExchangePath::Fused {
                let key = (options.n_ranks, format!("{:?}", options.partitions));
                match baseline.get(&key) {
                    None => {
                        baseline.insert(key, report.tensors);
                    }
                    Some(base) => {
                        for (name, got) in &report.tensors {
                            let err = agreement_error(got, &base[name], &expected(&case, name));
                            if err > STRATEGY_AGREEMENT {
                                failures
                                    .push(format!("{label}: {name} differs from strategy none by {err:.3e}"));
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// NdArray with the threaded executor: a step of one partition runs while steps of others run
/// on the other streams, so a dependency the schedule misses shows up here.
#[test]
fn every_case_every_configuration_ndarray_threaded() {
    check_all::<Autodiff<NdArray>>("ndarray threads", Some(StepExecutor::StreamThreads));
}

/// Flex with its default executor (in order), as users run it.
#[test]
fn every_case_every_configuration_flex() {
    check_all::<Autodiff<Flex>>("flex", None);
}

/// The float64 oracle that generated cases rely on reproduces every shared case.
#[test]
fn the_float64_oracle_reproduces_every_case() {
    for file in case_files() {
        let case = Case::load(&file).unwrap();
        let inputs = case
            .tensors
            .iter()
            .filter(|(name, _)| !name.starts_with("grad.") && *name != "y" && *name != "dx")
            .map(|(n, d)| (n.clone(), d.clone()))
            .collect();
        let regenerated = Case::from_parts(&case.name, &case.config, inputs).unwrap();
        for (name, _) in case.expected_shapes() {
            let err = relative_error(
                &regenerated
                    .tensor(&name)
                    .clone()
                    .convert::<f64>()
                    .into_vec::<f64>()
                    .unwrap(),
                &case
                    .tensor(&name)
                    .clone()
                    .convert::<f64>()
                    .into_vec::<f64>()
                    .unwrap(),
            );
            assert!(err < 1e-5, "{}: oracle's {name} differs by {err:e}", case.name);
        }
    }
}

#[test]
fn bad_case_files_name_the_file_and_tensor() {
    let dir = std::env::temp_dir().join(format!("mpipemoe-badcase-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let missing = dir.join("does_not_exist.safetensors");
    let err = Case::load(&missing).unwrap_err().to_string();
    assert!(
        err.contains("does_not_exist.safetensors") && err.contains("cannot read"),
        "{err}"
    );

    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file at all").unwrap();
    let err = Case::load(&garbage).unwrap_err().to_string();
    assert!(
        err.contains("garbage.safetensors") && err.contains("not a safetensors file"),
        "{err}"
    );

    // A real case with one tensor removed, one reshaped, and one with bad meta.
    let source = case_files()[0].clone();
    let case = Case::load(&source).unwrap();
    let write = |name: &str, edit: &dyn Fn(&mut BTreeMap<String, burn::tensor::TensorData>, &mut String)| {
        let mut tensors = case.tensors.clone();
        let mut meta = serde_json::to_string(&case.meta).unwrap();
        edit(&mut tensors, &mut meta);
        let path = dir.join(name);
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(
                        safetensors::Dtype::F32,
                        d.shape.to_vec(),
                        d.as_bytes(),
                    )
                    .unwrap(),
                )
            })
            .collect();
        let info = std::collections::HashMap::from([("meta".to_string(), meta)]);
        std::fs::write(&path, safetensors::serialize(views, Some(info)).unwrap()).unwrap();
        path
    };
    let path = write("no_router.safetensors", &|t, _| {
        t.remove("router.weight");
    });
    let err = Case::load(&path).unwrap_err().to_string();
    assert!(
        err.contains("no_router.safetensors") && err.contains("missing tensor `router.weight`"),
        "{err}"
    );

    let path = write("bad_shape.safetensors", &|t, _| {
        let d = t["experts.w_out"].clone();
        let dims = d.shape.to_vec();
        let flat = burn::tensor::TensorData::from_bytes_vec(
            d.as_bytes().to_vec(),
            vec![dims.iter().product::<usize>()],
            d.dtype,
        );
        t.insert("experts.w_out".into(), flat);
    });
    let err = Case::load(&path).unwrap_err().to_string();
    assert!(
        err.contains("bad_shape.safetensors") && err.contains("tensor `experts.w_out` has shape"),
        "{err}"
    );

    let path = write("bad_meta.safetensors", &|_, m| {
        *m = m.replace("\"top_k\"", "\"topk\"");
    });
    let err = Case::load(&path).unwrap_err().to_string();
    assert!(
        err.contains("bad_meta.safetensors") && err.contains("top_k"),
        "{err}"
    );

    let path = write("bad_activation.safetensors", &|_, m| {
        *m = m.replace(&format!("\"{}\"", case.meta.activation), "\"tanh\"");
    });
    let err = Case::load(&path).unwrap_err().to_string();
    assert!(err.contains("activation") && err.contains("tanh"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// The project stands alone: a clone has no `../shared`, so the library, the tools, the
/// examples and the docs never point there (only tests and scripts read ground truth from it,
/// and the project keeps copies of what they read). The cases' and checkpoints' formats are
/// described by the copies' READMEs in `tests/data`.
#[test]
fn nothing_outside_the_tests_points_at_the_shared_folder() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let places = [
        "src",
        "docs",
        "README.md",
        "Cargo.toml",
        "tools/src",
        "tools/examples",
        "tools/benches",
        "tools/Cargo.toml",
        "backend-ext/src",
        "backend-ext/examples",
        "backend-ext/Cargo.toml",
    ];
    let patterns = [
        "../shared",
        "shared/cases",
        "shared/hf",
        "shared/paper",
        "shared/gpu",
        "shared/notes",
        "DESIGN.md",
        "DESIGN §",
    ];
    let mut files = Vec::new();
    for place in places {
        let path = root.join(place);
        if path.is_file() {
            files.push(path);
        } else {
            files.extend(tree(&path).into_iter().map(|name| path.join(name)));
        }
    }
    assert!(files.len() > 50, "the walk found only {} files", files.len());
    let mut found = Vec::new();
    for file in &files {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        for (number, line) in text.lines().enumerate() {
            if let Some(p) = patterns.iter().find(|p| line.contains(*p)) {
                found.push(format!("{}:{}: {p}", file.display(), number + 1));
            }
        }
    }
    assert!(found.is_empty(), "references to ../shared:\n{}", found.join("\n"));
}

/// Shadowing (issue 45) changes where rows are computed, never the result: every case at 2
/// and 4 ranks, both paths, n ∈ {1, 3}, every strategy, with the
/// hottest expert shadowed (one shadowed, the others not) and with all but one shadowed,
/// equals the same configuration without shadows to 1e-5 and the case to 1e-4. Each run
/// must report the shadows it was given, so a layer that ignored the setting fails.
#[test]
fn shadowed_experts_change_no_output_or_gradient() {
    use mpipemoe::Shadowing;
    let device = Default::default();
    let mut failures = Vec::new();
    let mut runs = 0;
    for file in case_files() {
        let case = Case::load(&file).unwrap_or_else(|e| panic!("{e}"));
        let n_experts = case.config.n_experts;
        for n_ranks in [2, 4].into_iter().filter(|r| n_experts.is_multiple_of(*r)) {
            let mut configs = vec![CheckOptions {
                path: ExchangePath::Reference,
                n_ranks,
                ..CheckOptions::default()
            }];
            for partitions in [Partitions::Fixed(1), Partitions::Fixed(3)] {
                for strategy in Strategy::ALL {
                    configs.push(CheckOptions {
                        n_ranks,
                        partitions,
                        strategy,
                        ..CheckOptions::default()
                    });
                }
            }
            for base in configs {
                let label = format!(
                    "{} {} ranks={} {:?} {}",
                    case.name,
                    base.path.name(),
                    n_ranks,
                    base.partitions,
                    base.strategy
                );
                let plain = check_case::<Autodiff<NdArray>>(&case, &base, &device)
                    .unwrap_or_else(|e| panic!("{label}: {e}"));
                assert!(plain.shadows.is_empty(), "{label}: shadows without shadowing");
                for k in [1, n_experts - 1] {
                    let options = CheckOptions {
                        shadowing: Shadowing::Fixed(k),
                        ..base
                    };
                    let report = check_case::<Autodiff<NdArray>>(&case, &options, &device)
                        .unwrap_or_else(|e| panic!("{label} Fixed({k}): {e}"));
                    runs += 1;
                    if report.shadows.len() != k {
                        failures.push(format!("{label} Fixed({k}): shadowed {:?}", report.shadows));
                    }
                    if !report.passed(TOLERANCE) {
                        let worst = report.worst();
                        failures.push(format!(
                            "{label} Fixed({k}): {} rel err {:.3e}",
                            worst.name, worst.rel_err
                        ));
                    }
                    for (name, got) in &report.tensors {
                        let err = agreement_error(got, &plain.tensors[name], &expected(&case, name));
                        if err > STRATEGY_AGREEMENT {
                            failures.push(format!(
                                "{label} Fixed({k}): {name} differs from the unshadowed layer by {err:.3e}"
                            ));
                        }
                    }
                }
            }
        }
    }
    assert!(runs > 0, "no case could be sharded");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
