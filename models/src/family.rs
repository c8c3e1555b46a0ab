//! The families: how a Hugging Face `config.json` maps onto [`DecoderConfig`], and which rule
//! each switches on. A family is a description of its differences from the common decoder
//! (as transformers' "modular" files describe one model as a difference from another), not a
//! copy of it:
//!
//! | `model_type` | q/k/v bias | o bias | q/k norm | clip | sliding window | dense layers |
//! |---|---|---|---|---|---|---|
//! | `mixtral` | no | no | none | no | `sliding_window`, every layer | none |
//! | `qwen2_moe` | `qkv_bias` | no | none | no | `layer_types` (or `use_sliding_window`, `max_window_layers`) | `mlp_only_layers`, `decoder_sparse_step` |
//! | `qwen3_moe` | `attention_bias` | `attention_bias` | per head | no | `sliding_window` if `use_sliding_window` | `mlp_only_layers`, `decoder_sparse_step` |
//! | `olmoe` | `attention_bias` | `attention_bias` | whole projection | `clip_qkv` | none | none |
//! | `llama4_text` (and `llama4`'s text model) | `attention_bias` | `attention_bias` | L2 after rotary (`use_qk_norm`) | no | chunks (`layer_types`, `attention_chunk_size`) | `moe_layers` / `interleave_moe_layer_step` |
//! | `gpt_oss` | `attention_bias` | `attention_bias` | none (sinks per head) | no | `layer_types` | none |
//! | `deepseek_v3` | latent attention: `attention_bias` on `q_a`, `kv_a`, `o` | | `q_a` / `kv_a` latent norms | no | none | `first_k_dense_replace` |
//!
//! DeepSeek-V3's attention is multi-head latent attention ([`LatentAttention`](crate::LatentAttention):
//! `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`,
//! `rope_interleave`), its rotary embedding covers `qk_rope_head_dim`, and under YaRN with
//! `mscale_all_dim` its softmax scale is multiplied by `mscale²` (transformers'
//! `yarn_apply_mscale`).
//!
//! Which layers are MoE is decided by mpipemoe's checkpoint reader
//! ([`HfCheckpoint::moe_layers`](mpipemoe::hf::HfCheckpoint::moe_layers)), as transformers
//! decides it, and it refuses a folder whose tensors disagree.

use std::path::PathBuf;

use mpipemoe::hf::HfCheckpoint;
use mpipemoe::{MoeError, Result};
use serde_json::Value;

use crate::attention::QkNorm;
use crate::config::{AttnRules, DecoderConfig, FfnKind, LayerSpec};
use crate::generation::GenerationDefaults;
use crate::latent::LatentConfig;
use crate::rotary::RopeScaling;

/// The `model_type`s whole models are built for.
pub const SUPPORTED: [&str; 7] = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v3",
    "gpt_oss",
    "llama4_text",
];

