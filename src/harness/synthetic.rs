//! A generated Mixtral-style Hugging Face checkpoint of any depth, for tests and benchmarks
//! that need more MoE layers than the tiny checkpoints transformers wrote for the tests.
//!
//! The layout follows what transformers' `save_pretrained` writes for Mixtral (the names,
//! `config.json` keys and index of `tests/data/hf/mixtral-tiny`): every layer's attention
//! and norm tensors besides its MoE block, so shard headers are as long as real ones, and
//! shards filled in layer order.

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

/// The shape of a generated checkpoint.
#[derive(Debug, Clone, Copy)]
pub struct SyntheticCheckpoint {
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
    std::fs::create_dir_all(dir).map_err(|e| MoeError::file(dir, format!("cannot create: {e}")))?;
    let tensors = tensor_list(s);
    let dtype = if s.bf16 { Dtype::BF16 } else { Dtype::F32 };
    let mut rng = s.seed ^ 0x9E37_79B9_7F4A_7C15;
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, shape, _)| {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = (0..n).map(|_| 0.2 * normalish(&mut rng)).collect();
            let data = TensorData::new(values, [n]);
            if s.bf16 {
                data.convert::<bf16>().as_bytes().to_vec()
            } else {
                data.as_bytes().to_vec()
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
            .filter(|((_, _, at), _)| *at == shard)
            .map(|((name, shape, _), bytes)| {
                weight_map.insert(name.clone(), shard_name(shard));
                total += bytes.len() as u64;
                let view = TensorView::new(dtype, shape.clone(), bytes)
                    .map_err(|e| MoeError::config("spec", format!("tensor `{name}`: {e:?}")))?;
                Ok((name.clone(), view))
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

/// Every tensor of the checkpoint in the order transformers lists them, with its shape and
/// the shard it goes to: the embeddings in the first, the final norm and head in the last,
/// the layers spread evenly.
fn tensor_list(s: &SyntheticCheckpoint) -> Vec<(String, Vec<usize>, usize)> {
    let (m, h, e, vocab) = (s.d_model, s.d_hidden, s.n_experts, VOCAB);
    let mut tensors: Vec<(String, Vec<usize>, usize)> =
        vec![("model.embed_tokens.weight".into(), vec![vocab, m], 0)];
    for l in 0..s.n_layers {
        let shard = l * s.n_shards / s.n_layers;
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![m]),
            ("post_attention_layernorm.weight", vec![m]),
            ("self_attn.q_proj.weight", vec![m, m]),
            ("self_attn.k_proj.weight", vec![m, m]),
            ("self_attn.v_proj.weight", vec![m, m]),
            ("self_attn.o_proj.weight", vec![m, m]),
            ("block_sparse_moe.gate.weight", vec![e, m]),
        ] {
            tensors.push((format!("{p}.{name}"), shape, shard));
        }
        for x in 0..e {
            for (w, shape) in [("w1", vec![h, m]), ("w2", vec![m, h]), ("w3", vec![h, m])] {
                tensors.push((
                    format!("{p}.block_sparse_moe.experts.{x}.{w}.weight"),
                    shape,
                    shard,
                ));
            }
        }
    }
    let last = s.n_shards - 1;
    tensors.push(("model.norm.weight".into(), vec![m], last));
    tensors.push(("lm_head.weight".into(), vec![vocab, m], last));
    tensors
}

/// `config.json` as transformers writes it for Mixtral, with the keys the importer reads.
fn config_json(s: &SyntheticCheckpoint) -> serde_json::Value {
    json!({
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "dtype": if s.bf16 { "bfloat16" } else { "float32" },
        "hidden_act": "silu",
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
        "router_jitter_noise": 0.0,
        "tie_word_embeddings": false,
        "vocab_size": VOCAB,
    })
}

/// A cheap, deterministic, roughly normal value (the sum of four uniforms, centred and scaled
/// to unit variance): enough for routing that is not degenerate.
fn normalish(state: &mut u64) -> f32 {
    let mut sum = 0.0f32;
    for _ in 0..4 {
        // xorshift64*
        *state ^= *state >> 12;
        *state ^= *state << 25;
        *state ^= *state >> 27;
        let bits = state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        sum += bits as f32 / (1u64 << 24) as f32;
    }
    (sum - 2.0) * (3.0f32).sqrt()
}
