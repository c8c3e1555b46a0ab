//! Every family's tiny checkpoint (tests/data/models, written by transformers) against what
//! transformers computed on it: the logits, the loss and every parameter's gradient in float32
//! to 1e-4 (relative to the largest reference value), and the greedy ids of `generate`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use mpipemoe::comm::SingleRank;
use mpipemoe::format::TensorMap;
use mpipemoe::hf::HfCheckpoint;
use mpipemoe::{LocalGroup, MemoryReuse, ParamKind, Partitions};
use mpipemoe_models::MoeCausalLm;
use safetensors::SafeTensors;

#[path = "families/agreement.rs"]
mod agreement;
#[path = "families/batched.rs"]
mod batched;
#[path = "families/cache.rs"]
mod cache;
#[path = "families/dense.rs"]
mod dense;
#[path = "families/finetune.rs"]
mod finetune;
#[path = "families/lora.rs"]
mod lora;
#[path = "families/sampling.rs"]
mod sampling;

/// One backend for every test here (each backend a test binary instantiates costs compile time).
type B = Autodiff<NdArray>;

const FAMILIES: [&str; 7] = [
    "mixtral-tiny",
    "qwen2-moe-tiny",
    "qwen3-moe-tiny",
    "olmoe-tiny",
    "deepseek-v3-tiny",
    "gpt-oss-tiny",
    "llama4-tiny",
];

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/models")
}

/// The expected tensors: f32 as `(shape, values)`, int64 ids as usize.
struct Expected {
    floats: HashMap<String, (Vec<usize>, Vec<f32>)>,
    ints: HashMap<String, Vec<usize>>,
}

fn expected(family: &str) -> Expected {
    let bytes = std::fs::read(data().join(format!("{family}.expected.safetensors"))).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out = Expected {
        floats: HashMap::new(),
        ints: HashMap::new(),
    };
    for (name, view) in st.tensors() {
        let raw = view.data();
        match view.dtype() {
            safetensors::Dtype::F32 => {
                let v = raw
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                out.floats.insert(name, (view.shape().to_vec(), v));
            }
            safetensors::Dtype::I64 => {
                let v = raw
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as usize)
                    .collect();
                out.ints.insert(name, v);
            }
            other => panic!("{name}: unexpected dtype {other:?}"),
        }
    }
    out
}

/// max |a − b| / max |b|.
fn rel_err(actual: &[f32], reference: &[f32]) -> f64 {
    assert_eq!(actual.len(), reference.len());
    let scale = reference
        .iter()
        .fold(0f64, |m, &v| m.max((v as f64).abs()))
        .max(1e-30);
    let diff = actual
        .iter()
        .zip(reference)
        .fold(0f64, |m, (&a, &b)| m.max((a as f64 - b as f64).abs()));
    diff / scale
}