/// Reads the folder's `config.json` into a [`DecoderConfig`].
///
/// # Errors
/// [`MoeError::File`] naming `config.json` and the key if the family is not one of
/// [`SUPPORTED`] (naming them), a key is missing or of the wrong type, or the folder uses a
/// rule not built yet (a rotary scaling other than default, linear, llama3 or yarn).
pub fn decoder_config(ckpt: &HfCheckpoint) -> Result<DecoderConfig> {
    let keys = Keys {
        json: ckpt.config_json(),
        source: ckpt.dir().join("config.json"),
    };
    let model_type = keys.str("model_type")?;
    if !SUPPORTED.contains(&model_type.as_str()) {
        return Err(keys.error(format!(
            "`model_type` {model_type:?} has no whole-model support yet (supported: {}); its MoE layers import with `MoeLayer::from_hf`",
            SUPPORTED.join(", ")
        )));
    }
    let d_model = keys.usize("hidden_size")?;
    let n_heads = keys.usize("num_attention_heads")?;
    let latent = match model_type.as_str() {
        "deepseek_v3" => Some(keys.latent()?),
        _ => None,
    };
    // Latent attention expands every head's keys and values: no grouping.
    let n_kv_heads = match latent {
        Some(_) => n_heads,
        None => keys.usize_or("num_key_value_heads", n_heads)?,
    };
    let head_dim = match latent {
        Some(c) => c.qk_rope_head_dim,
        None => keys.usize_or("head_dim", d_model / n_heads.max(1))?,
    };
    let n_layers = ckpt
        .config_json()
        .get("num_hidden_layers")
        .and_then(Value::as_u64)
        .unwrap_or(0) as usize;
    let moe_layers = ckpt.moe_layers()?;
    let mut layers = Vec::with_capacity(n_layers);
    for layer in 0..n_layers {
        let ffn = match moe_layers.contains(&layer) {
            true => FfnKind::Moe(Box::new(ckpt.layer(layer)?.config)),
            false => FfnKind::Dense {
                d_hidden: match model_type.as_str() {
                    "llama4_text" => keys.usize("intermediate_size_mlp")?,
                    _ => keys.usize("intermediate_size")?,
                },
            },
        };
        layers.push(LayerSpec {
            ffn,
            attn: keys.attn_rules(&model_type, layer)?,
        });
    }
    // transformers' `generate` stops at `generation_config.json`'s ids where the folder has
    // that file, and takes its sampling defaults from it.
    let generation = GenerationDefaults::read(ckpt.dir())?;
    let attention_bias = keys.bool_or("attention_bias", false)?;
    let (rope_theta, rope_scaling) = keys.rope()?;
    let attention_sinks = model_type == "gpt_oss";
    let llama4 = model_type == "llama4_text";
    let (qkv_bias, o_bias, qk_norm, clip_qkv) = match model_type.as_str() {
        "mixtral" => (false, false, QkNorm::None, None),
        "qwen2_moe" => (keys.bool_or("qkv_bias", true)?, false, QkNorm::None, None),
        "qwen3_moe" => (attention_bias, attention_bias, QkNorm::PerHead, None),
        // Latent attention reads `attention_bias` as `o_bias` (on q_a, kv_a and o).
        "deepseek_v3" => (false, attention_bias, QkNorm::None, None),
        "gpt_oss" | "llama4_text" => (attention_bias, attention_bias, QkNorm::None, None),
        _ => (
            attention_bias,
            attention_bias,
            QkNorm::Whole,
            keys.f64_opt("clip_qkv")?,
        ),
    };
    let config = DecoderConfig {
        model_type,
        vocab_size: keys.usize("vocab_size")?,
        d_model,
        n_heads,
        n_kv_heads,
        head_dim,
        rms_eps: keys.f64_opt("rms_norm_eps")?.unwrap_or(1e-6),
        rope_theta,
        rope_scaling,
        qkv_bias,
        o_bias,
        qk_norm,
        clip_qkv,
        attention_sinks,
        layers,
        tie_embeddings: keys.bool_or("tie_word_embeddings", false)?,
        eos_token_ids: match &generation.eos_token_ids {
            Some(ids) => ids.clone(),
            None => keys.ids("eos_token_id")?,
        },
        generation,
        max_positions: match keys.get("max_position_embeddings") {
            None => None,
            Some(_) => Some(keys.usize("max_position_embeddings")?),
        },
        latent,
        hf_root: ckpt.root().to_string(),
        mlp_name: if llama4 { "feed_forward" } else { "mlp" }.to_string(),
        rope_pairs: llama4,
    };
    config.validate().map_err(|e| keys.error(e.to_string()))?;
    Ok(config)
}

/// `config.json`'s keys, with errors that name the file and the key.
struct Keys<'a> {
    json: &'a Value,
    source: PathBuf,
}

