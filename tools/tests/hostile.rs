//! The `mpipemoe` tool against absurd flags and hostile files, run as a user runs it but under
//! a 4 GiB address-space limit and a time limit: every input gets exit 1 (bad input) or 2
//! (usage) with an error on standard error that names the flag or the file; never a panic
//! (exit 101), a signal, a runaway allocation or a hang.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "../../tests/common/mod.rs"]
mod common;
use common::{copy_dir, scratch_dir};

/// What a run of the tool gave.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs the tool with `args` under `ulimit -v` (4 GiB) and kills it after `limit`.
fn bounded(args: &[&str], limit: Duration) -> Run {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 4194304 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_mpipemoe"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > limit {
            child.kill().ok();
            child.wait().ok();
            panic!("`mpipemoe {}` ran past {limit:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (mut stdout, mut stderr) = (String::new(), String::new());
    child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    Run {
        code: status.code(),
        stdout,
        stderr,
    }
}

/// Runs the tool and asserts exit `code` with `needles` all in standard error.
fn refused(args: &[&str], code: i32, needles: &[&str]) {
    let run = bounded(args, Duration::from_secs(60));
    assert_eq!(
        run.code,
        Some(code),
        "`mpipemoe {}`: exit {:?}\nstdout: {}\nstderr: {}",
        args.join(" "),
        run.code,
        run.stdout,
        run.stderr
    );
    for needle in needles {
        assert!(
            run.stderr.contains(needle),
            "`mpipemoe {}`: stderr lacks {needle:?}: {}",
            args.join(" "),
            run.stderr
        );
    }
}

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data")
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn absurd_flags_are_usage_errors_naming_the_flag() {
    let case = data().join("hf/mixtral-tiny.layer1.safetensors");
    let max = u64::MAX.to_string();
    for (args, flag) in [
        (
            vec!["check", "--partitions", "10000000", s(&case)],
            "--partitions",
        ),
        (
            vec!["check", "--partitions", "1000000000", s(&case)],
            "--partitions",
        ),
        (vec!["check", "--ranks", "1000000", s(&case)], "--ranks"),
        (
            vec!["plan", "--preset", "gpt3-s", "--partitions", "1000000000"],
            "--partitions",
        ),
        (
            vec!["plan", "--preset", "gpt3-s", "--partitions", &max],
            "--partitions",
        ),
        (vec!["plan", "--preset", "gpt3-s", "--tokens", &max], "--tokens"),
        (vec!["profile", "--d-model", &max], "--d-model"),
        (vec!["profile", "--rows", "1000000000000"], "--rows"),
        (vec!["simulate", "--preset", "gpt3-s", "--gpus", &max], "--gpus"),
    ] {
        refused(&args, 2, &[flag]);
    }
    // Each in range, together too large: refused before allocating.
    refused(
        &[
            "profile",
            "--rows",
            "1048576",
            "--d-model",
            "1",
            "--d-hidden",
            "262144",
        ],
        2,
        &["--rows × --d-hidden"],
    );
    // More experts per token than experts.
    for command in ["plan", "simulate"] {
        let shape = [
            "--d-model",
            "8",
            "--d-hidden",
            "8",
            "--experts",
            "8",
            "--top-k",
            "9",
        ];
        let mut args = vec![command];
        args.extend(shape);
        refused(&args, 2, &["--top-k"]);
    }
    // More partitions than the case has tokens: a clear error naming the field and the file.
    refused(
        &["check", "--partitions", "4096", s(&case)],
        1,
        &["partitions", "mixtral-tiny.layer1"],
    );
}

#[test]
fn files_that_are_not_files_are_refused_without_reading_them() {
    refused(&["check", "/dev/zero"], 1, &["/dev/zero", "not a regular file"]);
    let dir = scratch_dir("cli-hostile-fifo");
    let fifo = dir.join("case.safetensors");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    refused(
        &["check", s(&fifo)],
        1,
        &["case.safetensors", "not a regular file"],
    );
    // A FIFO as a shard of a checkpoint.
    let ckpt = dir.join("ckpt");
    copy_dir(&data().join("hf/mixtral-tiny"), &ckpt);
    let index = std::fs::read_to_string(ckpt.join("model.safetensors.index.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&index).unwrap();
    let shard = json["weight_map"]["model.layers.1.block_sparse_moe.gate.weight"]
        .as_str()
        .unwrap();
    std::fs::remove_file(ckpt.join(shard)).unwrap();
    assert!(Command::new("mkfifo")
        .arg(ckpt.join(shard))
        .status()
        .unwrap()
        .success());
    let out = dir.join("out.safetensors");
    refused(
        &["convert", "--from-hf", s(&ckpt), "--layer", "1", "--out", s(&out)],
        1,
        &[shard, "not a regular file"],
    );
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn hostile_checkpoints_get_errors_naming_the_file() {
    let dir = scratch_dir("cli-hostile-ckpt");
    let edit_config = |folder: &str, name: &str, key: &str, value: serde_json::Value| -> PathBuf {
        let ckpt = dir.join(name);
        copy_dir(&data().join("hf").join(folder), &ckpt);
        let text = std::fs::read_to_string(ckpt.join("config.json")).unwrap();
        let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
        json[key] = value;
        std::fs::write(ckpt.join("config.json"), json.to_string()).unwrap();
        ckpt
    };
    let out = dir.join("out.safetensors");
    let huge = edit_config(
        "mixtral-tiny",
        "huge-experts",
        "num_local_experts",
        1_000_000_000.into(),
    );
    refused(
        &["convert", "--from-hf", s(&huge), "--layer", "1", "--out", s(&out)],
        1,
        &["config.json", "1000000000 experts"],
    );
    let layers = edit_config(
        "qwen2-moe-tiny",
        "huge-layers",
        "num_hidden_layers",
        1_000_000_000_000u64.into(),
    );
    refused(&["inspect", s(&layers)], 1, &["config.json", "num_hidden_layers"]);

    // An index that points out of the folder: nothing outside is opened.
    let ckpt = dir.join("traversal");
    copy_dir(&data().join("hf/mixtral-tiny"), &ckpt);
    let path = ckpt.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    for v in json["weight_map"].as_object_mut().unwrap().values_mut() {
        *v = "../../../../../../etc/passwd".into();
    }
    std::fs::write(&path, json.to_string()).unwrap();
    refused(
        &["convert", "--from-hf", s(&ckpt), "--layer", "1", "--out", s(&out)],
        1,
        &["model.safetensors.index.json", "not a plain file name"],
    );
    assert!(!out.exists());

    // transformers 5.x's spelling of Qwen3-MoE's expert count converts.
    let qwen3 = dir.join("qwen3");
    copy_dir(&data().join("hf/qwen2-moe-tiny"), &qwen3);
    let text = std::fs::read_to_string(qwen3.join("config.json")).unwrap();
    let text = text
        .replace("\"qwen2_moe\"", "\"qwen3_moe\"")
        .replace("\"num_experts\"", "\"num_local_experts\"");
    std::fs::write(qwen3.join("config.json"), text).unwrap();
    let run = bounded(
        &[
            "convert",
            "--from-hf",
            s(&qwen3),
            "--layer",
            "0",
            "--out",
            s(&out),
        ],
        Duration::from_secs(60),
    );
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn outputs_are_all_or_nothing_and_never_overwritten_unasked() {
    let dir = scratch_dir("cli-hostile-outputs");
    let ckpt = data().join("hf/mixtral-tiny");
    let file = dir.join("layer.safetensors");
    let from_hf = [
        "convert",
        "--from-hf",
        s(&ckpt),
        "--layer",
        "1",
        "--out",
        s(&file),
    ];
    let convert = |extra: &[&str]| {
        let mut args = from_hf.to_vec();
        args.extend_from_slice(extra);
        bounded(&args, Duration::from_secs(60))
    };
    assert_eq!(convert(&[]).code, Some(0));
    refused(&from_hf, 1, &["layer.safetensors", "--overwrite"]);
    assert_eq!(convert(&["--overwrite"]).code, Some(0));

    // A canonical file that lacks a tensor: the export fails naming the file, and the output
    // folder is not created, nor anything beside it.
    let (mut tensors, meta) = mpipemoe::format::read_safetensors(&file).unwrap();
    tensors.remove("experts.w_out");
    let broken = dir.join("broken.safetensors");
    mpipemoe::format::write_safetensors(&broken, &tensors, &meta.unwrap()).unwrap();
    let back = dir.join("back");
    refused(
        &[
            "convert",
            "--to-hf",
            s(&ckpt),
            "--input",
            s(&broken),
            "--out",
            s(&back),
        ],
        1,
        &["broken.safetensors", "experts.w_out"],
    );
    assert!(!back.exists());

    // A canonical file whose meta disagrees with its tensors (twice the experts the tensors
    // hold): refused as `check` and `load_safetensors` refuse it, naming the file and the
    // tensor, before anything is written.
    let (tensors, meta) = mpipemoe::format::read_safetensors(&file).unwrap();
    let mut meta: serde_json::Value = serde_json::from_str(&meta.unwrap()).unwrap();
    meta["E"] = serde_json::json!(meta["E"].as_u64().unwrap() * 2);
    let lying = dir.join("lying.safetensors");
    mpipemoe::format::write_safetensors(&lying, &tensors, &meta.to_string()).unwrap();
    refused(
        &[
            "convert",
            "--to-hf",
            s(&ckpt),
            "--input",
            s(&lying),
            "--out",
            s(&back),
        ],
        1,
        &["lying.safetensors", "router.weight", "has shape"],
    );
    assert!(!back.exists());
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left.len(), 3, "{left:?}");

    // A folder with another checkpoint's file: refused; with --overwrite replaced whole.
    std::fs::create_dir_all(&back).unwrap();
    std::fs::write(back.join("model.safetensors"), b"stale").unwrap();
    let to_hf = [
        "convert",
        "--to-hf",
        s(&ckpt),
        "--input",
        s(&file),
        "--out",
        s(&back),
    ];
    refused(&to_hf, 1, &["back", "not empty", "--overwrite"]);
    let mut with = to_hf.to_vec();
    with.push("--overwrite");
    let run = bounded(&with, Duration::from_secs(60));
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(!back.join("model.safetensors").exists());

    // profile --out never replaces a file unasked, and says so before measuring.
    let profile = dir.join("profile.json");
    std::fs::write(&profile, b"{}").unwrap();
    refused(
        &["profile", "--out", s(&profile)],
        2,
        &["profile.json", "--overwrite"],
    );
    assert_eq!(std::fs::read(&profile).unwrap(), b"{}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `check` prints one result line per file on standard output and its errors on standard
/// error, naming the file; a NaN input is such an error.
#[test]
fn check_errors_go_to_standard_error_naming_the_file() {
    let dir = scratch_dir("cli-hostile-check");
    let case = data().join("hf/mixtral-tiny.layer1.safetensors");
    let (mut tensors, meta) = mpipemoe::format::read_safetensors(&case).unwrap();
    let mut x: Vec<f32> = tensors["x"].clone().into_vec().unwrap();
    x[0] = f32::NAN;
    let shape = tensors["x"].shape.clone();
    tensors.insert("x".into(), burn::tensor::TensorData::new(x, shape));
    let nan = dir.join("nan-input.safetensors");
    mpipemoe::format::write_safetensors(&nan, &tensors, &meta.unwrap()).unwrap();
    let run = bounded(&["check", s(&case), s(&nan)], Duration::from_secs(120));
    assert_eq!(run.code, Some(1));
    assert!(run.stdout.contains("mixtral-tiny.layer1 ok"), "{}", run.stdout);
    assert!(run.stdout.contains("nan-input FAIL"), "{}", run.stdout);
    assert!(!run.stdout.contains("error"), "{}", run.stdout);
    assert!(
        run.stderr.contains("nan-input.safetensors") && run.stderr.contains("non-finite"),
        "{}",
        run.stderr
    );
    std::fs::remove_dir_all(&dir).ok();
}