fn values<const D: usize, Bk: burn::tensor::backend::Backend>(t: Tensor<Bk, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

fn ids_tensor(ids: &[usize], shape: [usize; 2]) -> Tensor<B, 2, Int> {
    Tensor::from_data(
        TensorData::new(ids.iter().map(|&i| i as i64).collect::<Vec<_>>(), shape),
        &Default::default(),
    )
}

/// One MoE layer's gradients under their canonical names, with how each combines over ranks.
type MoeGrads = Vec<(String, ParamKind, TensorData)>;

/// One MoE layer's gradients being combined: name, kind, shape, values.
type MoeGradsCombined = Vec<(String, ParamKind, Vec<usize>, Vec<f32>)>;

/// This rank's gradients: the dense parameters' under the checkpoint's names, and each MoE
/// layer's under its canonical names (`experts.*` holding this rank's experts only).
struct RankGrads {
    dense: HashMap<String, Vec<f32>>,
    moe: Vec<(usize, MoeGrads)>,
}

fn rank_grads<Bk: AutodiffBackend + mpipemoe::MoeBackend>(
    model: &MoeCausalLm<Bk>,
    grads: &Bk::Gradients,
) -> RankGrads {
    let grad = |p: &Param<Tensor<Bk, 1>>| values(p.grad(grads).expect("every parameter gets a gradient"));
    let parts = model.hf_parts();
    let mut dense = HashMap::new();
    for (name, l) in parts.parts.linears {
        let g = l.weight.grad(grads).expect("every parameter gets a gradient");
        dense.insert(format!("{name}.weight"), values(g.transpose()));
        if let Some(b) = &l.bias {
            dense.insert(format!("{name}.bias"), grad(b));
        }
    }
    for (name, v) in parts.parts.vectors {
        dense.insert(name, grad(v));
    }
    let (name, embedding) = parts.embedding;
    dense.insert(name, values(embedding.grad(grads).expect("a gradient")));
    let moe = model
        .moe_layers()
        .map(|(i, layer)| {
            let named = layer
                .grads_by_name(grads)
                .into_iter()
                .map(|(name, kind, g)| {
                    // DeepSeek's score bias chooses experts and takes no gradient; the
                    // reference stores zeros for it.
                    let g = g.unwrap_or_else(|| {
                        assert_eq!(
                            name, "router.score_bias",
                            "every parameter but the score bias gets a gradient"
                        );
                        let n = layer.config().n_experts;
                        TensorData::new(vec![0f32; n], [n])
                    });
                    (name.to_string(), kind, g)
                })
                .collect();
            (i, named)
        })
        .collect();
    RankGrads { dense, moe }
}

/// Every rank's gradients combined as the library's gradient sync combines them (replicated
/// parameters summed over ranks, experts from their owners, in rank order), under the
/// checkpoint's names.
fn combine(ckpt: &HfCheckpoint, ranks: Vec<RankGrads>) -> HashMap<String, Vec<f32>> {
    let sum = |a: &mut Vec<f32>, b: &[f32]| a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
    let mut ranks = ranks.into_iter();
    let first = ranks.next().unwrap();
    let mut dense = first.dense;
    let mut moe: Vec<(usize, MoeGradsCombined)> = first
        .moe
        .into_iter()
        .map(|(i, named)| {
            let named = named
                .into_iter()
                .map(|(n, k, d)| (n, k, d.shape.to_vec(), d.into_vec::<f32>().unwrap()))
                .collect();
            (i, named)
        })
        .collect();
    for rank in ranks {
        rank.dense
            .iter()
            .for_each(|(k, v)| sum(dense.get_mut(k).unwrap(), v));
        for ((_, ours), (_, theirs)) in moe.iter_mut().zip(rank.moe) {
            for ((_, kind, shape, acc), (_, _, data)) in ours.iter_mut().zip(theirs) {
                let v = data.into_vec::<f32>().unwrap();
                match kind {
                    ParamKind::Replicated => sum(acc, &v),
                    ParamKind::Expert => {
                        shape[0] *= 2;
                        acc.extend(v);
                    }
                }
            }
        }
    }
    for (i, named) in moe {
        let canonical: TensorMap = named
            .into_iter()
            .map(|(n, _, shape, v)| (n, TensorData::new(v, shape)))
            .collect();
        dense.extend(ckpt.layer_to_hf(i, &canonical).unwrap());
    }
    dense
}

/// Compares every stored tensor's gradient; returns how many.
fn compare_grads(
    family: &str,
    ckpt: &HfCheckpoint,
    ours: &HashMap<String, Vec<f32>>,
    exp: &Expected,
) -> usize {
    let mut compared = 0;
    for (name, (_, reference)) in exp
        .floats
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("grad.").map(|n| (n, v)))
    {
        let got = ours
            .get(name)
            .unwrap_or_else(|| panic!("{family}: no gradient for `{name}`"));
        let err = rel_err(got, reference);
        assert!(err < 1e-4, "{family}: gradient of `{name}` off by {err:.2e}");
        compared += 1;
    }
    assert_eq!(
        compared,
        ckpt.tensor_names().count(),
        "{family}: every stored tensor's gradient"
    );
    compared
}