impl Keys<'_> {
    fn error(&self, reason: impl Into<String>) -> MoeError {
        MoeError::file(&self.source, reason)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    fn str(&self, key: &str) -> Result<String> {
        self.get(key)
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| self.error(format!("missing or non-string `{key}`")))
    }

    fn usize(&self, key: &str) -> Result<usize> {
        let v = self
            .get(key)
            .and_then(Value::as_u64)
            .ok_or_else(|| self.error(format!("missing or non-integer `{key}`")))?;
        // The tensors' stored shapes are checked against these before anything is allocated
        // from them; the bound keeps the products of a few far from overflow until then.
        if v > 1 << 32 {
            return Err(self.error(format!("`{key}` is {v}, over 2^32")));
        }
        Ok(v as usize)
    }

    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.usize(key),
        }
    }

    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.error(format!("`{key}` is not true or false"))),
        }
    }

    fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .map(Some)
                .ok_or_else(|| self.error(format!("`{key}` is not a positive number"))),
        }
    }

    /// An id or a list of ids (`eos_token_id`); none if absent.
    fn ids(&self, key: &str) -> Result<Vec<usize>> {
        let bad = || self.error(format!("`{key}` is not a token id or a list of them"));
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(ids)) => ids
                .iter()
                .map(|v| v.as_u64().map(|id| id as usize).ok_or_else(bad))
                .collect(),
            Some(v) => Ok(vec![v.as_u64().ok_or_else(bad)? as usize]),
        }
    }

    /// `rope_parameters` (transformers 5) or `rope_theta` / `rope_scaling` (4.x): the base
    /// and the scaling rule, with transformers' defaults (`_compute_*_parameters` in
    /// `modeling_rope_utils.py`). `"dynamic"` (frequencies that change with the sequence
    /// length) and `"longrope"` are refused.
    fn rope(&self) -> Result<(f64, RopeScaling)> {
        let (theta, params) = match self.get("rope_parameters") {
            Some(p) => (p.get("rope_theta").and_then(Value::as_f64), Some(p)),
            None => (
                self.get("rope_theta").and_then(Value::as_f64),
                self.get("rope_scaling"),
            ),
        };
        let theta = theta
            .filter(|t| t.is_finite() && *t > 1.0)
            .ok_or_else(|| self.error("missing `rope_theta`, or not a number over 1"))?;
        let Some(params) = params.filter(|p| !p.is_null()) else {
            return Ok((theta, RopeScaling::None));
        };
        let kind = params
            .get("rope_type")
            .or_else(|| params.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let number = |key: &str| -> Result<Option<f64>> {
            match params.get(key).filter(|v| !v.is_null()) {
                None => Ok(None),
                Some(v) => v
                    .as_f64()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .map(Some)
                    .ok_or_else(|| self.error(format!("rotary scaling's `{key}` is not a positive number"))),
            }
        };
        let needed = |key: &str| -> Result<f64> {
            number(key)?.ok_or_else(|| self.error(format!("rotary scaling {kind:?} needs `{key}`")))
        };
        let scaling = match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: needed("factor")?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: needed("factor")?,
                low_freq_factor: needed("low_freq_factor")?,
                high_freq_factor: needed("high_freq_factor")?,
                original_max_position_embeddings: needed("original_max_position_embeddings")?,
            },
            "yarn" => {
                // transformers' `_validate_yarn_parameters` requires `factor`; deriving one
                // from the positions would give 0 for a config without them and fail far
                // from here, naming neither the file nor the key.
                let original = needed("original_max_position_embeddings")?;
                let factor = needed("factor")?;
                let mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let attention_factor = match (
                    number("attention_factor")?,
                    number("mscale")?,
                    number("mscale_all_dim")?,
                ) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(all)) => mscale(factor, m) / mscale(factor, all),
                    _ => mscale(factor, 1.0),
                };
                RopeScaling::Yarn {
                    factor,
                    attention_factor,
                    beta_fast: number("beta_fast")?.unwrap_or(32.0),
                    beta_slow: number("beta_slow")?.unwrap_or(1.0),
                    original_max_position_embeddings: original,
                    truncate: params.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                }
            }
            other => {
                return Err(self.error(format!(
                "rotary scaling {other:?} (`rope_type`) is not built: default, linear, llama3 and yarn are"
            )))
            }
        };
        Ok((theta, scaling))
    }

    /// Layer `layer`'s attention rules: its window by the family's rule, and Llama 4's
    /// chunks, NoPE layers, L2 q/k norm and temperature tuning.
    fn attn_rules(&self, model_type: &str, layer: usize) -> Result<AttnRules> {
        let mut rules = AttnRules {
            window: self.window(model_type, layer)?,
            ..AttnRules::default()
        };
        if model_type == "llama4_text" {
            // `no_rope_layers[i]` is 1 where the layer *uses* rotary embeddings; absent, every
            // `no_rope_layer_interval`-th layer is NoPE (transformers' default).
            rules.rope = match self.get("no_rope_layers").and_then(Value::as_array) {
                Some(flags) => flags
                    .get(layer)
                    .and_then(Value::as_u64)
                    .map(|f| f != 0)
                    .ok_or_else(|| self.error(format!("`no_rope_layers` has no 0 or 1 for layer {layer}")))?,
                None => !(layer + 1).is_multiple_of(self.usize_or("no_rope_layer_interval", 4)?.max(1)),
            };
            if self.layer_type(layer)? == "chunked_attention" {
                rules.chunk = Some(self.usize("attention_chunk_size")?);
            }
            rules.l2_qk_norm = self.bool_or("use_qk_norm", true)? && rules.rope;
            if self.bool_or("attn_temperature_tuning", true)? && !rules.rope {
                let attn_scale = self.f64_opt("attn_scale")?.unwrap_or(0.1);
                let floor_scale = self.f64_opt("floor_scale")?.unwrap_or(8192.0);
                rules.temperature = Some((attn_scale, floor_scale));
            }
        }
        Ok(rules)
    }

    /// `layer_types[layer]`: `sliding_attention`, `chunked_attention` or `full_attention`.
    fn layer_type(&self, layer: usize) -> Result<String> {
        let kind = self
            .get("layer_types")
            .and_then(Value::as_array)
            .and_then(|t| t.get(layer))
            .and_then(Value::as_str)
            .ok_or_else(|| self.error(format!("`layer_types` has no string for layer {layer}")))?;
        match kind {
            "sliding_attention" | "chunked_attention" | "full_attention" => Ok(kind.to_string()),
            other => Err(self.error(format!("`layer_types`[{layer}] is {other:?}"))),
        }
    }

    /// DeepSeek-V3's latent attention, with its softmax scale.
    fn latent(&self) -> Result<LatentConfig> {
        let q_lora_rank = match self.get("q_lora_rank") {
            None => None,
            Some(_) => Some(self.usize("q_lora_rank")?),
        };
        let (nope, rope) = (self.usize("qk_nope_head_dim")?, self.usize("qk_rope_head_dim")?);
        let mut softmax_scale = ((nope + rope) as f64).powf(-0.5);
        // transformers' `yarn_apply_mscale`: any scaled rope with a non-zero `mscale_all_dim`.
        if let Some(p) = self.get("rope_parameters").or_else(|| self.get("rope_scaling")) {
            let kind = p
                .get("rope_type")
                .or_else(|| p.get("type"))
                .and_then(Value::as_str);
            let all_dim = p.get("mscale_all_dim").and_then(Value::as_f64).unwrap_or(0.0);
            if kind.is_some_and(|k| k != "default") && all_dim != 0.0 {
                let factor = p
                    .get("factor")
                    .and_then(Value::as_f64)
                    .ok_or_else(|| self.error("rotary scaling with `mscale_all_dim` needs `factor`"))?;
                let mscale = if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * all_dim * factor.ln() + 1.0
                };
                softmax_scale *= mscale * mscale;
            }
        }
        Ok(LatentConfig {
            q_lora_rank,
            kv_lora_rank: self.usize("kv_lora_rank")?,
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rope,
            v_head_dim: self.usize("v_head_dim")?,
            rope_interleave: self.bool_or("rope_interleave", true)?,
            softmax_scale,
        })
    }

    /// Layer `layer`'s sliding window, by its family's rule.
    fn window(&self, model_type: &str, layer: usize) -> Result<Option<usize>> {
        let window = || self.usize("sliding_window");
        match model_type {
            "mixtral" => match self.get("sliding_window") {
                None => Ok(None),
                Some(_) => window().map(Some),
            },
            "qwen2_moe" => {
                let sliding = match self.get("layer_types") {
                    Some(types) => {
                        let kind = types
                            .as_array()
                            .and_then(|t| t.get(layer))
                            .and_then(Value::as_str)
                            .ok_or_else(|| {
                                self.error(format!("`layer_types` has no string for layer {layer}"))
                            })?;
                        match kind {
                            "sliding_attention" => true,
                            "full_attention" => false,
                            other => return Err(self.error(format!("`layer_types`[{layer}] is {other:?}"))),
                        }
                    }
                    // transformers' rule when the file predates `layer_types`.
                    None => {
                        self.bool_or("use_sliding_window", false)?
                            && !(layer + 1).is_multiple_of(2)
                            && layer < self.usize_or("max_window_layers", 28)?
                    }
                };
                match sliding && self.bool_or("use_sliding_window", false)? {
                    true => window().map(Some),
                    false => Ok(None),
                }
            }
            "gpt_oss" => match self.layer_type(layer)?.as_str() {
                "sliding_attention" => window().map(Some),
                _ => Ok(None),
            },
            "qwen3_moe" => {
                match self.bool_or("use_sliding_window", false)? && self.get("sliding_window").is_some() {
                    true => window().map(Some),
                    false => Ok(None),
                }
            }
            _ => Ok(None),
        }
    }
}
