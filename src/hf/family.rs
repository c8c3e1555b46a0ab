//! The Hugging Face MoE families: how `config.json` describes a layer, and its tensor names.

use std::path::Path;

use serde_json::Value;

use crate::error::{MoeError, Result};
use crate::experts::Activation;
use crate::layer::MoeLayerConfig;
use crate::router::Scoring;

/// The most decoder layers a `config.json` may give (real models have at most a few hundred).
const MAX_LAYERS: usize = 1 << 16;

/// The largest integer a `config.json` size may be (2^32).
const MAX_CONFIG_INT: u64 = 1 << 32;

/// A supported Hugging Face MoE architecture (`config.json`'s `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Family {
    /// `mixtral`: `block_sparse_moe.gate`, `experts.{i}.w1/w2/w3`, renormalised top-k.
    Mixtral,
    /// `qwen2_moe`: `mlp.gate`, `mlp.experts.{i}.*_proj`, a sigmoid-gated shared expert.
    Qwen2Moe,
    /// `qwen3_moe`: like Qwen2-MoE without the shared expert, renormalised by default.
    Qwen3Moe,
    /// `olmoe`: `mlp.gate`, `mlp.experts.{i}.*_proj`, not renormalised by default.
    Olmoe,
    /// `deepseek_v3`: sigmoid scores with a score-correction bias, group-limited top-k, a
    /// routed scaling factor, ungated shared experts, and dense first layers.
    DeepseekV3,
    /// `llama4_text`, or the multimodal `llama4` around it (`text_config`,
    /// `language_model.model.layers.*`): `feed_forward.router`, the experts stacked in one
    /// `feed_forward.experts.gate_up_proj [E, M, 2H]` and `down_proj [E, H, M]`, top-k by the
    /// logits with `sigmoid(logit)` multiplied into the expert's input, an ungated
    /// `shared_expert`.
    Llama4,
    /// `gpt_oss`: `mlp.router` with a bias, softmax over the top-k logits, the experts
    /// stacked in `mlp.experts.gate_up_proj [E, M, 2H]` with gate and up columns interleaved,
    /// per-expert biases, and the clamped SwiGLU; the projections stored as they are or, as
    /// the Hub's releases store them, in MXFP4 (`_blocks` and `_scales`).
    GptOss,
}

impl Family {
    /// Every supported family.
    pub const ALL: [Family; 7] = [
        Family::Mixtral,
        Family::Qwen2Moe,
        Family::Qwen3Moe,
        Family::Olmoe,
        Family::DeepseekV3,
        Family::Llama4,
        Family::GptOss,
    ];

    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Mixtral => "mixtral",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Olmoe => "olmoe",
            Family::DeepseekV3 => "deepseek_v3",
            Family::Llama4 => "llama4_text",
            Family::GptOss => "gpt_oss",
        }
    }

    /// Whether the checkpoint stores a layer's experts stacked in one 3-D tensor per
    /// projection rather than one matrix per expert.
    pub fn stacked_experts(self) -> bool {
        matches!(self, Family::Llama4 | Family::GptOss)
    }

    /// Whether the stacked first matrix interleaves the gate and up columns
    /// (`gate = W[..., ::2]`, `up = W[..., 1::2]`) rather than storing the gate half first.
    pub fn interleaved_gate_up(self) -> bool {
        matches!(self, Family::GptOss)
    }

    fn parse(model_type: &str) -> Option<Self> {
        Family::ALL.into_iter().find(|f| f.model_type() == model_type)
    }
}

/// Which part of a SwiGLU FFN a tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// The gate projection `[H, M]` (Mixtral's `w1`).
    Gate,
    /// The up projection `[H, M]` (Mixtral's `w3`).
    Up,
    /// The down projection `[M, H]` (Mixtral's `w2`).
    Down,
}

