//! Hugging Face checkpoints in and out, against `tests/data/hf` (a copy of `../shared/hf`):
//! three tiny checkpoints written by transformers itself (sharded; f32 and bf16), each with the
//! expected case of one MoE layer.

use std::collections::BTreeMap;
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
    hf::write_layer(&twice, 12, &maps[1].1, &twice).unwrap();
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

/// The project's own checkpoints, written by transformers (`tests/data/hf/generated/*.py`).
fn generated() -> PathBuf {
    data().join("generated")
}

type Stored = (safetensors::Dtype, Vec<usize>, Vec<u8>);

/// Every tensor of the checkpoint in `source` (all shards).
fn all_tensors(source: &Path) -> BTreeMap<String, Stored> {
    let mut all = BTreeMap::new();
    for entry in std::fs::read_dir(source).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, view) in st.tensors() {
                all.insert(name, (view.dtype(), view.shape().to_vec(), view.data().to_vec()));
            }
        }
    }
    all
}

/// A one-file checkpoint in `out` holding `tensors`, with `config` as its config.json.
fn write_single(out: &Path, tensors: &BTreeMap<String, Stored>, config: &str) {
    std::fs::create_dir_all(out).unwrap();
    std::fs::write(out.join("config.json"), config).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (dtype, shape, b))| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), b).unwrap();
            (n.clone(), view)
        })
        .collect();
    std::fs::write(
        out.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
}

fn to_f32(stored: &Stored) -> Stored {
    let dtype = match stored.0 {
        safetensors::Dtype::BF16 => burn::tensor::DType::BF16,
        safetensors::Dtype::F32 => burn::tensor::DType::F32,
        other => panic!("{other:?}"),
    };
    let data = TensorData::from_bytes_vec(stored.2.clone(), stored.1.clone(), dtype).convert::<f32>();
    (
        safetensors::Dtype::F32,
        stored.1.clone(),
        data.as_bytes().to_vec(),
    )
}

