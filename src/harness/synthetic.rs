//! A generated Hugging Face checkpoint of any depth, for tests and benchmarks that need more
//! MoE layers, or wider ones, than the tiny checkpoints transformers wrote for the tests.
//!
//! The layout follows what transformers' `save_pretrained` writes for Mixtral (the names,
//! `config.json` keys and index of `tests/data/hf/mixtral-tiny`) or GPT-OSS (those of
//! `tests/data/hf/generated/gpt-oss-tiny`, and with its experts in MXFP4 those of the Hub's
//! releases): every layer's attention and norm tensors besides its MoE block, so shard
//! headers are as long as real ones, and shards filled in layer order.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::tensor::{bf16, TensorData};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use crate::error::{MoeError, Result};
use crate::files::write_whole;

/// The vocabulary of the embeddings and the head (their size does not matter here).
const VOCAB: usize = 64;

/// The architecture and storage of a generated checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyntheticFamily {
    /// Mixtral: one matrix per projection and expert.
    Mixtral,
    /// GPT-OSS with its stacked experts stored as they are.
    GptOss,
    /// GPT-OSS with its stacked experts in MXFP4 (`_blocks` of random codes, `_scales` of
    /// exponents 119..=123), as the Hub's releases store them; `d_model` and `d_hidden` must
    /// be multiples of 32.
    GptOssMxfp4,
}

/// The shape of a generated checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct SyntheticCheckpoint {
    /// The architecture and how its experts are stored.
    pub family: SyntheticFamily,
    /// Decoder layers, every one a MoE layer (Mixtral).
    pub n_layers: usize,
    /// Experts per layer.
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Token width `M`.
    pub d_model: usize,
    /// Expert hidden width `H`.
    pub d_hidden: usize,
    /// Safetensors shards (at least 1, at most `n_layers + 1`).
    pub n_shards: usize,
    /// Stored as bfloat16 (else float32).
    pub bf16: bool,
    /// Seeds the weights (normal-ish, std about 0.2, as the tiny checkpoints').
    pub seed: u64,
}

