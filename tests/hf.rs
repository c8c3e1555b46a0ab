//! Hugging Face checkpoints in and out, against `tests/data/hf` (a copy of `../shared/hf`:
//! three tiny checkpoints written by transformers itself, sharded, f32 and bf16, each with the
//! expected case of one MoE layer) and the project's own in `tests/data/hf/generated` (Llama 4,
//! GPT-OSS in bf16 and in MXFP4). The FP8 and MXFP4 formats themselves are tested in
//! `hf_quantized.rs`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Tensor, TensorData};
use mpipemoe::comm::rank_range;
use mpipemoe::harness::{check_case, relative_error, Case, CheckOptions};
use mpipemoe::hf::{self, Family, HfLayer};
use mpipemoe::memory::Strategy;
use mpipemoe::{Activation, LocalGroup, MoeError, MoeLayer, Partitions};

mod common;
use common::{copy_dir, scratch_dir};

type B = Autodiff<NdArray>;

/// (folder, MoE layer checked, its case `<case>.layer<L>.safetensors`): the checkpoints the
/// tests are given, and the project's own Llama 4 (text-only and multimodal, the same weights)
/// and GPT-OSS ones (stacked experts; bf16, and MXFP4 as the Hub's releases store them).
const CHECKPOINTS: [(&str, usize, &str); 7] = [
    ("mixtral-tiny", 1, "mixtral-tiny"),
    ("qwen2-moe-tiny", 0, "qwen2-moe-tiny"),
    ("deepseek-v3-tiny", 1, "deepseek-v3-tiny"),
    ("generated/llama4-tiny", 1, "generated/llama4-tiny"),
    ("generated/llama4-multimodal-tiny", 1, "generated/llama4-tiny"),
    ("generated/gpt-oss-tiny", 1, "generated/gpt-oss-tiny"),
    ("generated/gpt-oss-mxfp4-tiny", 1, "generated/gpt-oss-mxfp4-tiny"),
];

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf")
}

fn case_of(folder: &str, layer: usize) -> Case {
    Case::load(data().join(format!("{folder}.layer{layer}.safetensors"))).unwrap()
}

/// A one-rank layer of `config` holding a case's weights.
fn case_layer(config: &mpipemoe::MoeLayerConfig, tensors: &mpipemoe::format::TensorMap) -> MoeLayer<B> {
    MoeLayer::from_tensor_map(
        config,
        tensors,
        Path::new("case"),
        &Default::default(),
        Arc::new(mpipemoe::comm::SingleRank),
    )
    .unwrap()
}

fn f64s(data: TensorData) -> Vec<f64> {
    data.convert::<f64>().into_vec::<f64>().unwrap()
}

fn bytes(data: &TensorData) -> Vec<u8> {
    data.as_bytes().to_vec()
}