#[test]
fn every_family_matches_transformers_logits_loss_and_gradients() {
    let device = Default::default();
    for family in FAMILIES {
        let dir = data().join(family);
        let exp = expected(family);
        let ckpt = HfCheckpoint::open(&dir).unwrap();
        let model = MoeCausalLm::<B>::from_checkpoint(&ckpt, &device, Arc::new(SingleRank)).unwrap();
        let (shape, ids) = (&exp.floats["logits"].0, &exp.ints["ids"]);
        let ids = ids_tensor(ids, [shape[0], shape[1]]);
        let (loss, out) = model.loss(ids).unwrap();
        let logits_err = rel_err(&values(out.logits), &exp.floats["logits"].1);
        let loss_err = rel_err(&values(loss.clone()), &exp.floats["loss"].1);
        assert!(logits_err < 1e-4, "{family}: logits off by {logits_err:.2e}");
        assert!(loss_err < 1e-4, "{family}: loss off by {loss_err:.2e}");
        let grads = loss.backward();
        let ours = combine(&ckpt, vec![rank_grads(&model, &grads)]);
        let compared = compare_grads(family, &ckpt, &ours, &exp);
        println!("{family}: logits {logits_err:.1e}, loss {loss_err:.1e}, {compared} gradients");
    }
}

#[test]
fn every_family_generates_transformers_greedy_ids() {
    let device = Default::default();
    for family in FAMILIES {
        let exp = expected(family);
        let model = MoeCausalLm::<B>::from_hf(data().join(family), &device, Arc::new(SingleRank)).unwrap();
        let ids = model.generate(&exp.ints["prompt"], 32, &device).unwrap();
        assert_eq!(ids, exp.ints["greedy"], "{family}: greedy ids");
    }
}

/// Two ranks, experts sharded, three partitions and memory strategy S4: rank `r` takes row
/// `r` of the batch and half its loss (the rows are equally long, so the halves sum to the
/// batch's mean), and the gradients combine as the library's sync combines them.
#[test]
fn experts_sharded_over_two_ranks_with_three_partitions_and_s4_match_too() {
    for family in FAMILIES {
        let exp = expected(family);
        let dir = data().join(family);
        let shape = exp.floats["logits"].0.clone();
        let (t, v) = (shape[1], shape[2]);
        assert_eq!(shape[0], 2, "one row per rank");
        let ids = exp.ints["ids"].clone();
        let ckpt = HfCheckpoint::open(&dir).unwrap();
        let results = LocalGroup::run(2, |ctx| {
            let device = Default::default();
            let model =
                MoeCausalLm::<B>::from_checkpoint(&ckpt, &device, ctx.comm)?.map_moe_configs(|c| {
                    c.with_partitions(Partitions::Fixed(3))
                        .with_memory_reuse(MemoryReuse::S4)
                })?;
            let row = &ids[ctx.rank * t..(ctx.rank + 1) * t];
            let (loss, out) = model.loss(ids_tensor(row, [1, t]))?;
            let logits = values(out.logits);
            let loss = loss * 0.5;
            let half = values(loss.clone())[0];
            let grads = loss.backward();
            Ok((logits, half, rank_grads(&model, &grads)))
        })
        .unwrap();
        let mut logits = Vec::new();
        let mut loss = 0.0;
        let mut grads = Vec::new();
        for (l, half, g) in results {
            logits.extend(l);
            loss += half;
            grads.push(g);
        }
        assert_eq!(logits.len(), 2 * t * v);
        let logits_err = rel_err(&logits, &exp.floats["logits"].1);
        let loss_err = rel_err(&[loss], &exp.floats["loss"].1);
        assert!(
            logits_err < 1e-4,
            "{family} at 2 ranks: logits off by {logits_err:.2e}"
        );
        assert!(loss_err < 1e-4, "{family} at 2 ranks: loss off by {loss_err:.2e}");
        let compared = compare_grads(family, &ckpt, &combine(&ckpt, grads), &exp);
        println!("{family} at 2 ranks, n = 3, S4: logits {logits_err:.1e}, loss {loss_err:.1e}, {compared} gradients");
    }
}