/// Writes the checkpoint `spec` describes into `dir` (created; files in it are replaced).
/// Returns the bytes written.
///
/// # Errors
/// [`MoeError::Config`] if the spec is empty or has more shards than layers + 1;
/// [`MoeError::File`] if a file cannot be written.
pub fn write_synthetic_checkpoint(dir: &Path, spec: &SyntheticCheckpoint) -> Result<u64> {
    let s = spec;
    if s.n_layers == 0 || s.n_experts == 0 || s.d_model == 0 || s.d_hidden == 0 || s.top_k == 0 {
        return Err(MoeError::config("spec", "every size must be at least 1"));
    }
    if s.n_shards == 0 || s.n_shards > s.n_layers + 1 {
        return Err(MoeError::config(
            "n_shards",
            format!(
                "{} shards for {} layers (1 ..= layers + 1)",
                s.n_shards, s.n_layers
            ),
        ));
    }
    if s.family == SyntheticFamily::GptOssMxfp4
        && (!s.d_model.is_multiple_of(32) || !s.d_hidden.is_multiple_of(32))
    {
        return Err(MoeError::config(
            "d_model",
            format!(
                "MXFP4 packs by 32: d_model = {} and d_hidden = {} must be multiples of 32",
                s.d_model, s.d_hidden
            ),
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| MoeError::file(dir, format!("cannot create: {e}")))?;
    let tensors = tensor_list(s);
    let float = if s.bf16 { Dtype::BF16 } else { Dtype::F32 };
    let mut rng = s.seed ^ 0x9E37_79B9_7F4A_7C15;
    let data: Vec<(Dtype, Vec<u8>)> = tensors
        .iter()
        .map(|t| {
            let n: usize = t.shape.iter().product();
            match t.kind {
                Kind::Weight => {
                    let values: Vec<f32> = (0..n).map(|_| 0.2 * normalish(&mut rng)).collect();
                    let data = TensorData::new(values, [n]);
                    let bytes = match s.bf16 {
                        true => data.convert::<bf16>().as_bytes().to_vec(),
                        false => data.as_bytes().to_vec(),
                    };
                    (float, bytes)
                }
                // Every code, uniformly; exponents 119..=123 give weights of about the same
                // size as the float ones (a code's value times 2^-8 .. 2^-4).
                Kind::Codes => (Dtype::U8, (0..n).map(|_| (next(&mut rng) >> 56) as u8).collect()),
                Kind::Exponents => (
                    Dtype::U8,
                    (0..n).map(|_| 119 + (next(&mut rng) % 5) as u8).collect(),
                ),
            }
        })
        .collect();
    let shard_name = |i: usize| format!("model-{:05}-of-{:05}.safetensors", i + 1, s.n_shards);
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    let mut written = 0u64;
    for shard in 0..s.n_shards {
        let views = tensors
            .iter()
            .zip(&data)
            .filter(|(t, _)| t.shard == shard)
            .map(|(t, (dtype, bytes))| {
                weight_map.insert(t.name.clone(), shard_name(shard));
                total += bytes.len() as u64;
                let view = TensorView::new(*dtype, t.shape.clone(), bytes)
                    .map_err(|e| MoeError::config("spec", format!("tensor `{}`: {e:?}", t.name)))?;
                Ok((t.name.clone(), view))
            })
            .collect::<Result<Vec<_>>>()?;
        let info = HashMap::from([("format".to_string(), "pt".to_string())]);
        let path = dir.join(shard_name(shard));
        let bytes = safetensors::serialize(views, Some(info))
            .map_err(|e| MoeError::file(&path, format!("cannot encode: {e:?}")))?;
        written += bytes.len() as u64;
        write_whole(&path, &bytes, true)?;
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    let config = config_json(s);
    for (name, value) in [("model.safetensors.index.json", index), ("config.json", config)] {
        let text = serde_json::to_vec_pretty(&value).expect("JSON values serialize");
        written += text.len() as u64;
        write_whole(&dir.join(name), &text, true)?;
    }
    Ok(written)
}

/// What a generated tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Float weights.
    Weight,
    /// MXFP4 blocks: random bytes.
    Codes,
    /// MXFP4 scales: e8m0 exponents.
    Exponents,
}

/// One tensor of the checkpoint: its name, shape, shard and contents.
struct Synthetic {
    name: String,
    shape: Vec<usize>,
    shard: usize,
    kind: Kind,
}

/// Every tensor of the checkpoint in the order transformers lists them, with its shape and
/// the shard it goes to: the embeddings in the first, the final norm and head in the last,
/// the layers spread evenly.
fn tensor_list(s: &SyntheticCheckpoint) -> Vec<Synthetic> {
    let (m, h, e, vocab) = (s.d_model, s.d_hidden, s.n_experts, VOCAB);
    let mut tensors = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, shard: usize, kind: Kind| {
        tensors.push(Synthetic {
            name,
            shape,
            shard,
            kind,
        })
    };
    push(
        "model.embed_tokens.weight".into(),
        vec![vocab, m],
        0,
        Kind::Weight,
    );
    for l in 0..s.n_layers {
        let shard = l * s.n_shards / s.n_layers;
        let p = format!("model.layers.{l}");
        let mut layer = vec![
            ("input_layernorm.weight".to_string(), vec![m]),
            ("post_attention_layernorm.weight".into(), vec![m]),
            ("self_attn.q_proj.weight".into(), vec![m, m]),
            ("self_attn.k_proj.weight".into(), vec![m, m]),
            ("self_attn.v_proj.weight".into(), vec![m, m]),
            ("self_attn.o_proj.weight".into(), vec![m, m]),
        ];
        match s.family {
            SyntheticFamily::Mixtral => {
                layer.push(("block_sparse_moe.gate.weight".into(), vec![e, m]));
                for x in 0..e {
                    for (w, shape) in [("w1", vec![h, m]), ("w2", vec![m, h]), ("w3", vec![h, m])] {
                        layer.push((format!("block_sparse_moe.experts.{x}.{w}.weight"), shape));
                    }
                }
            }
            SyntheticFamily::GptOss | SyntheticFamily::GptOssMxfp4 => layer.extend([
                // GPT-OSS's attention has biases and a learned sink per head (4 heads).
                ("self_attn.q_proj.bias".into(), vec![m]),
                ("self_attn.k_proj.bias".into(), vec![m]),
                ("self_attn.v_proj.bias".into(), vec![m]),
                ("self_attn.o_proj.bias".into(), vec![m]),
                ("self_attn.sinks".into(), vec![4]),
                ("mlp.router.weight".into(), vec![e, m]),
                ("mlp.router.bias".into(), vec![e]),
                ("mlp.experts.gate_up_proj_bias".into(), vec![e, 2 * h]),
                ("mlp.experts.down_proj_bias".into(), vec![e, m]),
            ]),
        }
        for (name, shape) in layer {
            push(format!("{p}.{name}"), shape, shard, Kind::Weight);
        }
        // The stacked projections `[E, in, out]`, or in MXFP4 their blocks and exponents
        // `[E, out, in / 32, 16]` and `[E, out, in / 32]`.
        for (name, input, out) in [("gate_up_proj", m, 2 * h), ("down_proj", h, m)] {
            let name = format!("{p}.mlp.experts.{name}");
            match s.family {
                SyntheticFamily::Mixtral => {}
                SyntheticFamily::GptOss => push(name, vec![e, input, out], shard, Kind::Weight),
                SyntheticFamily::GptOssMxfp4 => {
                    push(
                        format!("{name}_blocks"),
                        vec![e, out, input / 32, 16],
                        shard,
                        Kind::Codes,
                    );
                    push(
                        format!("{name}_scales"),
                        vec![e, out, input / 32],
                        shard,
                        Kind::Exponents,
                    );
                }
            }
        }
    }
    let last = s.n_shards - 1;
    push("model.norm.weight".into(), vec![m], last, Kind::Weight);
    push("lm_head.weight".into(), vec![vocab, m], last, Kind::Weight);
    tensors
}

/// `config.json` as transformers writes it for the family, with the keys the importer reads.
fn config_json(s: &SyntheticCheckpoint) -> serde_json::Value {
    let mut config = json!({
        "dtype": if s.bf16 { "bfloat16" } else { "float32" },
        "hidden_size": s.d_model,
        "intermediate_size": s.d_hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_experts_per_tok": s.top_k,
        "num_hidden_layers": s.n_layers,
        "num_local_experts": s.n_experts,
        "output_router_logits": false,
        "rms_norm_eps": 1e-05,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": false,
        "vocab_size": VOCAB,
    });
    let family = match s.family {
        SyntheticFamily::Mixtral => json!({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "hidden_act": "silu",
            "router_jitter_noise": 0.0,
        }),
        SyntheticFamily::GptOss => json!({
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "head_dim": s.d_model / 4,
            "swiglu_limit": 7.0,
        }),
        // As in openai/gpt-oss-20b's config.json.
        SyntheticFamily::GptOssMxfp4 => json!({
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "head_dim": s.d_model / 4,
            "swiglu_limit": 7.0,
            "quantization_config": {
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head"
                ],
                "quant_method": "mxfp4"
            },
        }),
    };
    if let (Some(config), Some(family)) = (config.as_object_mut(), family.as_object()) {
        config.extend(family.clone());
    }
    config
}

/// The next value of a xorshift64* generator.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// A cheap, deterministic, roughly normal value (the sum of four uniforms, centred and scaled
/// to unit variance): enough for routing that is not degenerate.
fn normalish(state: &mut u64) -> f32 {
    let mut sum = 0.0f32;
    for _ in 0..4 {
        sum += (next(state) >> 40) as f32 / (1u64 << 24) as f32;
    }
    (sum - 2.0) * (3.0f32).sqrt()
}
