//! Hugging Face checkpoints in and out, against `tests/data/hf` (a copy of `../shared/hf`):
//! three tiny checkpoints written by transformers itself (sharded; f32 and bf16), each with the
//! expected case of one MoE layer.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Tensor, TensorData};
use mpipemoe::comm::rank_range;
use mpipemoe::harness::{check_case, relative_error, Case, CheckOptions};
use mpipemoe::hf::{self, Family, HfLayer};
use mpipemoe::memory::Strategy;
use mpipemoe::{LocalGroup, MoeError, MoeLayer, Partitions};

mod common;
use common::{copy_dir, scratch_dir};

type B = Autodiff<NdArray>;

/// (folder, MoE layer checked, expected case file).
const CHECKPOINTS: [(&str, usize); 3] = [
    ("mixtral-tiny", 1),
    ("qwen2-moe-tiny", 0),
    ("deepseek-v3-tiny", 1),
];

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf")
}

fn case_of(folder: &str, layer: usize) -> Case {
    Case::load(data().join(format!("{folder}.layer{layer}.safetensors"))).unwrap()
}

fn bytes(data: &TensorData) -> Vec<u8> {
    data.as_bytes().to_vec()
}

#[test]
fn import_gives_the_canonical_tensors_of_the_expected_case_bit_exactly() {
    for (folder, layer) in CHECKPOINTS {
        let case = case_of(folder, layer);
        let (info, tensors) = hf::read_layer(data().join(folder), layer, 0..case.config.n_experts).unwrap();
        assert_eq!(info.meta().kind.as_deref(), case.meta.kind.as_deref(), "{folder}");
        assert_eq!(info.meta().hf_dtype, case.meta.hf_dtype, "{folder}");
        // The config implied by config.json is the case's.
        let want = mpipemoe::format::LayerMeta {
            kind: case.meta.kind.clone(),
            hf_layer: case.meta.hf_layer,
            hf_dtype: case.meta.hf_dtype.clone(),
            ..mpipemoe::format::LayerMeta::from_config(&case.config)
        };
        assert_eq!(info.meta(), want, "{folder}: meta");
        let weights: Vec<&String> = case
            .tensors
            .keys()
            .filter(|n| !n.starts_with("grad.") && !["x", "y", "probe", "dx"].contains(&n.as_str()))
            .collect();
        assert_eq!(
            weights.len(),
            tensors.len(),
            "{folder}: {weights:?} vs {:?}",
            tensors.keys()
        );
        for name in weights {
            let got = &tensors[name.as_str()];
            let want = case.tensor(name);
            assert_eq!(got.shape, want.shape, "{folder}: {name} shape");
            assert!(
                bytes(got) == bytes(want),
                "{folder}: {name} differs from the case"
            );
        }
    }
}

