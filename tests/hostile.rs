//! Files from strangers: checkpoints, indexes, configs and case files that lie, point out of
//! their folder, are truncated or are not files at all. Each must give an error that names the
//! file (and the field or tensor), never a panic, an unbounded allocation or a hang.
//! `tools/tests/hostile.rs` runs the same classes through the command-line tool under an
//! address-space limit.

use std::path::{Path, PathBuf};

use mpipemoe::format::read_safetensors;
use mpipemoe::harness::Case;
use mpipemoe::hf::{self, ExportOptions, HfLayer, ImportOptions};
use proptest::prelude::*;
use serde_json::Value;

mod common;
use common::{copy_dir, scratch_dir};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf")
}

/// A copy of checkpoint `folder` in `dir` with `edit` applied to its config.json.
fn with_config(dir: &Path, folder: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let ckpt = dir.join(folder);
    copy_dir(&data().join(folder), &ckpt);
    let mut json: Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("config.json")).unwrap()).unwrap();
    edit(&mut json);
    std::fs::write(
        ckpt.join("config.json"),
        serde_json::to_string_pretty(&json).unwrap(),
    )
    .unwrap();
    ckpt
}

/// A copy of checkpoint `folder` in `dir` with `edit` applied to its index's weight map.
fn with_index(dir: &Path, folder: &str, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> PathBuf {
    let ckpt = dir.join(folder);
    copy_dir(&data().join(folder), &ckpt);
    let path = ckpt.join("model.safetensors.index.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(json["weight_map"].as_object_mut().unwrap());
    std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
    ckpt
}

/// Layer 1's router in the Mixtral checkpoint: every read of that layer touches its shard.
const ROUTER: &str = "model.layers.1.block_sparse_moe.gate.weight";

fn error_of<T: std::fmt::Debug>(result: mpipemoe::Result<T>) -> String {
    result.expect_err("a hostile input must be an error").to_string()
}

#[test]
fn sizes_in_config_json_are_checked_against_the_tensors_before_allocating() {
    let dir = scratch_dir("hostile-sizes");
    // 10^9 experts: refused by the router's stored shape, before a name is built per expert.
    let ckpt = with_config(&dir, "mixtral-tiny", |c| {
        c["num_local_experts"] = 1_000_000_000.into()
    });
    let err = error_of(hf::read_layer(&ckpt, 1, 0..1_000_000_000));
    assert!(
        err.contains("config.json") && err.contains("1000000000 experts"),
        "{err}"
    );
    let err = error_of(hf::convert_to_file(&ckpt, 1, dir.join("x.safetensors")));
    assert!(err.contains("config.json"), "{err}");
    assert!(!dir.join("x.safetensors").exists());
    let ckpt = with_config(&dir, "deepseek-v3-tiny", |c| {
        c["n_routed_experts"] = 1_000_000_000.into()
    });
    assert!(error_of(hf::read_layer(&ckpt, 1, 0..8)).contains("config.json"));
    // 10^12 layers: bounded before the layer list is built.
    let ckpt = with_config(&dir, "qwen2-moe-tiny", |c| {
        c["num_hidden_layers"] = 1_000_000_000_000u64.into()
    });
    let err = error_of(hf::inspect(&ckpt));
    assert!(
        err.contains("num_hidden_layers") && err.contains("config.json"),
        "{err}"
    );
    // A width that disagrees with the stored tensors is named by inspect too.
    let ckpt = with_config(&dir, "qwen2-moe-tiny", |c| {
        c["moe_intermediate_size"] = 4096.into()
    });
    let err = error_of(hf::inspect(&ckpt));
    assert!(err.contains("config.json") && err.contains("gate_proj"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// transformers 5.x writes Qwen3-MoE's (and OLMoE's) expert count as `num_local_experts`; 4.x
/// as `num_experts`. Both import; two spellings that disagree are an error naming both.
#[test]
fn every_spelling_of_the_expert_count_imports() {
    let dir = scratch_dir("hostile-spelling");
    let (_, want) = hf::read_layer(data().join("qwen2-moe-tiny"), 0, 0..8).unwrap();
    for model_type in ["qwen2_moe", "qwen3_moe", "olmoe"] {
        let ckpt = with_config(&dir, "qwen2-moe-tiny", |c| {
            let obj = c.as_object_mut().unwrap();
            let n = obj.remove("num_experts").unwrap();
            obj.insert("num_local_experts".into(), n);
            obj.insert("model_type".into(), model_type.into());
            if model_type == "olmoe" {
                obj.insert("intermediate_size".into(), 16.into());
            }
        });
        let (info, got) = hf::read_layer(&ckpt, 0, 0..8).unwrap_or_else(|e| panic!("{model_type}: {e}"));
        assert_eq!(info.config.n_experts, 8);
        assert_eq!(got["router.weight"].as_bytes(), want["router.weight"].as_bytes());
        std::fs::remove_dir_all(&ckpt).unwrap();
    }
    let ckpt = with_config(&dir, "qwen2-moe-tiny", |c| c["num_local_experts"] = 16.into());
    let err = error_of(HfLayer::read(&ckpt, 0));
    assert!(
        err.contains("num_experts") && err.contains("num_local_experts"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn shard_names_must_stay_inside_the_checkpoint_folder() {
    let dir = scratch_dir("hostile-traversal");
    let outside = dir.join("elsewhere");
    copy_dir(&data().join("mixtral-tiny"), &outside);
    for (i, bad) in [
        "../elsewhere/model-00002-of-00004.safetensors".to_string(),
        outside
            .join("model-00002-of-00004.safetensors")
            .display()
            .to_string(),
        "/etc/passwd".to_string(),
        "sub/model.safetensors".to_string(),
    ]
    .into_iter()
    .enumerate()
    {
        let ckpt = with_index(&dir.join(format!("case{i}")), "mixtral-tiny", |map| {
            for v in map.values_mut() {
                *v = bad.clone().into();
            }
        });
        let err = error_of(hf::read_layer(&ckpt, 1, 0..8));
        assert!(
            err.contains("model.safetensors.index.json") && err.contains("not a plain file name"),
            "{err}"
        );
    }
    #[cfg(unix)]
    {
        // A shard that is a symbolic link out of the folder.
        let ckpt = dir.join("linked");
        copy_dir(&data().join("mixtral-tiny"), &ckpt);
        let shard = shard_of(&ckpt, ROUTER);
        std::fs::remove_file(&shard).unwrap();
        std::os::unix::fs::symlink(outside.join(shard.file_name().unwrap()), &shard).unwrap();
        let err = error_of(hf::read_layer(&ckpt, 1, 0..8));
        assert!(err.contains("symbolic link out of"), "{err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn what_is_not_a_regular_file_is_refused_without_reading_it() {
    let dir = scratch_dir("hostile-irregular");
    #[cfg(unix)]
    {
        let err = error_of(read_safetensors(Path::new("/dev/zero")));
        assert!(
            err.contains("/dev/zero") && err.contains("not a regular file"),
            "{err}"
        );
        // A FIFO as a shard: refused before it is opened (opening one blocks until a writer
        // comes).
        let ckpt = dir.join("fifo");
        copy_dir(&data().join("mixtral-tiny"), &ckpt);
        let shard = shard_of(&ckpt, ROUTER);
        std::fs::remove_file(&shard).unwrap();
        let made = std::process::Command::new("mkfifo").arg(&shard).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        let err = error_of(hf::read_layer(&ckpt, 1, 0..8));
        let shard_name = shard.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            err.contains(&shard_name) && err.contains("not a regular file"),
            "{err}"
        );
    }
    let err = error_of(read_safetensors(&dir));
    assert!(err.contains("a folder"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Rewrites one tensor of a checkpoint shard through `edit` (its dtype and little-endian
/// bytes), keeping every other tensor and the metadata.
fn edit_tensor(
    shard: &Path,
    name: &str,
    edit: impl Fn(safetensors::Dtype, Vec<u8>) -> (safetensors::Dtype, Vec<u8>),
) {
    let bytes = std::fs::read(shard).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut owned = Vec::new();
    for (n, view) in st.tensors() {
        let (dtype, data) = if n == name {
            edit(view.dtype(), view.data().to_vec())
        } else {
            (view.dtype(), view.data().to_vec())
        };
        owned.push((n, dtype, view.shape().to_vec(), data));
    }
    let views: Vec<_> = owned
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let out = safetensors::serialize(views, header.metadata().clone()).unwrap();
    std::fs::write(shard, out).unwrap();
}

fn shard_of(ckpt: &Path, name: &str) -> PathBuf {
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    ckpt.join(index["weight_map"][name].as_str().unwrap())
}

#[test]
fn non_finite_weights_and_mixed_dtypes_are_named() {
    let dir = scratch_dir("hostile-values");
    let name = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
    let ckpt = dir.join("nan");
    copy_dir(&data().join("mixtral-tiny"), &ckpt);
    edit_tensor(&shard_of(&ckpt, name), name, |d, mut b| {
        b[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
        (d, b)
    });
    let err = error_of(hf::read_layer(&ckpt, 1, 0..8));
    assert!(
        err.contains(name) && err.contains("non-finite") && err.contains("allow-nonfinite"),
        "{err}"
    );
    let allow = ImportOptions {
        allow_nonfinite: true,
    };
    let (_, tensors) = hf::read_layer_with(&ckpt, 1, 0..8, &allow).unwrap();
    let w_out: Vec<f32> = tensors["experts.w_out"].clone().into_vec().unwrap();
    assert!(w_out.iter().any(|v| v.is_nan()));

    // One tensor stored as f64 among f32 ones: no single dtype to write back.
    let ckpt = dir.join("mixed");
    copy_dir(&data().join("mixtral-tiny"), &ckpt);
    edit_tensor(&shard_of(&ckpt, name), name, |_, b| {
        let wide: Vec<u8> = b
            .chunks_exact(4)
            .flat_map(|c| f64::from(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
            .collect();
        (safetensors::Dtype::F64, wide)
    });
    let err = error_of(hf::read_layer(&ckpt, 1, 0..8));
    assert!(
        err.contains("mixes dtypes") && err.contains(name) && err.contains("float64"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// The canonical file records the dtype the tensors are stored in, whatever config.json says.
#[test]
fn the_recorded_dtype_is_the_tensors_not_the_configs() {
    let dir = scratch_dir("hostile-dtype");
    let ckpt = with_config(&dir, "mixtral-tiny", |c| c["dtype"] = "bfloat16".into());
    let (info, _) = hf::read_layer(&ckpt, 1, 0..8).unwrap();
    assert_eq!(info.dtype.as_deref(), Some("float32"));
    std::fs::remove_dir_all(&dir).ok();
}

/// A failed export leaves the output as it was (nothing half-written beside it); an output
/// folder holding another checkpoint is refused, or with `overwrite` replaced as a whole so
/// that no stale `model.safetensors` stays beside the new shards.
#[test]
fn exports_are_all_or_nothing_and_never_mix_checkpoints() {
    let dir = scratch_dir("hostile-export");
    let source = data().join("mixtral-tiny");
    let (_, tensors) = hf::read_layer(&source, 1, 0..8).unwrap();
    let mut broken = tensors.clone();
    broken.remove("experts.w_out");
    let out = dir.join("out");
    let err = error_of(hf::write_layer(&source, 1, &broken, &out));
    assert!(err.contains("experts.w_out"), "{err}");
    assert!(!out.exists());
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "nothing left beside the target"
    );

    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("model.safetensors"), b"stale").unwrap();
    let err = error_of(hf::write_layer(&source, 1, &tensors, &out));
    assert!(err.contains("not empty") && err.contains("overwrite"), "{err}");
    assert_eq!(std::fs::read(out.join("model.safetensors")).unwrap(), b"stale");
    // A failure with overwrite also leaves the old folder in place.
    let overwrite = ExportOptions {
        overwrite: true,
        ..ExportOptions::default()
    };
    assert!(hf::write_layer_with(&source, 1, &broken, &out, &overwrite).is_err());
    assert_eq!(std::fs::read(out.join("model.safetensors")).unwrap(), b"stale");
    hf::write_layer_with(&source, 1, &tensors, &out, &overwrite).unwrap();
    assert!(!out.join("model.safetensors").exists(), "the stale file is gone");
    for entry in std::fs::read_dir(&source).unwrap() {
        let name = entry.unwrap().file_name();
        assert_eq!(
            std::fs::read(source.join(&name)).unwrap(),
            std::fs::read(out.join(&name)).unwrap()
        );
    }
    // In place only when asked for by name: `overwrite` is not enough, and neither may
    // replace a folder that contains the source (which would delete it) or write inside it.
    let inplace = dir.join("inplace");
    copy_dir(&source, &inplace);
    let before: Vec<Vec<u8>> = sorted_files(&inplace);
    for (target, options, needle) in [
        (
            inplace.clone(),
            ExportOptions::default(),
            "source checkpoint itself",
        ),
        (inplace.join("."), overwrite, "source checkpoint itself"),
        (dir.clone(), overwrite, "contains the input"),
        (inplace.join("sub"), overwrite, "lies inside the input"),
    ] {
        let err = error_of(hf::write_layer_with(&inplace, 1, &tensors, &target, &options));
        assert!(err.contains(needle), "{}: {err}", target.display());
        assert!(
            sorted_files(&inplace) == before,
            "{}: the source changed",
            target.display()
        );
    }
    assert!(source.exists() && !inplace.join("sub").exists());
    // In place: the folder is rewritten whole, byte-identical for an unchanged layer.
    let in_place = ExportOptions {
        in_place: true,
        ..ExportOptions::default()
    };
    hf::write_layer_with(&inplace, 1, &tensors, &inplace, &in_place).unwrap();
    for entry in std::fs::read_dir(&source).unwrap() {
        let name = entry.unwrap().file_name();
        assert_eq!(
            std::fs::read(source.join(&name)).unwrap(),
            std::fs::read(inplace.join(&name)).unwrap()
        );
    }
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        2,
        "no staging folder left"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_case_with_no_tokens_or_non_finite_values_is_refused() {
    let dir = scratch_dir("hostile-cases");
    let case = data().join("mixtral-tiny.layer1.safetensors");
    let (mut tensors, meta) = read_safetensors(&case).unwrap();
    let m = tensors["x"].shape[1];
    for name in ["x", "y", "probe", "dx"] {
        tensors.insert(
            name.into(),
            burn::tensor::TensorData::new(Vec::<f32>::new(), [0, m]),
        );
    }
    let empty = dir.join("empty.safetensors");
    mpipemoe::format::write_safetensors(&empty, &tensors, &meta.clone().unwrap()).unwrap();
    let err = error_of(Case::load(&empty));
    assert!(
        err.contains("empty.safetensors") && err.contains("no tokens"),
        "{err}"
    );

    let (mut tensors, _) = read_safetensors(&case).unwrap();
    let mut x: Vec<f32> = tensors["x"].clone().into_vec().unwrap();
    x[5] = f32::INFINITY;
    let shape = tensors["x"].shape.clone();
    tensors.insert("x".into(), burn::tensor::TensorData::new(x, shape));
    let inf = dir.join("inf.safetensors");
    mpipemoe::format::write_safetensors(&inf, &tensors, &meta.unwrap()).unwrap();
    let err = error_of(Case::load(&inf));
    assert!(
        err.contains("inf.safetensors") && err.contains("`x`") && err.contains("non-finite"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Values a hostile config.json puts in a size field.
fn hostile_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(Value::from(0)),
        Just(Value::from(-1)),
        Just(Value::from(1.5)),
        Just(Value::from(true)),
        Just(Value::from("8")),
        Just(Value::Array(vec![])),
        Just(Value::from(u64::MAX)),
        Just(Value::from(1u64 << 40)),
        (1u64..100_000).prop_map(Value::from),
    ]
}

const SIZE_KEYS: [&str; 10] = [
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "num_hidden_layers",
    "n_group",
    "n_shared_experts",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// A mutated config.json: import and inspect answer Ok or an error naming config.json, the
    /// index or a shard; never a panic.
    #[test]
    fn mutated_configs_give_errors_not_panics(
        folder in prop_oneof![Just("mixtral-tiny"), Just("qwen2-moe-tiny"), Just("deepseek-v3-tiny")],
        key in 0..SIZE_KEYS.len(),
        value in hostile_value(),
        seed in 0u32..1_000_000,
    ) {
        let dir = scratch_dir(&format!("hostile-config-{seed}"));
        let ckpt = with_config(&dir, folder, |c| c[SIZE_KEYS[key]] = value.clone());
        let layer = if folder == "qwen2-moe-tiny" { 0 } else { 1 };
        let outcome = std::panic::catch_unwind(|| {
            let inspected = hf::inspect(&ckpt).map(|_| ());
            let read = hf::read_layer(&ckpt, layer, 0..1).map(|_| ());
            (inspected, read)
        });
        std::fs::remove_dir_all(&dir).ok();
        let (inspected, read) = outcome.map_err(|_| TestCaseError::fail(format!("panic: {} = {value}", SIZE_KEYS[key])))?;
        for result in [inspected, read] {
            if let Err(e) = result {
                let e = e.to_string();
                prop_assert!(e.contains(&*ckpt.display().to_string()) || e.contains("experts"), "{e}");
            }
        }
    }

    /// A truncated or corrupted safetensors file: every reader answers an error naming it.
    #[test]
    fn corrupted_safetensors_give_errors_not_panics(
        cut in 0usize..4096,
        flips in proptest::collection::vec((0usize..512, any::<u8>()), 0..6),
        seed in 0u32..1_000_000,
    ) {
        let dir = scratch_dir(&format!("hostile-corrupt-{seed}"));
        let source = data().join("mixtral-tiny.layer1.safetensors");
        let mut bytes = std::fs::read(&source).unwrap();
        for (at, value) in flips {
            if at < bytes.len() {
                bytes[at] = value;
            }
        }
        bytes.truncate(bytes.len().saturating_sub(cut));
        let path = dir.join("case.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        let outcome = std::panic::catch_unwind(|| Case::load_or_oracle(&path, 8, 0).map(|_| ()));
        std::fs::remove_dir_all(&dir).ok();
        let result = outcome.map_err(|_| TestCaseError::fail("panic"))?;
        if let Err(e) = result {
            prop_assert!(e.to_string().contains("case.safetensors"), "{e}");
        }
    }
}

/// A folder whose config and tensors disagree on which layers are MoE layers is refused when
/// it is opened, naming the layer, the config key that decides it and a tensor, in every
/// family with dense and MoE layers mixed; a step of 0 (transformers refuses it too) is
/// named. Before, Llama 4 with `interleave_moe_layer_step` 0 imported every layer's experts.
#[test]
fn a_config_that_disagrees_with_the_tensors_on_layer_kinds_is_refused() {
    let dir = scratch_dir("hostile-layer-kinds");
    type Edit = Box<dyn FnOnce(&mut Value)>;
    let cases: Vec<(&str, Edit, &[&str])> = vec![
        // Layer 1 holds the experts; the config says no layer is MoE.
        (
            "generated/llama4-tiny",
            Box::new(|c| c["moe_layers"] = serde_json::json!([])),
            &[
                "layer 1",
                "moe_layers = []",
                "layers.1.feed_forward.router.weight",
            ],
        ),
        // Without `moe_layers`, a step of 1 makes layer 0 MoE, which has no router.
        (
            "generated/llama4-tiny",
            Box::new(|c| {
                c.as_object_mut().unwrap().remove("moe_layers");
            }),
            &[
                "layer 0",
                "interleave_moe_layer_step = 1",
                "layers.0.feed_forward.router.weight",
            ],
        ),
        (
            "generated/llama4-tiny",
            Box::new(|c| {
                c.as_object_mut().unwrap().remove("moe_layers");
                c["interleave_moe_layer_step"] = 0.into();
            }),
            &["interleave_moe_layer_step", "is 0"],
        ),
        // Every other layer: layer 0 dense, but it holds experts.
        (
            "qwen2-moe-tiny",
            Box::new(|c| c["decoder_sparse_step"] = 2.into()),
            &["layer 0", "decoder_sparse_step = 2", "layers.0.mlp."],
        ),
        (
            "qwen2-moe-tiny",
            Box::new(|c| c["mlp_only_layers"] = serde_json::json!([1])),
            &["layer 1", "mlp_only_layers = [1]", "layers.1.mlp."],
        ),
        (
            "qwen2-moe-tiny",
            Box::new(|c| c["decoder_sparse_step"] = 0.into()),
            &["decoder_sparse_step", "is 0"],
        ),
        // transformers reads `first_k_dense_replace` alone: a `moe_layer_freq` of 2 changes
        // nothing, and 2 dense layers make layer 1 dense while it holds experts.
        (
            "deepseek-v3-tiny",
            Box::new(|c| c["first_k_dense_replace"] = 2.into()),
            &["layer 1", "first_k_dense_replace = 2", "layers.1.mlp."],
        ),
    ];
    for (i, (folder, edit, needles)) in cases.into_iter().enumerate() {
        let case_dir = dir.join(i.to_string());
        let ckpt = with_config(&case_dir, folder, edit);
        let err = error_of(hf::HfCheckpoint::open(&ckpt).map(drop));
        for needle in needles {
            assert!(
                err.contains(needle),
                "case {i} ({folder}): `{needle}` not in: {err}"
            );
        }
        // The command-line import goes through the same open.
        assert!(hf::read_layer(&ckpt, 1, 0..1).is_err(), "case {i}");
    }
    // DeepSeek's `moe_layer_freq`, which transformers ignores, does not make a layer dense.
    let ckpt = with_config(&dir.join("freq"), "deepseek-v3-tiny", |c| {
        c["moe_layer_freq"] = 2.into()
    });
    hf::read_layer(&ckpt, 1, 0..1).unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

/// `hidden_act` names the experts' activation: anything but "silu" (or its absence, which is
/// transformers' default) is refused by name, a non-string too, rather than read as SwiGLU.
#[test]
fn an_expert_activation_other_than_silu_is_refused_by_name() {
    let dir = scratch_dir("hostile-hidden-act");
    for (i, (value, needle)) in [
        (serde_json::json!("gelu"), "\"gelu\""),
        (serde_json::json!(0), "is 0"),
        (serde_json::json!(["silu"]), "not an activation's name"),
    ]
    .into_iter()
    .enumerate()
    {
        let ckpt = with_config(&dir.join(i.to_string()), "mixtral-tiny", |c| {
            c["hidden_act"] = value.clone()
        });
        let err = error_of(hf::read_layer(&ckpt, 1, 0..1));
        assert!(
            err.contains("hidden_act") && err.contains(needle),
            "{value}: {err}"
        );
    }
    let ckpt = with_config(&dir.join("absent"), "mixtral-tiny", |c| {
        c.as_object_mut().unwrap().remove("hidden_act");
    });
    hf::read_layer(&ckpt, 1, 0..1).unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

/// Every file of `dir` and its bytes.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    files.sort();
    files
}

/// A non-finite weight exported into a quantised checkpoint is refused before anything is
/// written, naming the tensor and the index: float8_e4m3fn and e2m1 hold no infinity, and the
/// block's scale would have been infinite (every value of the block NaN in transformers).
/// Into a new folder nothing is created; in place the folder is left as it was.
#[test]
fn non_finite_weights_are_never_quantised_into_a_checkpoint() {
    let dir = scratch_dir("hostile-nonfinite-export");
    let cases = [
        (
            "generated/deepseek-v3-fp8-tiny",
            "float8_e4m3fn",
            "layers.1.mlp.experts.0.gate_proj.weight",
        ),
        (
            "generated/gpt-oss-mxfp4-tiny",
            "mxfp4",
            "layers.1.mlp.experts.gate_up_proj",
        ),
    ];
    for (folder, format, tensor) in cases {
        let ckpt = dir.join(folder);
        copy_dir(&data().join(folder), &ckpt);
        let (_, mut tensors) = hf::read_layer(&ckpt, 1, 0..8).unwrap();
        let w_in = tensors.get_mut("experts.w_in").unwrap();
        let mut values = w_in.to_vec::<f32>().unwrap();
        values[3] = f32::INFINITY;
        *w_in = burn::tensor::TensorData::new(values, w_in.shape.clone());
        let out = dir.join(format!("{format}-out"));
        let err = error_of(hf::write_layer(&ckpt, 1, &tensors, &out));
        for needle in [tensor, "inf", format, "nothing was written"] {
            assert!(err.contains(needle), "{folder}: `{needle}` not in: {err}");
        }
        assert!(err.contains(" at ["), "{folder}: no index in: {err}");
        assert!(!out.exists(), "{folder}: the output folder was created");
        let before = snapshot(&ckpt);
        let in_place = hf::ExportOptions {
            in_place: true,
            ..Default::default()
        };
        let err = error_of(hf::write_layer_with(&ckpt, 1, &tensors, &ckpt, &in_place));
        assert!(err.contains(tensor), "{folder}: in place: {err}");
        assert!(snapshot(&ckpt) == before, "{folder}: changed in place");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A folder whose `quantization_config` says MXFP4 but whose experts are stored as floats is
/// refused by name (transformers would not load it, and an export could not tell which
/// format to write), rather than imported as floats.
#[test]
fn mxfp4_declared_over_float_experts_is_refused() {
    let dir = scratch_dir("hostile-mxfp4-floats");
    let ckpt = with_config(&dir, "generated/gpt-oss-tiny", |c| {
        c["quantization_config"] = serde_json::json!({"quant_method": "mxfp4"});
    });
    let err = error_of(hf::HfCheckpoint::open(&ckpt).map(drop));
    for needle in ["quantization_config", "mxfp4", "experts.gate_up_proj", "_blocks"] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The bytes of every file of `dir`, in name order.
fn sorted_files(dir: &std::path::Path) -> Vec<Vec<u8>> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    names
        .iter()
        .filter(|p| p.is_file())
        .map(|p| std::fs::read(p).unwrap())
        .collect()
}

/// A NaN weight exported into an f32 or bf16 checkpoint (a run that diverged) is refused
/// before anything is written, naming the tensor: it would load into transformers without a
/// word and give NaN logits.
#[test]
fn non_finite_weights_are_never_written_into_a_float_checkpoint() {
    let dir = scratch_dir("hostile-nonfinite-float");
    let ckpt = data().join("mixtral-tiny");
    let (_, mut tensors) = hf::read_layer(&ckpt, 1, 0..8).unwrap();
    let router = tensors.get_mut("router.weight").unwrap();
    let mut values = router.to_vec::<f32>().unwrap();
    values[5] = f32::NAN;
    *router = burn::tensor::TensorData::new(values, router.shape.clone());
    let out = dir.join("out");
    let err = error_of(hf::write_layer(&ckpt, 1, &tensors, &out));
    for needle in [
        "block_sparse_moe.gate.weight",
        "NaN",
        "at [5]",
        "nothing was written",
    ] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).ok();
}