#[test]
fn fp8_block_scaled_weights_import_as_transformers_dequantises_them() {
    let dir = scratch_dir("hf-fp8");
    let fp8 = generated().join("deepseek-v3-fp8-tiny");
    // transformers' dequantised weights (float32) in place of each FP8 weight and its scale,
    // every other tensor widened to float32 (exact), no quantization_config: the checkpoint
    // the FP8 one must import as, bit for bit.
    let dequantized = {
        let bytes = std::fs::read(generated().join("deepseek-v3-fp8-tiny.dequantized.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensors()
            .into_iter()
            .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
            .collect::<BTreeMap<_, _>>()
    };
    let stored = all_tensors(&fp8);
    let mut reference = BTreeMap::new();
    let mut quantised = 0;
    for (name, t) in &stored {
        if name.ends_with("weight_scale_inv") {
            continue;
        }
        if t.0 == safetensors::Dtype::F8_E4M3 {
            reference.insert(name.clone(), dequantized[name].clone());
            quantised += 1;
        } else {
            reference.insert(name.clone(), to_f32(t));
        }
    }
    assert_eq!(quantised, 36);
    let config = std::fs::read_to_string(fp8.join("config.json")).unwrap();
    let mut plain: serde_json::Value = serde_json::from_str(&config).unwrap();
    plain.as_object_mut().unwrap().remove("quantization_config");
    let reference_dir = dir.join("reference");
    write_single(&reference_dir, &reference, &plain.to_string());

    let (info, got) = hf::read_layer(&fp8, 1, 0..8).unwrap();
    let (_, want) = hf::read_layer(&reference_dir, 1, 0..8).unwrap();
    assert_eq!(got.len(), want.len());
    for (name, data) in &want {
        assert!(bytes(&got[name]) == bytes(data), "{name}");
    }
    assert_eq!(
        info.dtype.as_deref(),
        Some("bfloat16 + float8_e4m3fn in 8 x 16 blocks")
    );
    // The dequantised experts are not the bf16 originals (FP8 is lossy): the test sees the
    // quantisation, not a copy of the unquantised checkpoint.
    let (_, original) = hf::read_layer(data().join("deepseek-v3-tiny"), 1, 0..8).unwrap();
    assert!(bytes(&got["experts.w_in"]) != bytes(&original["experts.w_in"]));
    // Two ranks read their halves of the same values.
    let halves = LocalGroup::run(2, |ctx| {
        let layer = MoeLayer::<B>::from_hf_rank(&fp8, 1, &Default::default(), ctx.comm.clone())?;
        layer.gather_tensor_map()
    })
    .unwrap();
    let whole = halves[0].as_ref().unwrap();
    assert!(bytes(&whole["experts.w_out"]) == bytes(&want["experts.w_out"]));

    // Exported unchanged into the FP8 checkpoint, every weight keeps its block scales and is
    // written back to the same bits: the whole folder is byte-identical.
    let out = dir.join("export");
    let report = hf::write_layer(&fp8, 1, &got, &out).unwrap();
    assert_eq!(
        report.requantized.len(),
        8 * 3 + 3,
        "8 experts x 3 and the shared expert's 3"
    );
    assert!(
        report.requantized.iter().all(|r| r.rescaled_blocks == 0),
        "{report:?}"
    );
    for entry in std::fs::read_dir(&fp8).unwrap() {
        let name = entry.unwrap().file_name();
        assert!(
            std::fs::read(fp8.join(&name)).unwrap() == std::fs::read(out.join(&name)).unwrap(),
            "{} changed on an unchanged export",
            name.to_string_lossy()
        );
    }
    // Weights times 4 fit no stored scale: every block is quantised afresh, bit for bit as
    // transformers' Fp8Quantize does it (make_fp8.py).
    let mut times4 = got.clone();
    for name in ["experts.w_in", "experts.w_out", "shared.w_in", "shared.w_out"] {
        let data = &got[name];
        let values: Vec<f32> = data.to_vec::<f32>().unwrap().iter().map(|v| v * 4.0).collect();
        times4.insert(name.into(), TensorData::new(values, data.shape.clone()));
    }
    let out4 = dir.join("export-x4");
    let report = hf::write_layer(&fp8, 1, &times4, &out4).unwrap();
    assert!(
        report.requantized.iter().all(|r| r.rescaled_blocks == r.blocks),
        "{report:?}"
    );
    let written = all_tensors(&out4);
    let bytes = std::fs::read(generated().join("deepseek-v3-fp8-tiny.requantized-x4.safetensors")).unwrap();
    let want = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(want.len(), 2 * report.requantized.len());
    for (name, view) in want.tensors() {
        let (dtype, shape, data) = &written[&name];
        assert_eq!((*dtype, shape.as_slice()), (view.dtype(), view.shape()), "{name}");
        assert!(
            data.as_slice() == view.data(),
            "{name} differs from transformers' quantisation"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn fp8_checkpoints_with_a_bad_block_size_or_scale_are_refused_by_name() {
    let dir = scratch_dir("hf-fp8-bad");
    let fp8 = generated().join("deepseek-v3-fp8-tiny");
    let stored = all_tensors(&fp8);
    let config = std::fs::read_to_string(fp8.join("config.json")).unwrap();
    let weight = "model.layers.1.mlp.experts.3.up_proj.weight";
    let scale = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv";
    let with_block = |block: &str| {
        let mut json: serde_json::Value = serde_json::from_str(&config).unwrap();
        json["quantization_config"]["weight_block_size"] = serde_json::from_str(block).unwrap();
        json.to_string()
    };
    // (name, tensors, config.json, what the error must name)
    type BadCase<'a> = (&'a str, BTreeMap<String, Stored>, String, Vec<&'a str>);
    let mut cases: Vec<BadCase> = Vec::new();
    // A block size that is not two positive integers.
    for block in ["[8]", "[0, 16]", "\"128\""] {
        cases.push((
            "bad-block",
            stored.clone(),
            with_block(block),
            vec!["config.json", "weight_block_size"],
        ));
    }
    // A block size that does not match the stored scale grid (16 x 16 blocks need [1, 2]).
    cases.push((
        "other-block",
        stored.clone(),
        with_block("[16, 16]"),
        vec!["weight_scale_inv", "[2, 2]", "[1, 2]"],
    ));
    // A missing scale.
    let mut missing = stored.clone();
    missing.remove(scale);
    cases.push(("missing", missing, config.clone(), vec![weight, scale, "missing"]));
    // A scale of the wrong shape.
    let mut wrong = stored.clone();
    let s = wrong.get_mut(scale).unwrap();
    s.1 = vec![4, 1];
    cases.push((
        "wrong-shape",
        wrong,
        config.clone(),
        vec![scale, "[4, 1]", "[2, 2]"],
    ));
    // No quantization_config at all.
    let mut json: serde_json::Value = serde_json::from_str(&config).unwrap();
    json.as_object_mut().unwrap().remove("quantization_config");
    cases.push((
        "no-config",
        stored.clone(),
        json.to_string(),
        vec!["float8_e4m3fn", "quantization_config", "model.layers.1.mlp."],
    ));
    for (i, (name, tensors, config, needles)) in cases.into_iter().enumerate() {
        let ckpt = dir.join(format!("{name}-{i}"));
        write_single(&ckpt, &tensors, &config);
        let err = hf::read_layer(&ckpt, 1, 0..8).unwrap_err().to_string();
        for needle in needles {
            assert!(err.contains(needle), "{name}: {needle:?} not in {err}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The MXFP4 checkpoint's tensors with transformers' dequantised experts (bfloat16) in place
/// of each projection's `_blocks` and `_scales`, and its config.json without
/// `quantization_config`: what `from_pretrained(..., Mxfp4Config(dequantize=True))` loads.
fn mxfp4_reference(mxfp4: &Path, out: &Path) {
    let bytes = std::fs::read(generated().join("gpt-oss-mxfp4-tiny.dequantized.safetensors")).unwrap();
    let dequantized = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut reference: BTreeMap<String, Stored> = all_tensors(mxfp4)
        .into_iter()
        .filter(|(name, _)| !name.ends_with("_blocks") && !name.ends_with("_scales"))
        .collect();
    for (name, view) in dequantized.tensors() {
        reference.insert(name, (view.dtype(), view.shape().to_vec(), view.data().to_vec()));
    }
    assert_eq!(dequantized.len(), 4, "two projections in each of two layers");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(mxfp4.join("config.json")).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("quantization_config");
    write_single(out, &reference, &config.to_string());
}

#[test]
fn mxfp4_experts_import_as_transformers_dequantises_them() {
    let dir = scratch_dir("hf-mxfp4");
    let mxfp4 = generated().join("gpt-oss-mxfp4-tiny");
    let reference = dir.join("reference");
    mxfp4_reference(&mxfp4, &reference);
    for layer in [0, 1] {
        let (info, got) = hf::read_layer(&mxfp4, layer, 0..8).unwrap();
        let (_, want) = hf::read_layer(&reference, layer, 0..8).unwrap();
        assert_eq!(got.len(), want.len());
        for (name, data) in &want {
            assert!(bytes(&got[name]) == bytes(data), "layer {layer}: {name}");
        }
        assert_eq!(
            info.dtype.as_deref(),
            Some("bfloat16 + mxfp4 experts (e2m1, an e8m0 scale per 32)")
        );
    }
    // Layer 1's first block sits at exponent 0: values of 2^-128 and the like, subnormal in
    // float32 and bfloat16 (make_mxfp4.py), come through unflushed.
    let (_, layer1) = hf::read_layer(&mxfp4, 1, 0..8).unwrap();
    let w_in = layer1["experts.w_in"].to_vec::<f32>().unwrap();
    assert!(w_in.iter().any(|v| *v != 0.0 && v.abs() < f32::MIN_POSITIVE));

    // A rank reads its experts' bytes only: half the experts cost half the experts' bytes,
    // and the router (weight and bias, bfloat16) is read either way.
    let read = |experts: std::ops::Range<usize>| {
        let ckpt = hf::HfCheckpoint::open(&mxfp4).unwrap();
        let (_, tensors) = ckpt.read_layer(1, experts).unwrap();
        (ckpt.stats().tensor_bytes, tensors)
    };
    let (all, whole) = read(0..8);
    let (half, upper) = read(4..8);
    assert_eq!(2 * half - all, (8 * 64 + 8) * 2, "{half} of {all} bytes");
    let per_expert = whole["experts.w_out"].num_elements() / 8;
    assert_eq!(
        upper["experts.w_out"].to_vec::<f32>().unwrap(),
        whole["experts.w_out"].to_vec::<f32>().unwrap()[4 * per_expert..]
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn mxfp4_export_writes_mxfp4_as_transformers_quantiser_does() {
    let dir = scratch_dir("hf-mxfp4-export");
    let mxfp4 = generated().join("gpt-oss-mxfp4-tiny");
    let (_, got) = hf::read_layer(&mxfp4, 1, 0..8).unwrap();
    // Unchanged, every block keeps its exponent and codes: the folder comes back byte for
    // byte (the generic round-trip test covers this too; here the report is checked).
    let out = dir.join("export");
    let report = hf::write_layer(&mxfp4, 1, &got, &out).unwrap();
    let formats: Vec<(&str, &str, usize, usize)> = report
        .requantized
        .iter()
        .map(|r| (r.tensor.as_str(), r.format, r.blocks, r.rescaled_blocks))
        .collect();
    assert_eq!(
        formats,
        [
            ("model.layers.1.mlp.experts.down_proj", "mxfp4", 8 * 64, 0),
            ("model.layers.1.mlp.experts.gate_up_proj", "mxfp4", 8 * 64 * 2, 0),
        ]
    );
    for entry in std::fs::read_dir(&mxfp4).unwrap() {
        let name = entry.unwrap().file_name();
        assert!(
            std::fs::read(mxfp4.join(&name)).unwrap() == std::fs::read(out.join(&name)).unwrap(),
            "{} changed on an unchanged export",
            name.to_string_lossy()
        );
    }
    // Times 1.3, no block's values are codes at its stored exponent any more: each is
    // quantised afresh, bit for bit as triton_kernels' quantiser (transformers'
    // Mxfp4Quantize) does it (make_mxfp4.py).
    let mut scaled = got.clone();
    for name in ["experts.w_in", "experts.w_out"] {
        let data = &got[name];
        let values: Vec<f32> = data.to_vec::<f32>().unwrap().iter().map(|v| v * 1.3).collect();
        scaled.insert(name.into(), TensorData::new(values, data.shape.clone()));
    }
    let out = dir.join("export-x1.3");
    let report = hf::write_layer(&mxfp4, 1, &scaled, &out).unwrap();
    assert!(
        report.requantized.iter().all(|r| r.rescaled_blocks == r.blocks),
        "{report:?}"
    );
    let written = all_tensors(&out);
    let bytes = std::fs::read(generated().join("gpt-oss-mxfp4-tiny.requantized-x1.3.safetensors")).unwrap();
    let want = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(want.len(), 4);
    for (name, view) in want.tensors() {
        let (dtype, shape, data) = &written[&name];
        assert_eq!((*dtype, shape.as_slice()), (view.dtype(), view.shape()), "{name}");
        assert!(
            data.as_slice() == view.data(),
            "{name} differs from transformers' quantisation"
        );
    }
    // The biases, the router and layer 0 are as they were.
    let source = all_tensors(&mxfp4);
    for (name, tensor) in &source {
        if !want.names().contains(&name.as_str()) {
            assert!(written[name] == *tensor, "{name} changed");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn mxfp4_checkpoints_with_bad_packing_are_refused_by_name() {
    let dir = scratch_dir("hf-mxfp4-bad");
    let mxfp4 = generated().join("gpt-oss-mxfp4-tiny");
    let stored = all_tensors(&mxfp4);
    let config = std::fs::read_to_string(mxfp4.join("config.json")).unwrap();
    let blocks = "model.layers.1.mlp.experts.down_proj_blocks";
    let scales = "model.layers.1.mlp.experts.down_proj_scales";
    // (name, tensors, config.json, what the error must name)
    type BadCase<'a> = (&'a str, BTreeMap<String, Stored>, String, Vec<&'a str>);
    let mut cases: Vec<BadCase> = Vec::new();
    let mut missing = stored.clone();
    missing.remove(scales);
    cases.push((
        "missing-scales",
        missing,
        config.clone(),
        vec![blocks, scales, "missing"],
    ));
    let mut wrong = stored.clone();
    wrong.get_mut(scales).unwrap().1 = vec![8, 32, 2];
    cases.push((
        "scales-shape",
        wrong,
        config.clone(),
        vec![scales, "[8, 32, 2]", "[8, 64, 1]"],
    ));
    let mut wrong = stored.clone();
    let b = wrong.get_mut(blocks).unwrap();
    (b.0, b.1) = (safetensors::Dtype::BF16, vec![8, 64, 1, 8]);
    cases.push((
        "blocks-dtype",
        wrong,
        config.clone(),
        vec![blocks, "bfloat16", "uint8"],
    ));
    // Exponent 255 is e8m0's NaN: the block dequantises to infinities, refused as
    // non-finite, naming the projection.
    let mut nan = stored.clone();
    nan.get_mut(scales).unwrap().2[5] = 255;
    cases.push((
        "nan-scale",
        nan,
        config.clone(),
        vec!["model.layers.1.mlp.experts.down_proj`", "non-finite"],
    ));
    // A hidden size of 48 does not pack in blocks of 32.
    let mut narrow = stored.clone();
    let router = narrow.get_mut("model.layers.1.mlp.router.weight").unwrap();
    (router.1, router.2) = (vec![8, 48], vec![0; 8 * 48 * 2]);
    let mut json: serde_json::Value = serde_json::from_str(&config).unwrap();
    json["hidden_size"] = 48.into();
    cases.push((
        "not-whole-blocks",
        narrow,
        json.to_string(),
        vec!["gate_up_proj", "[8, 48, 64]", "multiple of 32"],
    ));
    // Without `quantization_config`, the packed tensors are not read as MXFP4.
    let mut json: serde_json::Value = serde_json::from_str(&config).unwrap();
    json.as_object_mut().unwrap().remove("quantization_config");
    cases.push((
        "no-config",
        stored.clone(),
        json.to_string(),
        vec!["missing tensor", "model.layers.1.mlp.experts.gate_up_proj`"],
    ));
    for (i, (name, tensors, config, needles)) in cases.into_iter().enumerate() {
        let ckpt = dir.join(format!("{name}-{i}"));
        write_single(&ckpt, &tensors, &config);
        let err = hf::read_layer(&ckpt, 1, 0..8).unwrap_err().to_string();
        for needle in needles {
            assert!(err.contains(needle), "{name}: {needle:?} not in {err}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