/// The router load-balancing loss is transformers' (`load_balancing_loss_func`: one loss over
/// every MoE layer's rows, `tests/data/models/make_aux.py`), not the sum of each layer's own:
/// for every family that has one, with `router_aux_loss_coef` 0.01, our `aux_loss` equals
/// `0.01 · aux_loss`, cross-entropy plus it equals transformers' loss, and every router
/// parameter's gradient of that total equals torch autograd's, to 1e-4, at one rank and at two
/// (each rank's share of the batch's loss, the gradients combined as the sync combines them).
#[test]
fn the_load_balancing_loss_is_transformers_across_the_layers() {
    let text = std::fs::read_to_string(data().join("aux.expected.json")).unwrap();
    let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
    let coef = reference["coef"].as_f64().unwrap();
    let families = reference["families"].as_object().unwrap();
    assert!(families.len() >= 5, "{families:?}");
    for (family, want) in families {
        let exp = expected(family);
        let shape = exp.floats["logits"].0.clone();
        let (batch, t) = (shape[0], shape[1]);
        let ids = exp.ints["ids"].clone();
        let ckpt = HfCheckpoint::open(data().join(family)).unwrap();
        let want_aux = coef * want["aux_loss"].as_f64().unwrap();
        let want_loss = want["loss"].as_f64().unwrap();
        for ranks in [1, 2] {
            let shares = LocalGroup::run(ranks, |ctx| {
                let model = MoeCausalLm::<B>::from_checkpoint(&ckpt, &Default::default(), ctx.comm)?
                    .map_moe_configs(|c| c.with_aux_loss_coef(coef))?;
                let rows = batch / ranks;
                let mine = &ids[ctx.rank * rows * t..(ctx.rank + 1) * rows * t];
                let (ce, out) = model.loss(ids_tensor(mine, [rows, t]))?;
                let ce = ce / ranks as f32;
                let values_of = (
                    f64::from(values(ce.clone())[0]),
                    f64::from(values(out.aux_loss.clone())[0]),
                );
                let grads = (ce + out.aux_loss).backward();
                Ok((values_of.0, values_of.1, rank_grads(&model, &grads)))
            })
            .unwrap();
            let ce: f64 = shares.iter().map(|s| s.0).sum();
            let aux: f64 = shares.iter().map(|s| s.1).sum();
            let grads = combine(&ckpt, shares.into_iter().map(|s| s.2).collect());
            let router_grads = want["router_grads"].as_object().unwrap();
            assert!(!router_grads.is_empty());
            for (name, reference) in router_grads {
                let reference: Vec<f32> = reference
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap() as f32)
                    .collect();
                let err = rel_err(&grads[name], &reference);
                assert!(
                    err < 1e-4,
                    "{family} at {ranks} ranks: the gradient of {name} off by {err:.2e}"
                );
            }
            let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
            assert!(
                rel(aux, want_aux) < 1e-4,
                "{family} at {ranks} ranks: aux {aux} against transformers' {want_aux}"
            );
            assert!(
                rel(ce + aux, want_loss) < 1e-4,
                "{family} at {ranks} ranks: loss {} against transformers' {want_loss}",
                ce + aux
            );
        }
    }
}

#[test]
fn a_model_is_a_burn_module() {
    let device = Default::default();
    let model =
        MoeCausalLm::<B>::from_hf(data().join("mixtral-tiny"), &device, Arc::new(SingleRank)).unwrap();
    // 43,616 parameters in the checkpoint's index metadata.
    assert_eq!(model.num_params(), 43_616);
}