#[test]
fn convert_writes_a_file_that_reads_back_as_the_same_layer() {
    let dir = scratch_dir("hf-convert");
    for (folder, layer) in CHECKPOINTS {
        let out = dir.join(format!("{folder}.safetensors"));
        hf::convert_to_file(data().join(folder), layer, &out).unwrap();
        let (tensors, meta) = mpipemoe::format::read_safetensors(&out).unwrap();
        let meta = mpipemoe::format::LayerMeta::parse(&meta.unwrap()).unwrap();
        let case = case_of(folder, layer);
        assert_eq!(meta.kind, case.meta.kind);
        assert_eq!(meta.hf_layer, Some(layer));
        assert_eq!(
            tensors.len() + 4,
            case.tensors.len() - case.tensors.keys().filter(|n| n.starts_with("grad.")).count()
        );
        for (name, data) in &tensors {
            assert!(bytes(data) == bytes(case.tensor(name)), "{folder}: {name}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The imported layer, at 1, 2 and 4 ranks (each rank reading only its experts), gives the
/// case's y, dx and gradients.
#[test]
fn the_imported_layer_reproduces_the_case_at_every_rank_count() {
    for (folder, layer) in CHECKPOINTS {
        let case = case_of(folder, layer);
        let x = case.tensor("x").clone();
        let probe = case.tensor("probe").clone();
        let [n_tokens, m] = [x.shape[0], x.shape[1]];
        let values = |d: &TensorData| d.clone().convert::<f64>().into_vec::<f64>().unwrap();
        for n_ranks in [1, 2, 4] {
            let ranks = LocalGroup::run(n_ranks, |ctx| {
                let device = Default::default();
                let layer =
                    MoeLayer::<B>::from_hf_rank(data().join(folder), layer, &device, ctx.comm.clone())?
                        .with_config(
                            HfLayer::read(data().join(folder), layer)?
                                .config
                                .with_partitions(Partitions::Fixed(2))
                                .with_memory_reuse(Strategy::S4.into()),
                        )?;
                let rows = rank_range(n_tokens, n_ranks, ctx.rank);
                let slice = |d: &TensorData| {
                    let v = values(d)[rows.start * m..rows.end * m].to_vec();
                    TensorData::new(v, [rows.len(), m]).convert::<f32>()
                };
                let xt = Tensor::<B, 2>::from_data(slice(&x), &device).require_grad();
                let out = layer.try_forward(xt.clone())?;
                let grads = (out.output.clone() * Tensor::from_data(slice(&probe), &device))
                    .sum()
                    .backward();
                let w_in = layer.experts.w_in.grad(&grads).map(|g| values(&g.into_data()));
                Ok((
                    values(&out.output.into_data()),
                    values(&xt.grad(&grads).unwrap().into_data()),
                    w_in.unwrap_or_default(),
                ))
            })
            .unwrap();
            let y: Vec<f64> = ranks.iter().flat_map(|r| r.0.clone()).collect();
            let dx: Vec<f64> = ranks.iter().flat_map(|r| r.1.clone()).collect();
            let w_in: Vec<f64> = ranks.iter().flat_map(|r| r.2.clone()).collect();
            for (name, got) in [("y", y), ("dx", dx), ("grad.experts.w_in", w_in)] {
                let err = relative_error(&got, &values(case.tensor(name)));
                assert!(err < 1e-4, "{folder} ranks={n_ranks}: {name} rel err {err:e}");
            }
        }
        // Every gradient, through the harness's comparison.
        let report = check_case::<B>(&case, &CheckOptions::default(), &Default::default()).unwrap();
        assert!(report.passed(1e-4), "{folder}: {:?}", report.worst());
    }
}

#[test]
fn importing_a_dense_layer_is_a_clear_error() {
    let err = HfLayer::read(data().join("deepseek-v3-tiny"), 0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("config.json") && err.contains("layer 0 is a dense MLP") && err.contains("[1]"),
        "{err}"
    );
    let err = HfLayer::read(data().join("mixtral-tiny"), 7)
        .unwrap_err()
        .to_string();
    assert!(err.contains("layer 7 does not exist"), "{err}");
}

#[test]
fn an_unknown_family_a_missing_tensor_and_a_bad_shape_are_named() {
    let dir = scratch_dir("hf-errors");
    let ckpt = dir.join("qwen");
    copy_dir(&data().join("qwen2-moe-tiny"), &ckpt);
    let config = std::fs::read_to_string(ckpt.join("config.json")).unwrap();

    std::fs::write(
        ckpt.join("config.json"),
        config.replace("\"qwen2_moe\"", "\"llama\""),
    )
    .unwrap();
    let err = HfLayer::read(&ckpt, 0).unwrap_err().to_string();
    assert!(
        err.contains("config.json") && err.contains("\"llama\"") && err.contains("qwen3_moe"),
        "{err}"
    );

    // A shape that disagrees with config.json: the error names the shard and the tensor.
    std::fs::write(
        ckpt.join("config.json"),
        config.replace("\"moe_intermediate_size\": 16", "\"moe_intermediate_size\": 12"),
    )
    .unwrap();
    let err = hf::read_layer(&ckpt, 0, 0..8).unwrap_err().to_string();
    assert!(
        err.contains("model-0000")
            && err.contains("model.layers.0.mlp.experts.0.")
            && err.contains("[12, 32]"),
        "{err}"
    );

    // A tensor missing from the index.
    std::fs::write(ckpt.join("config.json"), &config).unwrap();
    let index = std::fs::read_to_string(ckpt.join("model.safetensors.index.json")).unwrap();
    let gone = "model.layers.0.mlp.experts.5.up_proj.weight";
    let edited: String = index
        .lines()
        .filter(|l| !l.contains(gone))
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(ckpt.join("model.safetensors.index.json"), edited).unwrap();
    let err = hf::read_layer(&ckpt, 0, 0..8).unwrap_err().to_string();
    assert!(
        err.contains("model.safetensors.index.json") && err.contains(gone),
        "{err}"
    );
    // ... which a rank that does not own expert 5 never reads.
    hf::read_layer(&ckpt, 0, 0..4).unwrap();
    let res = LocalGroup::run_each(Default::default(), 2, |ctx| {
        MoeLayer::<B>::from_hf_rank(&ckpt, 0, &Default::default(), ctx.comm.clone()).map(|_| ())
    });
    assert!(res[0].is_ok(), "{:?}", res[0]);
    assert!(
        matches!(&res[1], Err(MoeError::File { reason, .. }) if reason.contains(gone)),
        "{:?}",
        res[1]
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn import_then_export_without_training_gives_the_same_files_back() {
    let dir = scratch_dir("hf-roundtrip");
    for (folder, layer) in CHECKPOINTS {
        let source = data().join(folder);
        let info = HfLayer::read(&source, layer).unwrap();
        let (_, tensors) = hf::read_layer(&source, layer, 0..info.config.n_experts).unwrap();
        let out = dir.join(folder);
        let report = hf::write_layer(&source, layer, &tensors, &out).unwrap();
        assert!(!report.shards_rewritten.is_empty());
        for entry in std::fs::read_dir(&source).unwrap() {
            let name = entry.unwrap().file_name();
            let want = std::fs::read(source.join(&name)).unwrap();
            let got = std::fs::read(out.join(&name)).unwrap();
            assert!(
                got == want,
                "{folder}/{}: not byte-identical after export",
                name.to_string_lossy()
            );
        }
        // And through the layer itself, with two ranks gathering their experts.
        let out2 = dir.join(format!("{folder}-layer"));
        LocalGroup::run(2, |ctx| {
            let l = MoeLayer::<B>::from_hf_rank(&source, layer, &Default::default(), ctx.comm.clone())?;
            l.save_hf(&source, layer, &out2)
        })
        .unwrap();
        for entry in std::fs::read_dir(&source).unwrap() {
            let name = entry.unwrap().file_name();
            assert!(std::fs::read(source.join(&name)).unwrap() == std::fs::read(out2.join(&name)).unwrap());
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_exported_change_lands_in_its_tensor_only() {
    let dir = scratch_dir("hf-change");
    let source = data().join("deepseek-v3-tiny");
    let (_, mut tensors) = hf::read_layer(&source, 1, 0..8).unwrap();
    // Expert 3's w_out row 0 and the score bias change; bf16-representable values.
    let mut w_out: Vec<f32> = tensors["experts.w_out"].clone().into_vec().unwrap();
    let (h, m) = (16, 32);
    for c in 0..m {
        w_out[3 * h * m + c] = 0.5;
    }
    tensors.insert("experts.w_out".into(), TensorData::new(w_out, [8, h, m]));
    tensors.insert("router.score_bias".into(), TensorData::new(vec![0.25f32; 8], [8]));
    let out = dir.join("tuned");
    hf::write_layer(&source, 1, &tensors, &out).unwrap();
    let (_, back) = hf::read_layer(&out, 1, 0..8).unwrap();
    for (name, data) in &tensors {
        assert!(
            bytes(&back[name.as_str()]) == bytes(data),
            "{name} did not round-trip"
        );
    }
    // Layer 0 (dense) and the other shard are untouched.
    assert!(
        std::fs::read(source.join("model-00002-of-00002.safetensors")).unwrap()
            == std::fs::read(out.join("model-00002-of-00002.safetensors")).unwrap()
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Qwen3-MoE and OLMoE follow Qwen2-MoE's names without the shared expert: a Qwen2-MoE
/// checkpoint relabelled as either imports its router and experts (and no shared expert), with
/// each family's own config keys.
#[test]
fn qwen3_moe_and_olmoe_conventions_import() {
    let dir = scratch_dir("hf-families");
    let config = std::fs::read_to_string(data().join("qwen2-moe-tiny/config.json")).unwrap();
    let (_, qwen2) = hf::read_layer(data().join("qwen2-moe-tiny"), 0, 0..8).unwrap();
    for (model_type, edit) in [
        ("qwen3_moe", config.replace("\"qwen2_moe\"", "\"qwen3_moe\"")),
        (
            "olmoe",
            config
                .replace("\"qwen2_moe\"", "\"olmoe\"")
                .replace("\"intermediate_size\": 48", "\"intermediate_size\": 16"),
        ),
    ] {
        let ckpt = dir.join(model_type);
        copy_dir(&data().join("qwen2-moe-tiny"), &ckpt);
        std::fs::write(ckpt.join("config.json"), edit).unwrap();
        let (info, tensors) = hf::read_layer(&ckpt, 0, 0..8).unwrap();
        assert_eq!(info.family.model_type(), model_type);
        assert_eq!(info.config.shared_expert, None);
        assert!(
            !info.config.normalize_topk,
            "norm_topk_prob: false in config.json"
        );
        assert_eq!(tensors.len(), 3, "{:?}", tensors.keys());
        for name in ["router.weight", "experts.w_in", "experts.w_out"] {
            assert!(
                bytes(&tensors[name]) == bytes(&qwen2[name]),
                "{model_type}: {name}"
            );
        }
        let layer = MoeLayer::<B>::from_hf(&ckpt, 1, &Default::default()).unwrap();
        assert_eq!(layer.config().n_experts, 8);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn inspect_lists_the_moe_layers() {
    let mixtral = hf::inspect(data().join("mixtral-tiny")).unwrap();
    assert_eq!(mixtral.iter().map(|l| l.layer).collect::<Vec<_>>(), vec![0, 1]);
    let l = &mixtral[1];
    assert_eq!(
        (l.n_experts, l.top_k, l.d_model, l.d_hidden, l.d_shared),
        (8, 2, 32, 24, None)
    );
    assert_eq!(l.parameters, 8 * 32 + 8 * 3 * 24 * 32);
    let deepseek = hf::inspect(data().join("deepseek-v3-tiny")).unwrap();
    assert_eq!(deepseek.len(), 1);
    assert_eq!(deepseek[0].layer, 1);
    assert_eq!(deepseek[0].scoring, "sigmoid");
    assert_eq!(deepseek[0].parameters, 8 * 32 + 8 + 8 * 3 * 16 * 32 + 3 * 32 * 32);
    assert_eq!(deepseek[0].family, Family::DeepseekV3);
}

/// The DeepSeek-V3 case exercises what is new in its router: without the group limit, the
/// score bias or the scaling factor, some tokens would choose (or weigh) differently, so the
/// case passing at 1e-4 checks each of them.
#[test]
fn the_deepseek_case_depends_on_group_limit_score_bias_and_scaling() {
    let case = case_of("deepseek-v3-tiny", 1);
    let device = Default::default();
    let layer = MoeLayer::<B>::from_tensor_map(
        &case.config,
        &case.tensors,
        Path::new("case"),
        &device,
        Arc::new(mpipemoe::comm::SingleRank),
    )
    .unwrap();
    let x = Tensor::<B, 2>::from_data(case.tensor("x").clone(), &device);
    let rule = case.config.routing_rule();
    let base = layer.router.route(x.clone(), &rule);
    let ungrouped = layer.router.route(
        x.clone(),
        &mpipemoe::RoutingRule {
            n_group: 1,
            topk_group: 1,
            ..rule
        },
    );
    assert_ne!(
        base.indices, ungrouped.indices,
        "the group limit never binds on this case"
    );
    let mut unbiased = layer.clone();
    unbiased.router.score_bias = None;
    assert_ne!(
        base.indices,
        unbiased.router.route(x.clone(), &rule).indices,
        "the score bias never changes a choice on this case"
    );
    assert_eq!(rule.scaling, 1.5);
}

/// A single `model.safetensors` (no index) stored in f16: the layer imports as the f16-rounded
/// weights, and exports back to the same bytes.
#[test]
fn a_single_file_f16_checkpoint_imports_and_exports() {
    use burn::tensor::f16;
    let dir = scratch_dir("hf-f16");
    let source = data().join("mixtral-tiny");
    let ckpt = dir.join("mixtral-f16");
    std::fs::create_dir_all(&ckpt).unwrap();
    std::fs::copy(source.join("config.json"), ckpt.join("config.json")).unwrap();
    // Every tensor of every shard, in f16, in one file.
    let mut all: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for entry in std::fs::read_dir(&source).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.tensors() {
                let data = TensorData::from_bytes_vec(
                    view.data().to_vec(),
                    view.shape().to_vec(),
                    burn::tensor::DType::F32,
                )
                .convert::<f16>();
                all.push((name, view.shape().to_vec(), data.as_bytes().to_vec()));
            }
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = all
        .iter()
        .map(|(n, shape, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F16, shape.clone(), b).unwrap(),
            )
        })
        .collect();
    let info = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    std::fs::write(
        ckpt.join("model.safetensors"),
        safetensors::serialize(views, Some(info)).unwrap(),
    )
    .unwrap();

    let (_, f32_tensors) = hf::read_layer(&source, 1, 0..8).unwrap();
    let (_, f16_tensors) = hf::read_layer(&ckpt, 1, 0..8).unwrap();
    for (name, data) in &f32_tensors {
        let rounded = data.clone().convert::<f16>().convert::<f32>();
        assert!(bytes(&f16_tensors[name]) == bytes(&rounded), "{name}");
    }
    let out = dir.join("back");
    hf::write_layer(&ckpt, 1, &f16_tensors, &out).unwrap();
    assert!(
        std::fs::read(ckpt.join("model.safetensors")).unwrap()
            == std::fs::read(out.join("model.safetensors")).unwrap()
    );
    std::fs::remove_dir_all(&dir).ok();
}
