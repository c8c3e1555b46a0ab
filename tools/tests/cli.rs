//! The `mpipemoe` command-line tool, run as a user runs it.

#[test]
fn plan_json_equals_eq_1_to_9_by_hand_for_two_presets() {
    for (preset, m, h) in [("gpt3-s", 768.0, 3072.0), ("bert-l", 1024.0, 4096.0)] {
        let (b, e, n_gpus, n) = (8192.0, 64.0, 8.0, 4.0);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mpipemoe"))
            .args([
                "plan",
                "--preset",
                preset,
                "--tokens",
                "8192",
                "--gpus",
                "8",
                "--partitions",
                "4",
                "--json",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let paper = &json["paper"];
        let local = e / n_gpus;
        let m_ms = 4.0 * (e * m + 2.0 * h * m * local);
        let m_act = 4.0 * b * m + b * h;
        let m_buf = b * m + b * h;
        let delta = b * (2.0 * m * (n - 2.0) / n + h * (n - 1.0) / n);
        let phi = 2.0 * delta / (m_ms + 2.0 * m_act);
        for (key, want) in [
            ("m_ms", m_ms),
            ("m_act", m_act),
            ("m_buf", m_buf),
            ("m_act_pipe", m_act),
            ("delta_m_act", delta),
            ("delta_m_buf", delta),
            ("phi", phi),
        ] {
            let got = paper[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{preset}: no paper.{key}"));
            assert!(
                (got - want).abs() <= 1e-9 * want.abs(),
                "{preset} {key}: {got} vs {want}"
            );
            assert!(
                json["implementation"][key].is_number(),
                "{preset}: no implementation.{key}"
            );
        }
    }
}

fn mpipemoe(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_mpipemoe"))
        .args(args)
        .output()
        .unwrap()
}

fn hf_data() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/hf")
}

/// `convert --from-hf` writes the expected case's canonical tensors exactly; `check` accepts
/// that file (against the float64 oracle); `convert --to-hf` gives the checkpoint back byte for
/// byte; `inspect` lists the MoE layers; a dense layer is an error naming it.
#[test]
fn convert_check_and_inspect_on_the_hugging_face_checkpoints() {
    let dir = std::env::temp_dir().join(format!("mpipemoe-cli-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (folder, layer) in [
        ("mixtral-tiny", "1"),
        ("qwen2-moe-tiny", "0"),
        ("deepseek-v3-tiny", "1"),
    ] {
        let ckpt = hf_data().join(folder);
        let file = dir.join(format!("{folder}.safetensors"));
        let out = mpipemoe(&[
            "convert",
            "--from-hf",
            ckpt.to_str().unwrap(),
            "--layer",
            layer,
            "--out",
            file.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let (got, _) = mpipemoe::format::read_safetensors(&file).unwrap();
        let case = hf_data().join(format!("{folder}.layer{layer}.safetensors"));
        let (want, _) = mpipemoe::format::read_safetensors(&case).unwrap();
        for (name, data) in &got {
            assert!(data.as_bytes() == want[name].as_bytes(), "{folder}: {name}");
        }
        let out = mpipemoe(&[
            "check",
            "--ranks",
            "2",
            "--partitions",
            "2",
            "--strategy",
            "s4",
            file.to_str().unwrap(),
        ]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(" ok ") && stdout.contains("oracle"),
            "{stdout}"
        );

        let back = dir.join(format!("{folder}-back"));
        let out = mpipemoe(&[
            "convert",
            "--to-hf",
            ckpt.to_str().unwrap(),
            "--input",
            file.to_str().unwrap(),
            "--out",
            back.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        for entry in std::fs::read_dir(&ckpt).unwrap() {
            let name = entry.unwrap().file_name();
            assert!(
                std::fs::read(ckpt.join(&name)).unwrap() == std::fs::read(back.join(&name)).unwrap(),
                "{folder}/{}",
                name.to_string_lossy()
            );
        }
    }
    let out = mpipemoe(&["inspect", hf_data().join("qwen2-moe-tiny").to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("qwen2_moe") && stdout.contains("2 MoE layers"),
        "{stdout}"
    );
    let out = mpipemoe(&[
        "convert",
        "--from-hf",
        hf_data().join("deepseek-v3-tiny").to_str().unwrap(),
        "--layer",
        "0",
        "--out",
        dir.join("dense.safetensors").to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("dense MLP") && stderr.contains("config.json"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `plan --budget`: the worst rank of a skewed batch against a per-rank budget. A budget that
/// fits gives the smallest n and a strategy whose modelled peak (with headroom) is under it,
/// and every smaller n was over it; one below the floor is an answer too (exit 0).
#[test]
fn plan_with_a_budget_answers_fits_or_not() {
    let base = [
        "plan",
        "--preset",
        "gpt3-s",
        "--tokens",
        "4096",
        "--gpus",
        "8",
        "--imbalance",
        "3",
        "--json",
    ];
    let run = |budget: &str| -> serde_json::Value {
        let out = mpipemoe(&[&base[..], &["--budget", budget]].concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["budget"].clone()
    };
    let mib = 1024 * 1024;
    let answer = run(&(400 * mib).to_string());
    assert_eq!(answer["fits"], true, "{answer}");
    let (n, peak) = (
        answer["n"].as_u64().unwrap(),
        answer["worst_rank_peak_bytes"].as_f64().unwrap(),
    );
    assert!(peak * answer["headroom"].as_f64().unwrap() <= (400 * mib) as f64);
    for c in answer["candidates"].as_array().unwrap() {
        if c["n_partitions"].as_u64().unwrap() < n {
            assert_eq!(c["fits"], false, "a smaller n fits: {c}");
        }
    }
    assert!(n > 1, "400 MiB should not fit at n = 1 with 3x skew: {answer}");
    assert_eq!(
        answer["route"]["PartitionScratch"]["operands"], "F32",
        "the default route: {answer}"
    );
    // The experts' route is the model's: each gives its own peaks.
    let peak_on = |route: &[&str]| -> f64 {
        let out = mpipemoe(&[&base[..], &["--budget", "1000"], route].concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let json = serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap();
        json["budget"]["candidates"][0]["peak_bytes"].as_f64().unwrap()
    };
    let scratch = peak_on(&[]);
    let tasks = peak_on(&["--route", "tasks", "--concurrent", "2"]);
    let primitives = peak_on(&["--route", "expert-by-expert"]);
    assert!(
        scratch != tasks && scratch != primitives && tasks != primitives,
        "{scratch} {tasks} {primitives}"
    );
    // The primitives with their products on a library: as the primitives in f32; at bf16
    // each product's section holds copies of its operands besides.
    let on_library = |precision| peak_on(&["--route", "library-products", "--gemm-precision", precision]);
    assert_eq!(on_library("f32"), primitives);
    assert!(on_library("bf16") >= primitives, "{primitives}");
    // Eight GPUs: the threaded executor by default on the cuBLAS route (CUDA's above one
    // rank), which holds more than issue order (the assembled rows from the start, the
    // gradients handed back as copies).
    assert_eq!(answer["threaded"], true, "{answer}");
    let in_order = peak_on(&["--executor", "in-order"]);
    assert!(in_order < scratch, "{in_order} {scratch}");
    assert_eq!(peak_on(&["--executor", "threads"]), scratch);
    // At bf16 the cuBLAS route holds its operands' copies besides half its scratch; a step's
    // copies live through the forward's peak and the backward's.
    let bf16 = peak_on(&["--gemm-precision", "bf16"]);
    let for_step = peak_on(&["--gemm-precision", "bf16", "--bf16-weights-per-step"]);
    assert!(bf16 != scratch && for_step >= bf16, "{scratch} {bf16} {for_step}");
    // A shared expert on every token holds its products, its SwiGLU's state and its
    // gradients besides the routed experts': at least its weights' gradients (3 · M · Hs).
    let shared = peak_on(&["--shared-expert", "3072"]);
    assert!(
        shared >= scratch + 3.0 * 768.0 * 3072.0 * 4.0,
        "{scratch} {shared}"
    );
    // Under the overlap the shared expert's state is live through the exchange's forward,
    // where S1 peaks at this shape: the gated one (the default, Qwen2-MoE's) keeps its output
    // before the gate and the gate's scores, `T · (M + 1)` values, which the ungated one
    // (DeepSeek's) does not; the flag's shape says which it took.
    let s1_forward = |flags: &[&str]| -> (f64, serde_json::Value) {
        let shape = [
            "plan",
            "--tokens",
            "16384",
            "--d-model",
            "1024",
            "--d-hidden",
            "4096",
            "--experts",
            "8",
            "--gpus",
            "1",
            "--top-k",
            "2",
            "--shared-expert",
            "4096",
            "--partitions",
            "1",
            "--shared-expert-overlap",
            "--json",
        ];
        let out = mpipemoe(&[&shape[..], flags].concat());
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let json = serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap();
        let s1 = json["strategies"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s[0] == "S1")
            .expect("an S1 entry")[1]["forward"]["elements"]
            .as_f64()
            .unwrap();
        (s1, json["shape"]["shared_expert_gate"].clone())
    };
    let (gated, says_gated) = s1_forward(&[]);
    let (ungated, says_ungated) = s1_forward(&["--shared-expert-ungated"]);
    assert_eq!((says_gated, says_ungated), (true.into(), false.into()));
    assert_eq!(gated - ungated, 16384.0 * 1025.0, "{gated} {ungated}");
    let out = mpipemoe(&["plan", "--preset", "gpt3-s", "--shared-expert-ungated"]);
    assert_eq!(out.status.code(), Some(2), "the flag needs --shared-expert");
    // The simulator times no shared expert, so it refuses one by name.
    let out = mpipemoe(&["simulate", "--preset", "gpt3-s", "--shared-expert", "3072"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--shared-expert"), "{err}");
    for (flags, says) in [
        (&["--bf16-weights-per-step"][..], "--gemm-precision bf16"),
        (
            &["--route", "tasks", "--gemm-precision", "bf16"][..],
            "partition-scratch or library-products only",
        ),
        (
            &[
                "--route",
                "library-products",
                "--gemm-precision",
                "bf16",
                "--bf16-weights-per-step",
            ][..],
            "partition-scratch only",
        ),
        (
            &["--gemm-precision", "bf16", "--dtype", "bf16"][..],
            "--dtype f32",
        ),
    ] {
        let out = mpipemoe(&[&base[..], &["--budget", "1000"], flags].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(says), "{flags:?}: {err}");
    }
    // A budget with a unit is the same bytes; the paper's spelling of a preset is the preset.
    assert_eq!(run("400MiB"), answer);
    assert_eq!(run("0.390625 GiB"), answer);
    let paper_base = base.map(|a| if a == "gpt3-s" { "GPT3-S" } else { a });
    let paper = mpipemoe(&[&paper_base[..], &["--budget", "400MiB"]].concat());
    assert!(
        paper.status.success(),
        "{}",
        String::from_utf8_lossy(&paper.stderr)
    );
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&paper.stdout).unwrap()["budget"],
        answer
    );
    // The worst rank receives at least the mean and at most all 8 GPUs' rows; a budget is
    // bytes, with a unit or without.
    for (flags, says) in [
        (&["--budget", "1000", "--imbalance", "0.5"][..], "[1, 8]"),
        (&["--budget", "1000", "--imbalance", "9"][..], "[1, 8]"),
        (&["--budget", "80 parsecs"][..], "not a unit"),
        (&["--budget", "99999999TiB"][..], "more than"),
    ] {
        // The base without its own `--imbalance 3`.
        let out = mpipemoe(&[&base[..7], &base[9..], flags].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(says), "{flags:?}: {err}");
    }
    // The flags that shape the budget's answer are refused without one (they were ignored).
    for flag in [
        &["--route", "tasks"][..],
        &["--imbalance", "2"],
        &["--executor", "threads"],
    ] {
        let out = mpipemoe(&[&["plan", "--preset", "gpt3-s"][..], flag].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag:?}: {err}");
        assert!(err.contains("--budget"), "{flag:?}: {err}");
    }
    let none = run("1000");
    assert_eq!(none["fits"], false);
    assert!(none["n"].is_null() && none["strategy"].is_null() && none["worst_rank_peak_bytes"].is_null());
    assert_eq!(none["bytes"], 1000);
    assert_eq!(none["imbalance"], 3.0);
}

/// A reader that goes away (`mpipemoe plan | head -1`) ends the command quietly with the
/// status of a process ended by SIGPIPE (141), not with a panic's message and backtrace;
/// output the reader takes is printed as before. Without the handling, std's print macro
/// panics ("failed printing to stdout") and the test fails on the status and the message.
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    let (reader, writer) = std::io::pipe().unwrap();
    // The pipe has no reader before the command writes its first line.
    drop(reader);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mpipemoe"))
        .args(["plan", "--preset", "gpt3-s"])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{err}");
    assert!(err.is_empty(), "{err}");
    let out = mpipemoe(&["plan", "--preset", "gpt3-s"]);
    assert!(out.status.success() && out.stdout.starts_with(b"B=8192 tokens/GPU"));
}

/// `--backend wgpu` runs the cases on burn's WGPU backend when the tool is built with the
/// `wgpu` feature (CI: Mesa's software Vulkan driver), and is a clear usage error otherwise.
#[test]
fn check_on_the_wgpu_backend_or_a_clear_error_without_it() {
    let cases = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/cases");
    let case = cases.join("top2_swiglu_normalized.safetensors");
    let case = case.to_str().unwrap();
    let out = mpipemoe(&[
        "check",
        "--backend",
        "wgpu",
        "--ranks",
        "2",
        "--partitions",
        "3",
        "--strategy",
        "s1",
        case,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if cfg!(feature = "wgpu") {
        assert!(out.status.success(), "{stdout}{stderr}");
        assert!(stdout.contains("top2_swiglu_normalized ok"), "{stdout}");
    } else {
        assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
        assert!(stderr.contains("--features wgpu"), "{stderr}");
        assert!(stdout.is_empty(), "{stdout}");
    }
}

/// `--backend wgpu-fusion` (burn's default `Wgpu`) checks a case the same way, and the CUDA
/// backends are a clear usage error (exit 2, naming the feature or the missing driver) on a
/// build or machine without CUDA, before any case is read.
#[test]
fn check_on_wgpu_with_fusion_and_cuda_refused_without_it() {
    let cases = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/cases");
    let case = cases.join("paper_top2_gelu_bias.safetensors");
    let case = case.to_str().unwrap();
    let out = mpipemoe(&[
        "check",
        "--backend",
        "wgpu-fusion",
        "--ranks",
        "2",
        "--partitions",
        "3",
        case,
    ]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    if cfg!(feature = "wgpu") {
        assert!(out.status.success(), "{stdout}{stderr}");
        assert!(stdout.contains("paper_top2_gelu_bias ok"), "{stdout}");
    } else {
        assert_eq!(out.status.code(), Some(2), "{stdout}{stderr}");
        assert!(stderr.contains("--features wgpu"), "{stderr}");
    }
    for backend in ["cuda", "cuda-fusion"] {
        let out = mpipemoe(&["check", "--backend", backend, case]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        if cfg!(feature = "cuda") && mpipemoe_tools::backends::BackendArg::Cuda.available().is_ok() {
            continue;
        }
        assert_eq!(out.status.code(), Some(2), "--backend {backend}: {stderr}");
        assert!(
            stderr.contains(&format!("--backend {backend}"))
                && (stderr.contains("--features cuda") || stderr.contains("driver")),
            "--backend {backend}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "--backend {backend}: nothing is checked");
    }
}

/// `--comm nccl` is refused before anything runs unless the backend is a CUDA one and the
/// build has NCCL; the error names the flag.
#[test]
fn nccl_ranks_need_a_cuda_backend() {
    use mpipemoe_tools::backends::BackendArg;
    use mpipemoe_tools::ranks::{check_comm, CommArg};
    let err = check_comm(CommArg::Nccl, BackendArg::Flex, 2).unwrap_err();
    assert!(err.contains("--comm nccl") && err.contains("flex"), "{err}");
    assert_eq!(check_comm(CommArg::Threads, BackendArg::Flex, 2), Ok(()));
    if !cfg!(feature = "cuda") {
        let err = check_comm(CommArg::Nccl, BackendArg::Cuda, 2).unwrap_err();
        assert!(err.contains("--features cuda"), "{err}");
    }
}

/// `generate` prints transformers' greedy ids for the tiny Mixtral (the expected ids are in
/// its `.expected.safetensors`, from `generate(do_sample=False)`), at one rank and with the
/// experts sharded over two, three partitions, S4; `--repeats` times each run and answers the
/// same ids; `logits` writes `[T, vocab]`.
#[test]
fn generate_and_logits_on_a_tiny_model() {
    let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/models");
    let bytes = std::fs::read(models.join("mixtral-tiny.expected.safetensors")).unwrap();
    let expected = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ints = |name: &str| -> Vec<String> {
        let t = expected.tensor(name).unwrap();
        t.data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()).to_string())
            .collect()
    };
    let (prompt, greedy) = (ints("prompt").join(","), ints("greedy").join(","));
    let dir = models.join("mixtral-tiny");
    let dir = dir.to_str().unwrap();
    for (extra, runs) in [
        (&["--repeats", "3"][..], 3),
        (&["--ranks", "2", "--partitions", "3", "--strategy", "s4"][..], 1),
    ] {
        let mut args = vec!["generate", dir, "--ids", &prompt, "--max-new-tokens", "32"];
        args.extend_from_slice(extra);
        let out = mpipemoe(&args);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "{stderr}");
        // One timing line a run, each of the 32 new tokens, and no note of differing ids.
        let timed: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("generated 32 tokens"))
            .collect();
        assert_eq!(timed.len(), runs, "{stderr}");
        if runs > 1 {
            assert!(
                timed[runs - 1].ends_with(&format!("(run {runs} of {runs})")),
                "{stderr}"
            );
        }
        assert!(!stderr.contains("other ids"), "{stderr}");
        // The ids on the first line; the folder has a tokenizer, so their text follows.
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let (ids, text) = stdout.split_once('\n').unwrap();
        assert_eq!(ids, greedy, "{extra:?}");
        assert!(!text.trim().is_empty(), "{stdout}");
    }
    let file = std::env::temp_dir().join(format!("mpipemoe-cli-logits-{}.safetensors", std::process::id()));
    let out = mpipemoe(&[
        "logits",
        dir,
        "--ids",
        "1,5,9",
        "--out",
        file.to_str().unwrap(),
        "--overwrite",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&file).unwrap();
    let _ = std::fs::remove_file(&file);
    let written = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(written.tensor("logits").unwrap().shape(), [3, 96]);
    // No run at all is refused by the flag's name.
    let out = mpipemoe(&["generate", dir, "--ids", "1,5", "--repeats", "0"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--repeats"));
    // An id outside the vocabulary is an error naming it, not a panic.
    let out = mpipemoe(&["generate", dir, "--ids", "1,500"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("500"));
}

/// `generate --ids-file` runs a batch of prompts of different lengths, left-padded: one JSON
/// line a prompt with transformers' batched greedy ids (`make_batched.py`), at one rank and
/// over two; `--prompts-file` encodes each line as `--prompt` does, and a bad file is refused
/// naming its line.
#[test]
fn generate_a_batch_of_prompts_from_a_file() {
    let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/models");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(models.join("batched.expected.json")).unwrap())
            .unwrap();
    let family = &reference["mixtral-tiny"];
    let lines: Vec<String> = family["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let ids: Vec<String> = p.as_array().unwrap().iter().map(|v| v.to_string()).collect();
            ids.join(",")
        })
        .collect();
    let dir = models.join("mixtral-tiny");
    let dir = dir.to_str().unwrap();
    let tmp = std::env::temp_dir().join(format!("mpipemoe-cli-batch-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let file = |name: &str, text: &str| {
        let path = tmp.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    };
    let ids_file = file("ids.txt", &(lines.join("\n") + "\n"));
    for extra in [
        &[][..],
        &["--ranks", "2", "--partitions", "3", "--strategy", "s4"][..],
    ] {
        let mut args = vec!["generate", dir, "--ids-file", &ids_file, "--max-new-tokens", "12"];
        args.extend_from_slice(extra);
        let out = mpipemoe(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let got: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["ids"].clone())
            .collect();
        assert_eq!(got, family["new_ids"].as_array().unwrap().clone(), "{extra:?}");
    }
    // Text lines: the first line's continuation is that of `--prompt` with the same text.
    let texts = file("prompts.txt", "the layer\r\nexperts in parallel\n");
    let out = mpipemoe(&["generate", dir, "--prompts-file", &texts, "--max-new-tokens", "6"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let first: serde_json::Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    assert_eq!(stdout.lines().count(), 2, "{stdout}");
    let alone = mpipemoe(&["generate", dir, "--prompt", "the layer", "--max-new-tokens", "6"]);
    let alone_ids = String::from_utf8_lossy(&alone.stdout)
        .lines()
        .next()
        .unwrap()
        .to_string();
    let batch_ids: Vec<String> = first["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    assert_eq!(batch_ids.join(","), alone_ids);
    for (text, wanted) in [
        ("1,2\n\n3\n", "line 2: an empty prompt"),
        ("1,2\n3,x\n", "line 2: not comma-separated token ids"),
        ("", "holds no prompt"),
    ] {
        let bad = file("bad.txt", text);
        let out = mpipemoe(&["generate", dir, "--ids-file", &bad]);
        assert_eq!(out.status.code(), Some(2), "{text:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(wanted), "{text:?}: {stderr}");
    }
    // An id outside the vocabulary names its prompt.
    let bad = file("bad.txt", "1,2\n3,500\n");
    let out = mpipemoe(&["generate", dir, "--ids-file", &bad]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("prompt 1: token id 500"));
    let _ = std::fs::remove_dir_all(&tmp);
}

/// `generate` samples as transformers' `generate(do_sample=True)` filters: `--temperature`,
/// `--top-k`, `--top-p` with `--seed` (the same seed, the same ids; top-k 1 is greedy), and
/// without flags follows the folder's `generation_config.json` (`do_sample` and its settings),
/// which `--greedy` overrides.
#[test]
fn generate_samples_with_a_seed_and_follows_the_generation_config() {
    let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/models");
    let src = models.join("mixtral-tiny");
    let ids_of = |args: &[&str]| -> String {
        let out = mpipemoe(args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap()
            .to_string()
    };
    let dir = src.to_str().unwrap();
    let base = ["generate", dir, "--ids", "1,5,9", "--max-new-tokens", "16"];
    let with = |extra: &[&'static str]| {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        ids_of(&args)
    };
    let greedy = with(&[]);
    let hot = with(&["--temperature", "1.5", "--top-p", "0.95", "--seed", "7"]);
    assert_eq!(
        hot,
        with(&["--temperature", "1.5", "--top-p", "0.95", "--seed", "7"])
    );
    assert_ne!(
        hot,
        with(&["--temperature", "1.5", "--top-p", "0.95", "--seed", "8"])
    );
    assert_ne!(hot, greedy);
    assert_eq!(with(&["--top-k", "1", "--seed", "3"]), greedy);
    // A folder whose generation_config.json samples by default.
    let copy = std::env::temp_dir().join(format!("mpipemoe-cli-genconfig-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&copy);
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    std::fs::write(
        copy.join("generation_config.json"),
        r#"{"do_sample": true, "temperature": 1.5, "top_p": 0.95, "eos_token_id": 2}"#,
    )
    .unwrap();
    let c = copy.to_str().unwrap();
    let sampled = ids_of(&[
        "generate",
        c,
        "--ids",
        "1,5,9",
        "--max-new-tokens",
        "16",
        "--seed",
        "7",
    ]);
    assert_eq!(sampled, hot, "the folder's defaults are the flags' settings");
    let forced = ids_of(&[
        "generate",
        c,
        "--ids",
        "1,5,9",
        "--max-new-tokens",
        "16",
        "--greedy",
    ]);
    assert_eq!(forced, greedy);
    let _ = std::fs::remove_dir_all(&copy);
    let out = mpipemoe(&["generate", dir, "--ids", "1", "--top-p", "1.5"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--top-p"));
}

/// `finetune` at two ranks on a text file with the folder's tokenizer writes a folder that
/// `generate --prompt` runs from; an occupied `--out`, a folder without a tokenizer and a
/// prompt without one are errors naming what is wrong.
#[test]
fn finetune_then_generate_from_text_on_a_tiny_model() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let models = root.join("tests/data/models");
    let text = root.join("docs/architecture.md");
    let out_dir = std::env::temp_dir().join(format!("mpipemoe-cli-finetune-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out_dir);
    let (dir, data, out) = (
        models.join("mixtral-tiny"),
        text.to_str().unwrap().to_string(),
        out_dir.to_str().unwrap().to_string(),
    );
    let finetune = |dir: &std::path::Path| {
        mpipemoe(&[
            "finetune",
            dir.to_str().unwrap(),
            "--data",
            &data,
            "--steps",
            "3",
            "--batch",
            "2",
            "--seq-len",
            "16",
            "--ranks",
            "2",
            "--lr",
            "1e-3",
            "--out",
            &out,
            "--json",
        ])
    };
    let run = finetune(&dir);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let summary: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(summary["steps"], 3);
    assert_eq!(summary["tokens"], 3 * 2 * 16);
    assert!(summary["final_loss"].as_f64().unwrap().is_finite());
    assert!(summary["data_tokens"].as_u64().unwrap() > 1000);
    assert!(out_dir.join("tokenizer.json").is_file() && out_dir.join("config.json").is_file());
    let gen = mpipemoe(&[
        "generate",
        &out,
        "--prompt",
        "the layer routes",
        "--max-new-tokens",
        "4",
    ]);
    assert!(gen.status.success(), "{}", String::from_utf8_lossy(&gen.stderr));
    let stdout = String::from_utf8_lossy(&gen.stdout).to_string();
    let ids = stdout.lines().next().unwrap();
    assert!((1..=4).contains(&ids.split(',').count()), "{stdout}");
    // The output is kept: a second run without --overwrite is refused before training.
    let again = finetune(&dir);
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains(&out));
    std::fs::remove_dir_all(&out_dir).unwrap();
    let bare = models.join("olmoe-tiny");
    let run = finetune(&bare);
    assert_eq!(run.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&run.stderr).contains("tokenizer.json"));
    assert!(!out_dir.exists(), "nothing written");
    let gen = mpipemoe(&["generate", bare.to_str().unwrap(), "--prompt", "the layer"]);
    assert_eq!(gen.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&gen.stderr).contains("tokenizer.json"));
    // DeepSeek-V3's bias balancing on a family without a score bias is refused before
    // training, naming the option; a negative speed is a usage error naming the flag.
    for (gamma, code, names) in [
        ("0.001", 1, "bias_update_speed"),
        ("-1", 2, "--bias-update-speed"),
    ] {
        let run = mpipemoe(&[
            "finetune",
            dir.to_str().unwrap(),
            "--data",
            &data,
            "--steps",
            "1",
            "--out",
            &out,
            &format!("--bias-update-speed={gamma}"),
        ]);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(code), "{gamma}: {stderr}");
        assert!(stderr.contains(names), "{gamma}: {stderr}");
        assert!(!out_dir.exists(), "{gamma}: nothing written");
    }
}

/// LoRA on the command line: `finetune --lora-rank` at one and at two ranks (the experts'
/// adapters sharded) trains the same adapter folder; `logits --adapter` runs it, and the
/// `--merge`d folder gives the same logits without it; `--adapter` continues training; a bad
/// adapter and flag mistakes are refused by name.
#[test]
fn lora_finetune_logits_and_merge_on_a_tiny_model() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = root.join("tests/data/models/mixtral-tiny");
    let dir = dir.to_str().unwrap();
    let data = root.join("docs/architecture.md");
    let data = data.to_str().unwrap();
    let tmp = std::env::temp_dir().join(format!("mpipemoe-cli-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let path = |name: &str| tmp.join(name).to_str().unwrap().to_string();
    let tune = |ranks: &str, out: &str, extra: &[&str]| {
        let mut args = vec![
            "finetune",
            dir,
            "--data",
            data,
            "--steps",
            "2",
            "--batch",
            "2",
            "--seq-len",
            "12",
            "--lr",
            "1e-2",
            "--ranks",
            ranks,
            "--out",
            out,
        ];
        args.extend_from_slice(extra);
        mpipemoe(&args)
    };
    let lora = [
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--lora-targets",
        "q_proj,v_proj,experts",
    ];
    for (ranks, name) in [("1", "one"), ("2", "two")] {
        let run = tune(ranks, &path(name), &lora);
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    }
    let read = |name: &str| {
        mpipemoe::format::read_safetensors(&tmp.join(name).join("adapter_model.safetensors"))
            .unwrap()
            .0
    };
    let (one, two) = (read("one"), read("two"));
    assert_eq!(one.keys().collect::<Vec<_>>(), two.keys().collect::<Vec<_>>());
    assert!(one
        .keys()
        .any(|k| k.ends_with("mlp.experts.base_layer.lora_A.weight")));
    assert!(one.keys().any(|k| k.ends_with("self_attn.v_proj.lora_B.weight")));
    for (key, a) in &one {
        let (a, b) = (a.to_vec::<f32>().unwrap(), two[key].to_vec::<f32>().unwrap());
        let scale = a.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            diff / scale < 1e-4,
            "{key}: the two-rank adapter differs by {}",
            diff / scale
        );
    }
    // The lora_B factors trained away from zero: the adapter does something.
    assert!(one.iter().filter(|(k, _)| k.contains("lora_B")).all(|(_, t)| t
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .any(|v| *v != 0.0)));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.join("one/adapter_config.json")).unwrap()).unwrap();
    assert_eq!(
        (config["r"].as_u64(), config["lora_alpha"].as_f64()),
        (Some(4), Some(8.0))
    );

    let logits = |model: &str, out: &str, adapter: Option<&str>| {
        let mut args = vec!["logits", model, "--ids", "1,5,9,13", "--out", out];
        if let Some(a) = adapter {
            args.extend(["--adapter", a]);
        }
        let run = mpipemoe(&args);
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        mpipemoe::format::read_safetensors(std::path::Path::new(out))
            .unwrap()
            .0["logits"]
            .to_vec::<f32>()
            .unwrap()
    };
    let base = logits(dir, &path("base.safetensors"), None);
    let adapted = logits(dir, &path("adapted.safetensors"), Some(&path("one")));
    assert_ne!(base, adapted, "the adapter changes the logits");
    let merged = tune("1", &path("merged"), &[&lora[..], &["--merge"]].concat());
    assert!(
        merged.status.success(),
        "{}",
        String::from_utf8_lossy(&merged.stderr)
    );
    assert!(tmp.join("merged/config.json").is_file() && !tmp.join("merged/adapter_config.json").exists());
    let from_merged = logits(&path("merged"), &path("merged.safetensors"), None);
    let scale = adapted.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = adapted
        .iter()
        .zip(&from_merged)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff / scale < 1e-4, "merged logits differ by {}", diff / scale);

    // Continuing from the adapter trains it further.
    let more = tune("2", &path("more"), &["--adapter", &path("one")]);
    assert!(more.status.success(), "{}", String::from_utf8_lossy(&more.stderr));
    assert_ne!(read("more"), one);

    // Refusals, each naming what is wrong.
    let bad = |args: &[&str], code: i32, names: &str| {
        let run = tune("1", &path("refused"), args);
        let stderr = String::from_utf8_lossy(&run.stderr).to_string();
        assert_eq!(run.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(names), "{args:?}: {stderr}");
        assert!(!tmp.join("refused").exists(), "{args:?}: nothing written");
    };
    // A target this model lacks is the model's to say (exit 1); a name no model has, and the
    // dropout's rules, are the flags' (usage errors, before the model is read).
    bad(&["--lora-rank", "2", "--lora-targets", "q_a_proj"], 1, "q_a_proj");
    bad(
        &["--lora-rank", "2", "--lora-targets", "mlp"],
        2,
        "--lora-targets: `mlp`",
    );
    // Dropout with expert targets, as PEFT refuses it; outside [0, 1).
    bad(
        &["--lora-rank", "2", "--lora-dropout", "0.1"],
        2,
        "--lora-dropout",
    );
    bad(
        &[
            "--lora-rank",
            "2",
            "--lora-targets",
            "q_proj",
            "--lora-dropout",
            "1",
        ],
        2,
        "--lora-dropout",
    );
    bad(&["--merge"], 2, "--merge");
    bad(&["--lora-alpha", "4"], 2, "--lora-rank");
    let other = root.join("tests/data/models/lora/qwen3-moe-tiny");
    bad(&["--adapter", other.to_str().unwrap()], 1, "adapter");

    // Dropout on attention adapters trains, and the folder says so for PEFT.
    let dropping = [
        "--lora-rank",
        "4",
        "--lora-targets",
        "attention",
        "--lora-dropout",
        "0.1",
    ];
    let run = tune("1", &path("dropping"), &dropping);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.join("dropping/adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["lora_dropout"].as_f64(), Some(0.1));
    std::fs::remove_dir_all(&tmp).unwrap();
}