/// A copy of `family`'s folder in a fresh temporary folder, with `edit` applied to its
/// `config.json` and index (as JSON).
fn edited_copy(
    family: &str,
    test: &str,
    edit: impl FnOnce(&mut serde_json::Value, &mut serde_json::Value),
) -> PathBuf {
    let src = data().join(family);
    let dst = std::env::temp_dir().join(format!("mpipemoe-models-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dst.join(entry.file_name())).unwrap();
    }
    let read = |name: &str| serde_json::from_slice(&std::fs::read(dst.join(name)).unwrap()).unwrap();
    let (mut config, mut index) = (read("config.json"), read("model.safetensors.index.json"));
    edit(&mut config, &mut index);
    std::fs::write(dst.join("config.json"), serde_json::to_vec(&config).unwrap()).unwrap();
    std::fs::write(
        dst.join("model.safetensors.index.json"),
        serde_json::to_vec(&index).unwrap(),
    )
    .unwrap();
    dst
}

fn load_error(dir: &std::path::Path) -> String {
    let err = MoeCausalLm::<B>::from_hf(dir, &Default::default(), Arc::new(SingleRank)).unwrap_err();
    let _ = std::fs::remove_dir_all(dir);
    err.to_string()
}

#[test]
fn a_missing_tensor_is_an_error_naming_it() {
    let dir = edited_copy("qwen3-moe-tiny", "missing", |_, index| {
        index["weight_map"]
            .as_object_mut()
            .unwrap()
            .remove("model.layers.2.self_attn.k_norm.weight");
    });
    let err = load_error(&dir);
    assert!(err.contains("model.layers.2.self_attn.k_norm.weight"), "{err}");
}

#[test]
fn a_tensor_the_model_does_not_use_is_an_error_naming_it() {
    let dir = edited_copy("mixtral-tiny", "unused", |_, index| {
        let map = index["weight_map"].as_object_mut().unwrap();
        let shard = map["model.norm.weight"].clone();
        map.insert("model.layers.0.self_attn.q_norm.weight".into(), shard);
    });
    let err = load_error(&dir);
    assert!(
        err.contains("model.layers.0.self_attn.q_norm.weight") && err.contains("does not use"),
        "{err}"
    );
}

#[test]
fn an_unsupported_family_or_rotary_scaling_is_an_error_naming_it() {
    let dir = edited_copy("mixtral-tiny", "jamba", |config, _| {
        config["model_type"] = "jamba".into();
    });
    let err = load_error(&dir);
    assert!(err.contains("\"jamba\"") && err.contains("mixtral"), "{err}");
    let dir = edited_copy("olmoe-tiny", "dynamic", |config, _| {
        config["rope_parameters"]["rope_type"] = "dynamic".into();
    });
    let err = load_error(&dir);
    assert!(err.contains("\"dynamic\"") && err.contains("rope_type"), "{err}");
}

fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mpipemoe-models-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Loaded and saved without training, every family's folder comes back byte for byte: every
/// tensor under its name, dtype and shard, the index and the other files.
#[test]
fn a_model_saved_untrained_gives_its_folder_back_byte_for_byte() {
    for family in FAMILIES {
        let src = data().join(family);
        let out = temp_dir(&format!("roundtrip-{family}"));
        let model = MoeCausalLm::<B>::from_hf(&src, &Default::default(), Arc::new(SingleRank)).unwrap();
        let report = model.save_hf(&src, &out, &Default::default()).unwrap().unwrap();
        assert!(report.tensors > 0);
        let mut files = 0;
        for entry in std::fs::read_dir(&src).unwrap() {
            let name = entry.unwrap().file_name();
            let (a, b) = (
                std::fs::read(src.join(&name)).unwrap(),
                std::fs::read(out.join(&name)).unwrap(),
            );
            assert!(a == b, "{family}: {name:?} differs after a round trip");
            files += 1;
        }
        assert_eq!(
            std::fs::read_dir(&out).unwrap().count(),
            files,
            "{family}: no extra file"
        );
        std::fs::remove_dir_all(&out).unwrap();
    }
}

/// DeepSeek-V3 as its releases store it, FP8 block-scaled weights in the attention and the
/// dense layer too (tests/data/hf/generated/deepseek-v3-fp8-tiny): every projection loads as
/// transformers dequantises it (its values are in `.dequantized.safetensors`), and saved
/// untrained the folder comes back byte for byte (FP8 blocks and scales kept).
#[test]
fn fp8_weights_anywhere_in_deepseek_v3_load_dequantised_and_save_back_unchanged() {
    let hf = data().join("../hf/generated");
    let src = hf.join("deepseek-v3-fp8-tiny");
    let model = MoeCausalLm::<B>::from_hf(&src, &Default::default(), Arc::new(SingleRank)).unwrap();
    let bytes = std::fs::read(hf.join("deepseek-v3-fp8-tiny.dequantized.safetensors")).unwrap();
    let reference = SafeTensors::deserialize(&bytes).unwrap();
    let mut compared = 0;
    for (name, linear) in model.hf_parts().parts.linears {
        let Ok(view) = reference.tensor(&format!("{name}.weight")) else {
            continue;
        };
        let want: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(values(linear.weight.val().transpose()), want, "{name}");
        compared += 1;
    }
    assert!(
        compared >= 5,
        "the attention's and the dense layer's FP8 projections ({compared})"
    );
    let out = temp_dir("fp8-roundtrip");
    let report = model.save_hf(&src, &out, &Default::default()).unwrap().unwrap();
    assert!(!report.requantized.is_empty());
    for entry in std::fs::read_dir(&src).unwrap() {
        let name = entry.unwrap().file_name();
        let same = std::fs::read(src.join(&name)).unwrap() == std::fs::read(out.join(&name)).unwrap();
        assert!(same, "{name:?} differs after a round trip");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

/// DeepSeek-V3's multi-token-prediction layer (after the decoder's layers) is skipped and
/// reported, as transformers skips it; the same tensor in a Mixtral folder is refused.
#[test]
fn deepseeks_prediction_layer_is_reported_and_skipped() {
    let extra = |family: &str, layer: usize| {
        edited_copy(family, &format!("mtp-{family}"), move |_, index| {
            let map = index["weight_map"].as_object_mut().unwrap();
            let shard = map["model.norm.weight"].clone();
            map.insert(format!("model.layers.{layer}.eh_proj.weight"), shard);
        })
    };
    let dir = extra("deepseek-v3-tiny", 3);
    let model = MoeCausalLm::<B>::from_hf(&dir, &Default::default(), Arc::new(SingleRank)).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(model.ignored_tensors(), ["model.layers.3.eh_proj.weight"]);
    let err = load_error(&extra("mixtral-tiny", 3));
    assert!(err.contains("model.layers.3.eh_proj.weight"), "{err}");
}

/// Llama 4 as Meta publishes it: the text model inside a multimodal checkpoint
/// (`language_model.model.*`, `language_model.lm_head`, a vision tower beside). The text model
/// loads with the vision tower reported as not loaded, and computes what the text-only folder
/// with the same weights computes.
#[test]
fn llama4s_text_model_loads_from_the_multimodal_release() {
    let hf = data().join("../hf/generated");
    let device = Default::default();
    let multimodal =
        MoeCausalLm::<B>::from_hf(hf.join("llama4-multimodal-tiny"), &device, Arc::new(SingleRank)).unwrap();
    let text = MoeCausalLm::<B>::from_hf(hf.join("llama4-tiny"), &device, Arc::new(SingleRank)).unwrap();
    assert!(multimodal
        .ignored_tensors()
        .iter()
        .all(|n| !n.starts_with("language_model.")));
    assert!(multimodal
        .ignored_tensors()
        .iter()
        .any(|n| n.starts_with("vision_model.")));
    assert!(text.ignored_tensors().is_empty());
    let ids = || Tensor::<B, 2, Int>::from_data(TensorData::new(vec![1i64, 7, 3, 9, 4], [1, 5]), &device);
    let (a, b) = (
        values(multimodal.forward(ids(), None).logits),
        values(text.forward(ids(), None).logits),
    );
    assert_eq!(a, b);
}
