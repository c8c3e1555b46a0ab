//! Quantised Hugging Face checkpoints in and out, against the project's own
//! (`tests/data/hf/generated`): FP8 block-scaled weights (DeepSeek-V3 and Qwen3 as published,
//! `make_fp8.py`) and MXFP4 experts (GPT-OSS as published, `make_mxfp4.py`). Each import is
//! compared bit for bit with what transformers' loader dequantised, and each export of changed
//! weights with transformers' own quantiser.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::TensorData;
use mpipemoe::comm::SingleRank;
use mpipemoe::format::TensorMap;
use mpipemoe::hf::{self, HfLayer};
use mpipemoe::{LocalGroup, MoeLayer};

mod common;
use common::scratch_dir;

type B = Autodiff<NdArray>;

/// The project's own checkpoints, written by transformers (`tests/data/hf/generated/*.py`).
fn generated() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf/generated")
}

fn bytes(data: &TensorData) -> Vec<u8> {
    data.as_bytes().to_vec()
}

type Stored = (safetensors::Dtype, Vec<usize>, Vec<u8>);

/// Every tensor of one safetensors file.
fn file_tensors(path: &Path) -> BTreeMap<String, Stored> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| (name, (view.dtype(), view.shape().to_vec(), view.data().to_vec())))
        .collect()
}