/// `config.json` read as far as the MoE layers go.
#[derive(Debug, Clone)]
pub(crate) struct HfConfig {
    pub family: Family,
    pub n_layers: usize,
    /// The length of `config.json`, for [`ReadStats`](super::ReadStats).
    pub bytes: usize,
    /// What every tensor name starts with before `layers.{l}.`: `model.`, or
    /// `language_model.model.` for a text model inside a multimodal one (Llama 4's releases).
    pub root: &'static str,
    /// The text model's keys (`text_config` where it is nested).
    json: Value,
    /// The whole file, where the text model's keys are nested: its `dtype` and
    /// `quantization_config` are the checkpoint's.
    outer: Option<Value>,
    source: std::path::PathBuf,
}

impl HfConfig {
    /// Reads `dir/config.json`.
    pub(crate) fn read(dir: &Path) -> Result<Self> {
        let source = dir.join("config.json");
        let text = crate::files::read_text(&source)?;
        let json: Value =
            serde_json::from_str(&text).map_err(|e| MoeError::file(&source, format!("not JSON: {e}")))?;
        let model_type = json
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| MoeError::file(&source, "no `model_type` string"))?;
        // Llama 4's releases are the multimodal `llama4`: the text model's keys are under
        // `text_config` and its tensors under `language_model.`.
        if model_type == "llama4" {
            let text_config = json
                .get("text_config")
                .filter(|t| t.is_object())
                .cloned()
                .ok_or_else(|| {
                    MoeError::file(
                        &source,
                        "`model_type` is \"llama4\" but there is no `text_config` object",
                    )
                })?;
            let bytes = text.len();
            return Self::new(
                Family::Llama4,
                "language_model.model.",
                text_config,
                Some(json),
                bytes,
                source,
            );
        }
        let family = Family::parse(model_type).ok_or_else(|| {
            MoeError::file(
                &source,
                format!(
                    "`model_type` {model_type:?} is not a supported MoE family ({})",
                    Family::ALL.map(Family::model_type).join(", ")
                ),
            )
        })?;
        Self::new(family, "model.", json, None, text.len(), source)
    }

    fn new(
        family: Family,
        root: &'static str,
        json: Value,
        outer: Option<Value>,
        bytes: usize,
        source: std::path::PathBuf,
    ) -> Result<Self> {
        let mut config = Self {
            family,
            n_layers: 0,
            bytes,
            root,
            json,
            outer,
            source,
        };
        config.n_layers = config.usize("num_hidden_layers")?;
        if config.n_layers > MAX_LAYERS {
            return Err(config.error(format!(
                "`num_hidden_layers` is {}, over the {MAX_LAYERS} this reader accepts",
                config.n_layers
            )));
        }
        Ok(config)
    }

    /// The number of routed experts, under whichever name this file uses: transformers 4.x
    /// writes `num_experts` for Qwen2/Qwen3-MoE and OLMoE, 5.x maps it to
    /// `num_local_experts` (Mixtral's name), DeepSeek-V3 writes `n_routed_experts`. Two
    /// spellings that disagree are an error.
    pub(crate) fn n_experts(&self) -> Result<usize> {
        let keys: &[&str] = match self.family {
            Family::DeepseekV3 => &["n_routed_experts", "num_local_experts", "num_experts"],
            Family::Mixtral | Family::Llama4 | Family::GptOss => &["num_local_experts", "num_experts"],
            _ => &["num_experts", "num_local_experts"],
        };
        let mut found: Option<(&str, usize)> = None;
        for key in keys {
            if self.get(key).is_none() {
                continue;
            }
            let value = self.usize(key)?;
            match found {
                Some((first, v)) if v != value => {
                    return Err(self.error(format!(
                        "`{first}` is {v} but `{key}` is {value}: which is the expert count?"
                    )))
                }
                Some(_) => {}
                None => found = Some((key, value)),
            }
        }
        found.map(|(_, v)| v).ok_or_else(|| {
            self.error(format!(
                "missing or non-integer expert count (`{}`)",
                keys.join("` or `")
            ))
        })
    }

    /// The text model's keys (`text_config` where they are nested).
    pub(crate) fn json(&self) -> &Value {
        &self.json
    }

    fn error(&self, reason: impl Into<String>) -> MoeError {
        MoeError::file(&self.source, reason)
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    fn usize(&self, key: &str) -> Result<usize> {
        let v = self
            .get(key)
            .and_then(Value::as_u64)
            .ok_or_else(|| self.error(format!("missing or non-integer `{key}`")))?;
        // Sizes from a file are checked against the tensors before anything is allocated
        // from them; this bound keeps the arithmetic on them (products of a few) far from
        // overflow until then.
        if v > MAX_CONFIG_INT {
            return Err(self.error(format!(
                "`{key}` is {v}, over the {MAX_CONFIG_INT} this reader accepts"
            )));
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
                .ok_or_else(|| self.error(format!("`{key}` is {v}, expected true or false"))),
        }
    }

    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.error(format!("`{key}` is {v}, expected a number"))),
        }
    }

    /// The `dtype` (or older `torch_dtype`) the checkpoint was saved in, if it says.
    pub(crate) fn dtype(&self) -> Option<String> {
        let top = self.outer.as_ref().unwrap_or(&self.json);
        ["dtype", "torch_dtype"]
            .iter()
            .find_map(|key| top.get(key).or_else(|| self.get(key)).and_then(Value::as_str))
            .map(str::to_string)
    }

    /// The names of MoE layer `layer`'s tensors.
    pub(crate) fn names(&self, layer: usize) -> LayerNames {
        LayerNames::new(self.family, self.root, layer)
    }

    /// The checkpoint's quantisation, if `quantization_config` declares one.
    ///
    /// # Errors
    /// [`MoeError::File`] naming `config.json` and the key if the method is unknown or the
    /// FP8 block size is bad.
    pub(crate) fn quantization(&self) -> Result<Option<super::quantization::Quantization>> {
        super::quantization::Quantization::from_config(self.outer.as_ref().unwrap_or(&self.json))
            .map_err(|reason| self.error(reason))
    }

    /// Whether layer `layer` is a MoE layer (rather than a dense MLP), decided from the config
    /// as transformers decides it (5.24: `Qwen2MoeDecoderLayer`, `Qwen3MoeDecoderLayer`,
    /// `DeepseekV3DecoderLayer`, `Llama4TextConfig.moe_layers`).
    ///
    /// # Errors
    /// [`MoeError::File`] naming `config.json` and the key where transformers itself refuses
    /// the value (a step of 0: Python's `range` or `%` by zero) or a key is not a number.
    pub(crate) fn is_moe(&self, layer: usize) -> Result<bool> {
        let step = |key: &str| -> Result<usize> {
            match self.usize_or(key, 1)? {
                0 => Err(self.error(format!(
                    "`{key}` is 0: a MoE layer every 0 layers is no rule (transformers refuses it)"
                ))),
                step => Ok(step),
            }
        };
        Ok(match self.family {
            Family::Mixtral | Family::Olmoe | Family::GptOss => true,
            Family::Qwen2Moe | Family::Qwen3Moe => {
                let dense = match self.get("mlp_only_layers") {
                    None | Some(Value::Null) => false,
                    Some(list) => list
                        .as_array()
                        .ok_or_else(|| {
                            self.error(format!(
                                "`mlp_only_layers` is {list}, expected a list of layer indices"
                            ))
                        })?
                        .iter()
                        .any(|v| v.as_u64() == Some(layer as u64)),
                };
                let step = step("decoder_sparse_step")?;
                !dense && self.n_experts()? > 0 && (layer + 1).is_multiple_of(step)
            }
            // transformers 5.24 reads `first_k_dense_replace` alone (DeepSeek's own modelling
            // code also read `moe_layer_freq`, which transformers ignores).
            Family::DeepseekV3 => layer >= self.usize_or("first_k_dense_replace", 0)?,
            // `moe_layers` when set, else every `interleave_moe_layer_step`-th layer (the last
            // of each step), as `Llama4TextConfig` derives it.
            Family::Llama4 => match self.get("moe_layers") {
                Some(list) if !list.is_null() => list
                    .as_array()
                    .ok_or_else(|| {
                        self.error(format!(
                            "`moe_layers` is {list}, expected a list of layer indices"
                        ))
                    })?
                    .iter()
                    .any(|v| v.as_u64() == Some(layer as u64)),
                _ => (layer + 1).is_multiple_of(step("interleave_moe_layer_step")?),
            },
        })
    }

    /// The config keys that decide which layers are MoE layers, with their values, for
    /// errors: `first_k_dense_replace = 1`, ...
    pub(crate) fn layer_kind_keys(&self) -> String {
        let keys: &[&str] = match self.family {
            Family::Mixtral | Family::Olmoe | Family::GptOss => &[],
            Family::Qwen2Moe | Family::Qwen3Moe => &["mlp_only_layers", "decoder_sparse_step", "num_experts"],
            Family::DeepseekV3 => &["first_k_dense_replace"],
            Family::Llama4 => match self.get("moe_layers") {
                Some(list) if !list.is_null() => &["moe_layers"],
                _ => &["interleave_moe_layer_step"],
            },
        };
        let shown: Vec<String> = keys
            .iter()
            .map(|k| match self.get(k) {
                Some(v) => format!("{k} = {v}"),
                None => format!("{k} unset"),
            })
            .collect();
        match shown.is_empty() {
            true => "every layer is a MoE layer in this family".into(),
            false => shown.join(", "),
        }
    }

    /// Holds the folder's tensors to the config's layer kinds: a layer the config makes dense
    /// must hold no router or expert tensor (transformers would drop them as unexpected and
    /// leave the dense layer's weights random), and a MoE layer must hold its router.
    ///
    /// # Errors
    /// [`MoeError::File`] naming `config.json`, the layer, the deciding keys and a tensor.
    pub(crate) fn check_layer_kinds<V>(&self, tensors: &std::collections::BTreeMap<String, V>) -> Result<()> {
        for layer in 0..self.n_layers {
            let names = self.names(layer);
            let router = names.router();
            // The names are sorted, so a layer's expert tensors are one range of them.
            let experts = names.experts_prefix();
            let moe_tensor = tensors.get_key_value(&router).map(|(k, _)| k).or_else(|| {
                tensors
                    .range(experts.clone()..)
                    .next()
                    .map(|(k, _)| k)
                    .filter(|k| k.starts_with(&experts))
            });
            match (self.is_moe(layer)?, moe_tensor) {
                (false, Some(tensor)) => {
                    return Err(self.error(format!(
                        "layer {layer} is a dense MLP by the config ({}), but the folder holds its \
                         MoE tensor `{tensor}`: transformers would drop it as unexpected and leave \
                         the layer's dense weights random",
                        self.layer_kind_keys()
                    )))
                }
                (true, None) => {
                    return Err(self.error(format!(
                        "layer {layer} is a MoE layer by the config ({}), but the folder has no \
                         `{router}`",
                        self.layer_kind_keys()
                    )))
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The MoE layers of the model, in order.
    pub(crate) fn moe_layers(&self) -> Result<Vec<usize>> {
        (0..self.n_layers)
            .filter_map(|l| self.is_moe(l).map(|m| m.then_some(l)).transpose())
            .collect()
    }

    /// The layer config of MoE layer `layer`.
    ///
    /// # Errors
    /// [`MoeError::File`] naming `config.json` if the layer does not exist, is dense, or a key
    /// the layer needs is missing or unsupported.
    pub(crate) fn layer_config(&self, layer: usize) -> Result<MoeLayerConfig> {
        if layer >= self.n_layers {
            return Err(self.error(format!(
                "layer {layer} does not exist: the model has {} layers (num_hidden_layers)",
                self.n_layers
            )));
        }
        if !self.is_moe(layer)? {
            return Err(self.error(format!(
                "layer {layer} is a dense MLP, not a MoE layer ({}); the MoE layers are {:?}",
                self.layer_kind_keys(),
                self.moe_layers()?
            )));
        }
        let act = self.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        // GPT-OSS's experts use their own clamped SwiGLU whatever `hidden_act` says.
        if act != "silu" && self.family != Family::GptOss {
            return Err(self.error(format!(
                "`hidden_act` is {act:?}; the experts of {} are SwiGLU, which needs \"silu\"",
                self.family.model_type()
            )));
        }
        let m = self.usize("hidden_size")?;
        let k = self.usize("num_experts_per_tok")?;
        let base = |e: usize, h: usize| MoeLayerConfig::new(m, h, e, k).with_activation(Activation::SwiGlu);
        let config = match self.family {
            Family::Mixtral => {
                base(self.n_experts()?, self.usize("intermediate_size")?).with_normalize_topk(true)
            }
            Family::Qwen2Moe => {
                let shared = self.usize_or("shared_expert_intermediate_size", 0)?;
                base(self.n_experts()?, self.usize("moe_intermediate_size")?)
                    .with_normalize_topk(self.bool_or("norm_topk_prob", false)?)
                    .with_shared_expert((shared > 0).then_some(shared))
                    .with_shared_expert_gate(true)
            }
            Family::Qwen3Moe => base(self.n_experts()?, self.usize("moe_intermediate_size")?)
                .with_normalize_topk(self.bool_or("norm_topk_prob", true)?),
            Family::Olmoe => base(self.n_experts()?, self.usize("intermediate_size")?)
                .with_normalize_topk(self.bool_or("norm_topk_prob", false)?),
            Family::DeepseekV3 => {
                let h = self.usize("moe_intermediate_size")?;
                let scoring = match self
                    .get("scoring_func")
                    .and_then(Value::as_str)
                    .unwrap_or("sigmoid")
                {
                    "sigmoid" => Scoring::Sigmoid,
                    "softmax" => Scoring::Softmax,
                    other => {
                        return Err(self.error(format!(
                            "`scoring_func` is {other:?}; expected \"sigmoid\" or \"softmax\""
                        )))
                    }
                };
                let n_group = self.usize_or("n_group", 1)?;
                let shared = self.usize_or("n_shared_experts", 0)? * h;
                base(self.n_experts()?, h)
                    .with_scoring(scoring)
                    .with_score_bias(true)
                    .with_normalize_topk(self.bool_or("norm_topk_prob", true)?)
                    .with_n_group(n_group)
                    .with_topk_group(self.usize_or("topk_group", n_group)?)
                    .with_routed_scaling_factor(self.f64_or("routed_scaling_factor", 1.0)?)
                    .with_shared_expert((shared > 0).then_some(shared))
                    .with_shared_expert_gate(false)
            }
            Family::Llama4 => {
                // The shared expert is a Llama4TextMLP of the experts' width.
                let h = self.usize("intermediate_size")?;
                base(self.n_experts()?, h)
                    .with_scoring(Scoring::Sigmoid)
                    .with_score_bias(false)
                    .with_normalize_topk(false)
                    .with_weights_on_input(true)
                    .with_shared_expert(Some(h))
                    .with_shared_expert_gate(false)
            }
            Family::GptOss => {
                let activation = Activation::clamped_swiglu(
                    self.f64_or("swiglu_alpha", 1.702)?,
                    self.f64_or("swiglu_limit", 7.0)?,
                )
                .map_err(|e| self.error(format!("`swiglu_alpha` / `swiglu_limit`: {e}")))?;
                // The softmax over the top-k logits is the softmax over all experts
                // renormalised over the k chosen.
                base(self.n_experts()?, self.usize("intermediate_size")?)
                    .with_activation(activation)
                    .with_normalize_topk(true)
                    .with_router_bias(true)
                    .with_bias(true)
            }
        };
        config
            .validate()
            .map_err(|e| self.error(format!("layer {layer}: {e}")))?;
        Ok(config)
    }
}

/// The Hugging Face tensor names of one MoE layer.
#[derive(Debug, Clone)]
pub(crate) struct LayerNames {
    family: Family,
    prefix: String,
}

impl LayerNames {
    pub(crate) fn new(family: Family, root: &str, layer: usize) -> Self {
        let block = match family {
            Family::Mixtral => "block_sparse_moe",
            Family::Llama4 => "feed_forward",
            _ => "mlp",
        };
        Self {
            family,
            prefix: format!("{root}layers.{layer}.{block}."),
        }
    }

    /// The router's weight `[E, M]`.
    pub(crate) fn router(&self) -> String {
        match self.family {
            Family::Llama4 | Family::GptOss => format!("{}router.weight", self.prefix),
            _ => format!("{}gate.weight", self.prefix),
        }
    }

    /// The prefix every routed-expert tensor of this layer starts with (one matrix per expert
    /// or stacked, with their biases, scales or MXFP4 blocks).
    pub(crate) fn experts_prefix(&self) -> String {
        format!("{}experts.", self.prefix)
    }

    /// The router's bias `[E]` (GPT-OSS).
    pub(crate) fn router_bias(&self) -> String {
        format!("{}router.bias", self.prefix)
    }

    /// The stacked experts' biases: of the first matrix `[E, 2H]` (laid out as its columns)
    /// and of the second `[E, M]` (GPT-OSS).
    pub(crate) fn stacked_biases(&self) -> (String, String) {
        (
            format!("{}experts.gate_up_proj_bias", self.prefix),
            format!("{}experts.down_proj_bias", self.prefix),
        )
    }

    /// Whether the stacked first matrix interleaves gate and up columns.
    pub(crate) fn interleaved(&self) -> bool {
        self.family.interleaved_gate_up()
    }

    /// The stacked experts' first matrix `[E, M, 2H]`, gate half first, applied as `x · W`
    /// (families with [`Family::stacked_experts`]).
    pub(crate) fn stacked_gate_up(&self) -> String {
        format!("{}experts.gate_up_proj", self.prefix)
    }

    /// The stacked experts' second matrix `[E, H, M]`, applied as `h · W`.
    pub(crate) fn stacked_down(&self) -> String {
        format!("{}experts.down_proj", self.prefix)
    }

    /// Whether the experts are stacked (see [`Family::stacked_experts`]).
    pub(crate) fn stacked(&self) -> bool {
        self.family.stacked_experts()
    }

    /// DeepSeek's score-correction bias `[E]`.
    pub(crate) fn score_bias(&self) -> String {
        format!("{}gate.e_score_correction_bias", self.prefix)
    }

    /// Expert `e`'s projection `part`.
    pub(crate) fn expert(&self, e: usize, part: Part) -> String {
        let name = match (self.family, part) {
            (Family::Mixtral, Part::Gate) => "w1",
            (Family::Mixtral, Part::Up) => "w3",
            (Family::Mixtral, Part::Down) => "w2",
            (_, Part::Gate) => "gate_proj",
            (_, Part::Up) => "up_proj",
            (_, Part::Down) => "down_proj",
        };
        format!("{}experts.{e}.{name}.weight", self.prefix)
    }

    /// The shared expert's projection `part`.
    pub(crate) fn shared(&self, part: Part) -> String {
        let block = match self.family {
            Family::DeepseekV3 => "shared_experts",
            _ => "shared_expert",
        };
        let name = match part {
            Part::Gate => "gate_proj",
            Part::Up => "up_proj",
            Part::Down => "down_proj",
        };
        format!("{}{block}.{name}.weight", self.prefix)
    }

    /// The shared expert's sigmoid gate `[1, M]` (Qwen2-MoE).
    pub(crate) fn shared_gate(&self) -> String {
        format!("{}shared_expert_gate.weight", self.prefix)
    }
}