#[test]
fn import_gives_the_canonical_tensors_of_the_expected_case_bit_exactly() {
    for (folder, layer, case_name) in CHECKPOINTS {
        let case = case_of(case_name, layer);
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
    for (folder, layer, case_name) in CHECKPOINTS {
        let out = dir.join(format!("{}.safetensors", folder.replace('/', "-")));
        hf::convert_to_file(data().join(folder), layer, &out).unwrap();
        let (tensors, meta) = mpipemoe::format::read_safetensors(&out).unwrap();
        let meta = mpipemoe::format::LayerMeta::parse(&meta.unwrap()).unwrap();
        let case = case_of(case_name, layer);
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
    for (folder, layer, case_name) in CHECKPOINTS {
        let case = case_of(case_name, layer);
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
    for (folder, layer, _) in CHECKPOINTS {
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
    // Every family's count is the number of values the import reads for the layer (the
    // stacked families' biases and router bias included).
    for (folder, layer, _) in CHECKPOINTS {
        let summary = hf::inspect(data().join(folder)).unwrap();
        let summary = summary.iter().find(|l| l.layer == layer).unwrap();
        let (_, tensors) = hf::read_layer(data().join(folder), layer, 0..summary.n_experts).unwrap();
        let values: usize = tensors.values().map(|t| t.shape.iter().product::<usize>()).sum();
        assert_eq!(summary.parameters, values, "{folder}");
    }
}

/// The DeepSeek-V3 case exercises what is new in its router: without the group limit, the
/// score bias or the scaling factor, some tokens would choose (or weigh) differently, so the
/// case passing at 1e-4 checks each of them.
#[test]
fn the_deepseek_case_depends_on_group_limit_score_bias_and_scaling() {
    let case = case_of("deepseek-v3-tiny", 1);
    let device = Default::default();
    let layer = case_layer(&case.config, &case.tensors);
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

/// Llama 4 multiplies the router's weight into the expert's input, which is another function
/// than weighting the output: the case tells the two apart, and its routing is not a
/// constant choice.
#[test]
fn the_llama4_case_depends_on_weighting_the_input() {
    let case = case_of("generated/llama4-tiny", 1);
    assert!(case.config.weights_on_input && case.config.top_k == 1);
    let device = Default::default();
    let run = |config: &mpipemoe::MoeLayerConfig| {
        let layer = case_layer(config, &case.tensors);
        let x = Tensor::<B, 2>::from_data(case.tensor("x").clone(), &device);
        let experts: std::collections::BTreeSet<usize> = layer
            .router
            .route(x.clone(), &config.routing_rule())
            .indices
            .into_iter()
            .collect();
        (f64s(layer.forward(x).output.into_data()), experts.len())
    };
    let want = f64s(case.tensor("y").clone());
    let (y, n_chosen) = run(&case.config);
    assert!(relative_error(&y, &want) < 1e-4);
    assert!(n_chosen > 2, "the case routes to {n_chosen} experts only");
    let (on_output, _) = run(&case.config.clone().with_weights_on_input(false));
    let err = relative_error(&on_output, &want);
    assert!(
        err > 1e-2,
        "weighting the output instead gives the case's y (rel err {err:e})"
    );
}

/// The Hub's Llama 4 releases are multimodal: the text model's keys are under `text_config`
/// and its tensors under `language_model.`. Without `text_config` the file is refused by name.
#[test]
fn a_multimodal_llama4_is_read_through_its_text_config() {
    let source = data().join("generated/llama4-multimodal-tiny");
    let info = HfLayer::read(&source, 1).unwrap();
    assert_eq!(info.family, Family::Llama4);
    assert_eq!(
        hf::inspect(&source)
            .unwrap()
            .iter()
            .map(|l| l.layer)
            .collect::<Vec<_>>(),
        vec![1]
    );
    let dir = scratch_dir("hf-llama4-mm");
    let broken = dir.join("no-text-config");
    copy_dir(&source, &broken);
    let config_path = broken.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("text_config");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let err = HfLayer::read(&broken, 1).unwrap_err().to_string();
    assert!(
        err.contains("config.json") && err.contains("text_config"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// GPT-OSS's clamped SwiGLU acts on the case (values pass the clamp, and an unclamped SwiGLU
/// of the same slope misses the case), and its experts' biases and router bias are used.
#[test]
fn the_gpt_oss_case_depends_on_the_clamp_and_the_biases() {
    let case = case_of("generated/gpt-oss-tiny", 1);
    let Activation::ClampedSwiGlu { alpha, limit } = case.config.activation else {
        panic!("the GPT-OSS case's activation is {:?}", case.config.activation)
    };
    assert_eq!((alpha, limit), (1.702, 7.0));
    assert!(case.config.bias && case.config.router_bias && case.config.normalize_topk);
    let device = Default::default();
    let y_of = |config: &mpipemoe::MoeLayerConfig, tensors: &mpipemoe::format::TensorMap| {
        let layer = case_layer(config, tensors);
        let x = Tensor::<B, 2>::from_data(case.tensor("x").clone(), &device);
        f64s(layer.forward(x).output.into_data())
    };
    let want = f64s(case.tensor("y").clone());
    assert!(relative_error(&y_of(&case.config, &case.tensors), &want) < 1e-4);
    let unclamped = case
        .config
        .clone()
        .with_activation(Activation::clamped_swiglu(1.702, 1e30).unwrap());
    let err = relative_error(&y_of(&unclamped, &case.tensors), &want);
    assert!(err > 1e-3, "the clamp never changes the output (rel err {err:e})");
    let mut no_bias = case.tensors.clone();
    let zeros = |name: &str| {
        let shape = case.tensor(name).shape.clone();
        TensorData::new(vec![0f32; shape.iter().product()], shape)
    };
    for name in ["experts.b_in", "experts.b_out", "router.bias"] {
        no_bias.insert(name.into(), zeros(name));
        let err = relative_error(&y_of(&case.config, &no_bias), &want);
        assert!(err > 1e-3, "{name} never changes the output (rel err {err:e})");
        no_bias.insert(name.into(), case.tensor(name).clone());
    }
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

/// A 16-layer generated checkpoint in 5 shards (`harness::write_synthetic_checkpoint`).
fn deep_checkpoint(dir: &Path) -> PathBuf {
    let ckpt = dir.join("deep");
    let spec = mpipemoe::harness::SyntheticCheckpoint {
        family: mpipemoe::harness::SyntheticFamily::Mixtral,
        n_layers: 16,
        n_experts: 4,
        top_k: 2,
        d_model: 16,
        d_hidden: 8,
        n_shards: 5,
        bf16: true,
        seed: 3,
    };
    mpipemoe::harness::write_synthetic_checkpoint(&ckpt, &spec).unwrap();
    ckpt
}

#[test]
fn every_layer_at_once_reads_each_shard_once_and_equals_layer_by_layer() {
    let dir = scratch_dir("hf-layers");
    let source = deep_checkpoint(&dir);
    let device = Default::default();
    let ckpt = hf::HfCheckpoint::open(&source).unwrap();
    assert_eq!(ckpt.moe_layers().unwrap(), (0..16).collect::<Vec<_>>());
    let layers = ckpt
        .load_layers::<B>(&device, Arc::new(mpipemoe::comm::SingleRank))
        .unwrap();
    assert_eq!(layers.len(), 16);
    let once = ckpt.stats();
    assert_eq!(once.shards_mapped, 5, "every shard mapped once: {once:?}");

    // Layer by layer, as from_hf does: the same weights, but the index, config and shard
    // headers parsed once per layer.
    let mut by_layer = hf::ReadStats::default();
    for (index, layer) in &layers {
        let one = hf::HfCheckpoint::open(&source).unwrap();
        let alone = one
            .load_layer::<B>(*index, &device, Arc::new(mpipemoe::comm::SingleRank))
            .unwrap();
        let (a, b) = (
            layer.gather_tensor_map().unwrap().unwrap(),
            alone.gather_tensor_map().unwrap().unwrap(),
        );
        assert_eq!(a.len(), b.len());
        for (name, data) in &a {
            assert!(bytes(data) == bytes(&b[name]), "layer {index}: {name}");
        }
        let s = one.stats();
        by_layer.shards_mapped += s.shards_mapped;
        by_layer.metadata_bytes += s.metadata_bytes;
        by_layer.tensor_bytes += s.tensor_bytes;
    }
    // The same tensor bytes either way (only the MoE tensors are copied). The metadata: at
    // once, the config, the index and each shard's header one time; layer by layer, the
    // config and the index 16 times and the header of each layer's shard once per layer
    // (every layer lies in one shard here).
    assert_eq!(once.tensor_bytes, by_layer.tensor_bytes);
    let per_layer_expert_bytes = (4 * 3 * 8 * 16 + 4 * 16) * 2;
    assert_eq!(once.tensor_bytes, 16 * per_layer_expert_bytes as u64);
    let len = |name: &str| std::fs::metadata(source.join(name)).unwrap().len();
    let header = |shard: usize| {
        let bytes =
            std::fs::read(source.join(format!("model-{:05}-of-00005.safetensors", shard + 1))).unwrap();
        u64::from_le_bytes(bytes[..8].try_into().unwrap())
    };
    let texts = len("config.json") + len("model.safetensors.index.json");
    assert_eq!(once.metadata_bytes, texts + (0..5).map(header).sum::<u64>());
    assert_eq!(by_layer.shards_mapped, 16);
    assert_eq!(
        by_layer.metadata_bytes,
        16 * texts + (0..16).map(|l| header(l * 5 / 16)).sum::<u64>()
    );

    // With two ranks, each rank copies its own experts only (and the whole router).
    let per_rank = LocalGroup::run(2, |ctx| {
        let ckpt = hf::HfCheckpoint::open(&source)?;
        let layers = MoeLayer::<B>::from_hf_layers(&source, &Default::default(), ctx.comm.clone())?;
        assert_eq!(layers.len(), 16);
        ckpt.load_layers::<B>(&Default::default(), ctx.comm.clone())?;
        Ok(ckpt.stats())
    })
    .unwrap();
    for stats in per_rank {
        assert_eq!(stats.tensor_bytes, 16 * ((2 * 3 * 8 * 16 + 4 * 16) * 2) as u64);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn many_layers_are_written_in_one_pass_as_one_by_one() {
    let dir = scratch_dir("hf-save-layers");
    let source = deep_checkpoint(&dir);
    let device = Default::default();
    let layers =
        MoeLayer::<B>::from_hf_layers(&source, &device, Arc::new(mpipemoe::comm::SingleRank)).unwrap();

    // Unchanged: every file comes back byte for byte.
    let refs: Vec<(usize, &MoeLayer<B>)> = layers.iter().map(|(i, l)| (*i, l)).collect();
    let same = dir.join("same");
    MoeLayer::save_hf_layers(&refs, &source, &same).unwrap();
    for entry in std::fs::read_dir(&source).unwrap() {
        let name = entry.unwrap().file_name();
        assert!(
            std::fs::read(source.join(&name)).unwrap() == std::fs::read(same.join(&name)).unwrap(),
            "{name:?}"
        );
    }

    // Changed layers 3 and 12 (in different shards): one pass writes what two passes write.
    let mut maps: Vec<(usize, mpipemoe::format::TensorMap)> = [3, 12]
        .iter()
        .map(|&l| (l, layers[l].1.gather_tensor_map().unwrap().unwrap()))
        .collect();
    for (l, map) in &mut maps {
        let router: Vec<f32> = map["router.weight"].clone().into_vec().unwrap();
        // Negated: exact in the stored bfloat16, so the values must come back bit for bit.
        let moved = router.iter().map(|v| -v).collect::<Vec<_>>();
        assert!(moved.iter().any(|v| *v != 0.0), "layer {l}");
        map.insert("router.weight".into(), TensorData::new(moved, [4, 16]));
    }
    let once = dir.join("once");
    let refs: Vec<(usize, &mpipemoe::format::TensorMap)> = maps.iter().map(|(l, m)| (*l, m)).collect();
    let report = hf::write_layers_with(&source, &refs, &once, &Default::default()).unwrap();
    assert_eq!(report.shards_rewritten.len(), 2, "{report:?}");
    let twice = dir.join("twice");
    hf::write_layer(&source, 3, &maps[0].1, &twice).unwrap();
    // The second pass updates `twice` in place, which is asked for by name.
    let in_place = hf::ExportOptions {
        in_place: true,
        ..Default::default()
    };
    let err = hf::write_layer(&twice, 12, &maps[1].1, &twice)
        .unwrap_err()
        .to_string();
    assert!(err.contains("source checkpoint itself"), "{err}");
    hf::write_layer_with(&twice, 12, &maps[1].1, &twice, &in_place).unwrap();
    for entry in std::fs::read_dir(&source).unwrap() {
        let name = entry.unwrap().file_name();
        assert!(
            std::fs::read(once.join(&name)).unwrap() == std::fs::read(twice.join(&name)).unwrap(),
            "{name:?}"
        );
    }
    let (_, back) = hf::read_layer(&once, 12, 0..4).unwrap();
    assert!(bytes(&back["router.weight"]) == bytes(&maps[1].1["router.weight"]));

    // A layer given twice is refused before anything is written.
    let err = hf::write_layers_with(
        &source,
        &[(3, &maps[0].1), (3, &maps[0].1)],
        dir.join("dup"),
        &Default::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("layer 3 is given twice"), "{err}");
    assert!(!dir.join("dup").exists());
    std::fs::remove_dir_all(&dir).ok();
}