/// Every tensor of the checkpoint in `source` (all shards).
fn all_tensors(source: &Path) -> BTreeMap<String, Stored> {
    let mut all = BTreeMap::new();
    for entry in std::fs::read_dir(source).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            all.extend(file_tensors(&path));
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

/// `config`'s JSON without `quantization_config`.
fn unquantised(config: &str) -> String {
    let mut json: serde_json::Value = serde_json::from_str(config).unwrap();
    json.as_object_mut().unwrap().remove("quantization_config");
    json.to_string()
}

/// Reads MoE layer `layer` of `got` and of `want` and requires the same canonical tensors,
/// bit for bit; returns `got`'s.
fn assert_same_layer(got: &Path, want: &Path, layer: usize) -> (HfLayer, TensorMap) {
    let (info, tensors) = hf::read_layer(got, layer, 0..8).unwrap();
    let (_, reference) = hf::read_layer(want, layer, 0..8).unwrap();
    assert_eq!(tensors.len(), reference.len());
    for (name, data) in &reference {
        assert!(bytes(&tensors[name]) == bytes(data), "layer {layer}: {name}");
    }
    (info, tensors)
}

/// Every file of `source` is in `out` with the same bytes.
fn assert_same_files(source: &Path, out: &Path) {
    for entry in std::fs::read_dir(source).unwrap() {
        let name = entry.unwrap().file_name();
        assert!(
            std::fs::read(source.join(&name)).unwrap() == std::fs::read(out.join(&name)).unwrap(),
            "{} changed on an unchanged export",
            name.to_string_lossy()
        );
    }
}

/// `tensors` with the canonical tensors `names` multiplied by `factor` (in f32).
fn scaled(tensors: &TensorMap, names: &[&str], factor: f32) -> TensorMap {
    let mut out = tensors.clone();
    for &name in names {
        let data = &tensors[name];
        let values: Vec<f32> = data.to_vec::<f32>().unwrap().iter().map(|v| v * factor).collect();
        out.insert(name.into(), TensorData::new(values, data.shape.clone()));
    }
    out
}

/// Every tensor of the reference file `reference` is in the checkpoint `out` with the same
/// dtype, shape and bytes. Returns how many there are.
fn assert_written_as(out: &Path, reference: &str) -> usize {
    let written = all_tensors(out);
    let want = file_tensors(&generated().join(reference));
    for (name, tensor) in &want {
        assert!(
            written[name] == *tensor,
            "{name} differs from transformers' quantisation"
        );
    }
    want.len()
}

/// (name, tensors, config.json, what the error must name)
type BadCase<'a> = (&'a str, BTreeMap<String, Stored>, String, Vec<&'a str>);

/// Each bad checkpoint, written in `dir`, fails to import layer 1 with an error naming every
/// needle.
fn assert_refused(dir: &Path, cases: Vec<BadCase>) {
    for (i, (name, tensors, config, needles)) in cases.into_iter().enumerate() {
        let ckpt = dir.join(format!("{name}-{i}"));
        write_single(&ckpt, &tensors, &config);
        let err = hf::read_layer(&ckpt, 1, 0..8).unwrap_err().to_string();
        for needle in needles {
            assert!(err.contains(needle), "{name}: {needle:?} not in {err}");
        }
    }
}

#[test]
fn fp8_block_scaled_weights_import_as_transformers_dequantises_them() {
    let dir = scratch_dir("hf-fp8");
    let fp8 = generated().join("deepseek-v3-fp8-tiny");
    // transformers' dequantised weights (float32) in place of each FP8 weight and its scale,
    // every other tensor widened to float32 (exact), no quantization_config: the checkpoint
    // the FP8 one must import as, bit for bit.
    let dequantized = file_tensors(&generated().join("deepseek-v3-fp8-tiny.dequantized.safetensors"));
    let mut reference = BTreeMap::new();
    let mut quantised = 0;
    for (name, t) in &all_tensors(&fp8) {
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
    let reference_dir = dir.join("reference");
    write_single(&reference_dir, &reference, &unquantised(&config));

    let (info, got) = assert_same_layer(&fp8, &reference_dir, 1);
    assert_eq!(
        info.dtype.as_deref(),
        Some("bfloat16 + float8_e4m3fn in 8 x 16 blocks")
    );
    // The dequantised experts are not the bf16 originals (FP8 is lossy): the test sees the
    // quantisation, not a copy of the unquantised checkpoint.
    let original = generated().join("../deepseek-v3-tiny");
    let (_, original) = hf::read_layer(original, 1, 0..8).unwrap();
    assert!(bytes(&got["experts.w_in"]) != bytes(&original["experts.w_in"]));
    // Two ranks read their halves of the same values.
    let halves = LocalGroup::run(2, |ctx| {
        let layer = MoeLayer::<B>::from_hf_rank(&fp8, 1, &Default::default(), ctx.comm.clone())?;
        layer.gather_tensor_map()
    })
    .unwrap();
    let whole = halves[0].as_ref().unwrap();
    assert!(bytes(&whole["experts.w_out"]) == bytes(&got["experts.w_out"]));

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
        report
            .requantized
            .iter()
            .all(|r| r.rescaled_blocks == 0 && r.format == "float8_e4m3fn"),
        "{report:?}"
    );
    assert_same_files(&fp8, &out);
    // Weights times 4 fit no stored scale: every block is quantised afresh, bit for bit as
    // transformers' Fp8Quantize does it (make_fp8.py).
    let names = ["experts.w_in", "experts.w_out", "shared.w_in", "shared.w_out"];
    let out4 = dir.join("export-x4");
    let report = hf::write_layer(&fp8, 1, &scaled(&got, &names, 4.0), &out4).unwrap();
    assert!(
        report.requantized.iter().all(|r| r.rescaled_blocks == r.blocks),
        "{report:?}"
    );
    let written = assert_written_as(&out4, "deepseek-v3-fp8-tiny.requantized-x4.safetensors");
    assert_eq!(written, 2 * report.requantized.len());
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
    wrong.get_mut(scale).unwrap().1 = vec![4, 1];
    cases.push((
        "wrong-shape",
        wrong,
        config.clone(),
        vec![scale, "[4, 1]", "[2, 2]"],
    ));
    // No quantization_config at all.
    cases.push((
        "no-config",
        stored.clone(),
        unquantised(&config),
        vec!["float8_e4m3fn", "quantization_config", "model.layers.1.mlp."],
    ));
    // A method that is neither.
    let mut json: serde_json::Value = serde_json::from_str(&config).unwrap();
    json["quantization_config"]["quant_method"] = "gptq".into();
    cases.push((
        "other-method",
        stored.clone(),
        json.to_string(),
        vec!["config.json", "quant_method", "gptq"],
    ));
    assert_refused(&dir, cases);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn mxfp4_experts_import_as_transformers_dequantises_them() {
    let dir = scratch_dir("hf-mxfp4");
    let mxfp4 = generated().join("gpt-oss-mxfp4-tiny");
    // The MXFP4 checkpoint's tensors with transformers' dequantised experts (bfloat16) in
    // place of each projection's `_blocks` and `_scales`, no quantization_config: what
    // `from_pretrained(..., Mxfp4Config(dequantize=True))` loads (make_mxfp4.py).
    let dequantized = file_tensors(&generated().join("gpt-oss-mxfp4-tiny.dequantized.safetensors"));
    assert_eq!(dequantized.len(), 4, "two projections in each of two layers");
    let mut reference: BTreeMap<String, Stored> = all_tensors(&mxfp4)
        .into_iter()
        .filter(|(name, _)| !name.ends_with("_blocks") && !name.ends_with("_scales"))
        .collect();
    reference.extend(dequantized);
    let config = std::fs::read_to_string(mxfp4.join("config.json")).unwrap();
    let reference_dir = dir.join("reference");
    write_single(&reference_dir, &reference, &unquantised(&config));
    for layer in [0, 1] {
        let (info, _) = assert_same_layer(&mxfp4, &reference_dir, layer);
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
    // byte.
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
    assert_same_files(&mxfp4, &out);
    // Times 1.3, no block's values are codes at its stored exponent any more: each is
    // quantised afresh, bit for bit as triton_kernels' quantiser (transformers'
    // Mxfp4Quantize) does it (make_mxfp4.py).
    let out = dir.join("export-x1.3");
    let changed = scaled(&got, &["experts.w_in", "experts.w_out"], 1.3);
    let report = hf::write_layer(&mxfp4, 1, &changed, &out).unwrap();
    assert!(
        report.requantized.iter().all(|r| r.rescaled_blocks == r.blocks),
        "{report:?}"
    );
    let reference = "gpt-oss-mxfp4-tiny.requantized-x1.3.safetensors";
    assert_eq!(assert_written_as(&out, reference), 4);
    // The biases, the router and layer 0 are as they were.
    let requantized = file_tensors(&generated().join(reference));
    let written = all_tensors(&out);
    for (name, tensor) in all_tensors(&mxfp4) {
        if !requantized.contains_key(&name) {
            assert!(written[&name] == tensor, "{name} changed");
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
    cases.push((
        "no-config",
        stored.clone(),
        unquantised(&config),
        vec!["missing tensor", "model.layers.1.mlp.experts.gate_up_proj`"],
    ));
    assert_refused(&dir, cases);
    std::fs::remove_dir_all(&dir).ok();
}

/// The generated GPT-OSS checkpoints the MXFP4 benchmark compares (`hf_mxfp4`): every layer
/// imports, and exports unchanged to the same files; MXFP4 refuses widths that do not pack
/// by 32.
#[test]
fn generated_gpt_oss_checkpoints_round_trip_in_bf16_and_mxfp4() {
    use mpipemoe::harness::{write_synthetic_checkpoint, SyntheticCheckpoint, SyntheticFamily};
    let dir = scratch_dir("hf-synthetic-gpt-oss");
    let spec = |family| SyntheticCheckpoint {
        family,
        n_layers: 3,
        n_experts: 4,
        top_k: 2,
        d_model: 64,
        d_hidden: 32,
        n_shards: 2,
        bf16: true,
        seed: 5,
    };
    for (family, name) in [
        (SyntheticFamily::GptOss, "bf16"),
        (SyntheticFamily::GptOssMxfp4, "mxfp4"),
    ] {
        let source = dir.join(name);
        write_synthetic_checkpoint(&source, &spec(family)).unwrap();
        let layers =
            MoeLayer::<B>::from_hf_layers(&source, &Default::default(), Arc::new(SingleRank)).unwrap();
        assert_eq!(layers.len(), 3, "{name}");
        let refs: Vec<(usize, &MoeLayer<B>)> = layers.iter().map(|(l, layer)| (*l, layer)).collect();
        let out = dir.join(format!("{name}-out"));
        MoeLayer::save_hf_layers(&refs, &source, &out).unwrap();
        assert_same_files(&source, &out);
        let (info, _) = hf::read_layer(&source, 2, 0..4).unwrap();
        let quantised = info.dtype.as_deref().is_some_and(|d| d.contains("mxfp4"));
        assert_eq!(
            quantised,
            family == SyntheticFamily::GptOssMxfp4,
            "{name}: {:?}",
            info.dtype
        );
    }
    let err = write_synthetic_checkpoint(
        &dir.join("narrow"),
        &SyntheticCheckpoint {
            d_hidden: 48,
            ..spec(SyntheticFamily::GptOssMxfp4)
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("multiples of 32"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
