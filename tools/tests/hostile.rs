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
        // A missing flag one direction needs (exit 1, "invalid config", before).
        (
            vec!["convert", "--from-hf", s(&case), "--out", "/nonexistent/x"],
            "--layer",
        ),
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
    // Experts per GPU and partitions each in range, together a replay of 4G (partition,
    // expert) pairs (32 GB of row counts before this bound): refused, naming both flags.
    for command in ["plan", "simulate"] {
        let mut args = vec![command];
        args.extend([
            "--d-model",
            "1",
            "--d-hidden",
            "1",
            "--experts",
            "1048576",
            "--gpus",
            "1",
        ]);
        if command == "plan" {
            args.extend(["--partitions", "4096"]);
        }
        refused(&args, 2, &["--experts", "--partitions"]);
    }
    // The simulator's shadowing prediction over 2,048 experts and as many GPUs, in range: the
    // search recounted every rank and expert for every candidate, work that grows with the
    // cube of the count (4,096 of each took 4.5 minutes in a release build, so this eighth of
    // it past the bound's minute in the tests' debug build); now it ends in about a second.
    let run = bounded(
        &[
            "simulate",
            "--d-model",
            "1",
            "--d-hidden",
            "1",
            "--experts",
            "4096",
            "--gpus",
            "4096",
            "--tokens",
            "100",
            "--skew",
            "zipf:1.2",
            "--json",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(run.code, Some(0), "{}", run.stderr);
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

/// Every file of `dir` (not recursive) with its bytes: what "the input was never touched"
/// compares.
fn snapshot(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

/// A copy of the tiny Mixtral (with its tokenizer) in `dir/name`, with `edit` applied to its
/// `config.json`.
fn model_copy(dir: &Path, name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let model = dir.join(name);
    copy_dir(&data().join("models/mixtral-tiny"), &model);
    let path = model.join("config.json");
    let mut config: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, serde_json::to_vec(&config).unwrap()).unwrap();
    model
}

/// `finetune --out` never replaces, deletes or writes into the model it reads: not the
/// folder itself (exit 0 and a replaced checkpoint before), not a folder containing it with
/// `--overwrite` (which deleted the input with it before), not a folder inside it, however
/// spelled. Writing over the model takes `--in-place`, which replaces it only once the new
/// folder is complete.
#[test]
fn finetune_never_writes_over_or_around_its_input() {
    let dir = scratch_dir("cli-hostile-finetune-out");
    let parent = dir.join("parent");
    std::fs::create_dir_all(&parent).unwrap();
    let model = model_copy(&parent, "model", |_| {});
    // The text apart from both, so that only the model decides each refusal here.
    let text_dir = scratch_dir("cli-hostile-finetune-out-text");
    let text = text_dir.join("text.txt");
    std::fs::write(&text, "the layer routes every token to its experts. ".repeat(40)).unwrap();
    let before = snapshot(&model);
    let finetune = |out: &[&str], extra: &[&str]| {
        let mut args = vec![
            "finetune",
            s(&model),
            "--data",
            s(&text),
            "--steps",
            "1",
            "--batch",
            "2",
            "--seq-len",
            "8",
        ];
        args.extend_from_slice(out);
        args.extend_from_slice(extra);
        args.iter().map(|a| a.to_string()).collect::<Vec<_>>()
    };
    let dotted = format!("{}/../model/.", model.display());
    let inside = model.join("trained");
    for (out, extra, needle) in [
        (s(&model), &[][..], "source checkpoint itself"),
        (&dotted[..], &["--overwrite"][..], "source checkpoint itself"),
        (s(&parent), &["--overwrite"][..], "contains the input"),
        (s(&dir), &["--overwrite"][..], "contains the input"),
        (s(&inside), &[][..], "lies inside the input"),
    ] {
        let args = finetune(&["--out", out], extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refused(&args, 1, &[needle]);
        assert_eq!(snapshot(&model), before, "{out}: the input changed");
        assert!(!inside.exists());
    }
    // --in-place: the model is replaced whole, and nothing is left beside it.
    let args = finetune(&[], &["--in-place", "--lr", "1e-2"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = bounded(&args, Duration::from_secs(120));
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let after = snapshot(&model);
    assert_eq!(after.len(), before.len());
    assert_ne!(after, before, "trained weights were written over the model");
    let beside: Vec<String> = std::fs::read_dir(&parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(beside, ["model"], "{beside:?}");
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&text_dir).ok();
}

/// A learning rate PyTorch's AdamW refuses is a usage error; a run that diverges ends with an
/// error and writes nothing (before, `--lr NaN` wrote an all-NaN checkpoint with exit 0).
#[test]
fn finetune_refuses_a_bad_learning_rate_and_saves_nothing_from_a_diverged_run() {
    let dir = scratch_dir("cli-hostile-finetune-lr");
    let model = data().join("models/mixtral-tiny");
    let text = dir.join("text.txt");
    std::fs::write(&text, "the layer routes every token to its experts. ".repeat(40)).unwrap();
    let out = dir.join("out");
    let base = [
        "finetune",
        s(&model),
        "--data",
        s(&text),
        "--out",
        s(&out),
        "--batch",
        "2",
        "--seq-len",
        "8",
    ];
    for lr in ["--lr=NaN", "--lr=-1", "--lr=inf"] {
        let mut args = base.to_vec();
        args.extend(["--steps", "1", lr]);
        refused(&args, 2, &["--lr"]);
    }
    // Flags that disagree with their range or each other are usage errors naming the flags,
    // said before the model or the data is read.
    for (flags, says) in [
        (
            &["--lora-rank", "2", "--lora-targets", "q_proj, bogus"][..],
            &["--lora-targets", "`bogus`"][..],
        ),
        (
            &["--lora-rank", "2", "--lora-dropout", "0.5"][..],
            &["--lora-dropout"][..],
        ),
        (&["--ranks", "3"][..], &["--batch 2", "--ranks 3"][..]),
        (
            &["--ranks", "2", "--expert-parallel", "3"][..],
            &["--expert-parallel 3"][..],
        ),
    ] {
        let mut args = base.to_vec();
        args.extend(["--steps", "1"]);
        args.extend(flags);
        refused(&args, 2, says);
    }
    // More positions than the model has, refused before loading it for training.
    let args = [
        "finetune",
        s(&model),
        "--data",
        s(&text),
        "--out",
        s(&out),
        "--steps",
        "1",
        "--seq-len",
        "200",
    ];
    refused(&args, 1, &["max_position_embeddings", "128"]);
    // An --out that holds the training text would delete it.
    let args = [
        "finetune",
        s(&model),
        "--data",
        s(&text),
        "--out",
        s(&dir),
        "--overwrite",
        "--steps",
        "1",
    ];
    refused(&args, 2, &["--out", "contains the input"]);
    assert!(text.exists());
    let mut args = base.to_vec();
    args.extend(["--steps", "4", "--lr", "1e30"]);
    refused(&args, 1, &["diverged", "nothing was saved"]);
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// `logits` and `generate` bound what they are asked for by the model: ids inside the
/// vocabulary (a panic inside burn before), positions within `max_position_embeddings`
/// (a multi-gigabyte `[T, T]` allocation or a run until killed before), each refused at once
/// by name; `logits --out` never lands inside the model folder.
#[test]
fn logits_and_generate_refuse_ids_and_lengths_the_model_cannot_take() {
    let dir = scratch_dir("cli-hostile-lm");
    let model = data().join("models/mixtral-tiny");
    let out = dir.join("logits.safetensors");
    let before = snapshot(&model);
    refused(
        &["logits", s(&model), "--ids", "1,96", "--out", s(&out)],
        1,
        &["96", "vocabulary"],
    );
    let long = vec!["1"; 129].join(",");
    refused(
        &["logits", s(&model), "--ids", &long, "--out", s(&out)],
        1,
        &["max_position_embeddings", "128"],
    );
    assert!(!out.exists());
    // Ids as people type them, with spaces after the commas, are the same ids; what is not
    // an id is named.
    refused(
        &["logits", s(&model), "--ids", "1,x", "--out", s(&out)],
        2,
        &["`x` is not a token id"],
    );
    let spaced = bounded(
        &["logits", s(&model), "--ids", "1, 5,9 ", "--out", s(&out)],
        Duration::from_secs(60),
    );
    assert_eq!(spaced.code, Some(0), "{}", spaced.stderr);
    let with_spaces = std::fs::read(&out).unwrap();
    let plain = bounded(
        &[
            "logits",
            s(&model),
            "--ids",
            "1,5,9",
            "--out",
            s(&out),
            "--overwrite",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(plain.code, Some(0), "{}", plain.stderr);
    assert_eq!(std::fs::read(&out).unwrap(), with_spaces);
    std::fs::remove_file(&out).unwrap();
    let start = Instant::now();
    refused(
        &[
            "generate",
            s(&model),
            "--ids",
            "1,5,9",
            "--max-new-tokens",
            "1048576",
        ],
        1,
        &["max_position_embeddings"],
    );
    refused(
        &["generate", s(&model), "--ids", "1,5,9", "--max-new-tokens", "126"],
        1,
        &["129 positions"],
    );
    assert!(start.elapsed() < Duration::from_secs(60));
    let inside = model.join("logits.safetensors");
    refused(
        &["logits", s(&model), "--ids", "1,5", "--out", s(&inside)],
        2,
        &["lies inside the input"],
    );
    assert_eq!(snapshot(&model), before);
    std::fs::remove_dir_all(&dir).ok();
}

/// Sizes in `config.json` are held to the stored tensors before anything is allocated from
/// them: a huge `head_dim`, a huge expert count, absurd products; and a YaRN config without
/// `factor` is refused naming the key (it derived a factor of 0 before and failed far away).
#[test]
fn model_configs_with_absurd_sizes_are_refused_by_name_before_allocating() {
    let dir = scratch_dir("cli-hostile-configs");
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, Vec<&str>)> = vec![
        (
            "head-dim",
            Box::new(|c| c["head_dim"] = serde_json::json!(1u64 << 31)),
            vec!["q_proj", "shape"],
        ),
        (
            "experts",
            Box::new(|c| c["num_local_experts"] = serde_json::json!(1u64 << 31)),
            vec!["config.json", "experts", "router"],
        ),
        (
            "heads",
            Box::new(|c| {
                c["num_attention_heads"] = serde_json::json!(1u64 << 32);
                c["num_key_value_heads"] = serde_json::json!(1u64 << 32);
                c["head_dim"] = serde_json::json!(1u64 << 32);
            }),
            vec!["head_dim", "over"],
        ),
        (
            "yarn",
            Box::new(|c| {
                c["rope_parameters"] = serde_json::json!({
                    "rope_type": "yarn", "rope_theta": 10000.0,
                    "original_max_position_embeddings": 32
                });
                c["max_position_embeddings"] = serde_json::json!(0);
            }),
            vec!["config.json", "factor"],
        ),
    ];
    for (name, edit, needles) in cases {
        let model = model_copy(&dir, name, |c| edit(c));
        let start = Instant::now();
        refused(
            &["generate", s(&model), "--ids", "1,5,9", "--max-new-tokens", "2"],
            1,
            &needles,
        );
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{name}: {:?}",
            start.elapsed()
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
