//! `LayerMeta`: the settings of a canonical layer file (the safetensors key `meta`).

use serde::{Deserialize, Serialize};

use super::MoeLayerConfig;
use crate::error::{MoeError, Result};
use crate::experts::Activation;
use crate::router::Scoring;

/// The `meta` JSON of a canonical layer file (the reference cases' format, see
/// `tests/data/cases/README.md`, `tests/data/hf/README.md` and
/// `tests/data/hf/generated/README.md`). Unknown keys are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerMeta {
    /// Experts per token.
    pub top_k: usize,
    /// Router scoring: `softmax` or `sigmoid`.
    #[serde(default = "softmax")]
    pub scoring: String,
    /// Renormalise the top-k weights.
    pub normalize_topk: bool,
    /// `gelu` (exact erf), `relu`, `swiglu`, or `swiglu_clamped` (GPT-OSS, with
    /// `swiglu_alpha` and `swiglu_limit`).
    pub activation: String,
    /// Router and expert biases present.
    pub bias: bool,
    /// Per-expert capacity limit for the file's own batch; `null` is dropless.
    #[serde(default)]
    pub capacity: Option<usize>,
    /// Number of experts.
    #[serde(rename = "E")]
    pub n_experts: usize,
    /// Token width.
    #[serde(rename = "M")]
    pub d_model: usize,
    /// Expert hidden width.
    #[serde(rename = "H")]
    pub d_hidden: usize,
    /// Shared expert, if any.
    #[serde(default)]
    pub shared: Option<SharedMeta>,
    /// Expert groups of group-limited routing (sigmoid cases).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_group: Option<usize>,
    /// Groups a token may choose from (sigmoid cases).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topk_group: Option<usize>,
    /// Factor on the combine weights (sigmoid cases).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_scaling_factor: Option<f64>,
    /// The Hugging Face `model_type` the layer came from (`mixtral`, `deepseek_v3`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The layer's index in its Hugging Face checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hf_layer: Option<usize>,
    /// The dtype the checkpoint stores (`float32`, `bfloat16`, `float16`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hf_dtype: Option<String>,
    /// mpipemoe's extension: a router bias setting different from `bias`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_bias: Option<bool>,
    /// mpipemoe's extension: a score bias setting different from the scoring's default (sigmoid
    /// routers carry `router.score_bias`, softmax routers do not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score_bias: Option<bool>,
    /// mpipemoe's extension: capacity as a factor (takes precedence over `capacity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_factor: Option<f64>,
    /// The clamped SwiGLU's sigmoid slope (`swiglu_clamped` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swiglu_alpha: Option<f64>,
    /// The clamped SwiGLU's clamp (`swiglu_clamped` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub swiglu_limit: Option<f64>,
    /// The combine weights multiply the experts' input rows, not their outputs (Llama 4).
    #[serde(default, skip_serializing_if = "is_false")]
    pub weights_on_input: bool,
}

fn is_false(value: &bool) -> bool {
    !value
}

/// The shared expert's part of [`LayerMeta`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedMeta {
    /// Hidden width of the shared expert.
    #[serde(rename = "H")]
    pub d_hidden: usize,
    /// Gate function: `sigmoid`, or `null` for an ungated shared expert.
    #[serde(default)]
    pub gate: Option<String>,
}

fn softmax() -> String {
    "softmax".to_string()
}

fn meta_error(reason: impl Into<String>) -> MoeError {
    MoeError::config("meta", reason)
}

impl LayerMeta {
    /// Parses the JSON.
    ///
    /// # Errors
    /// [`MoeError::Config`] (field `meta`) naming the missing or malformed key.
    pub fn parse(json: &str) -> Result<Self> {
        serde_json::from_str(json).map_err(|e| meta_error(format!("bad meta JSON: {e}")))
    }

    /// The layer config this meta describes. A fixed `capacity` is turned into the factor
    /// that reproduces it for a batch of `n_tokens` (the file's own batch).
    ///
    /// # Errors
    /// [`MoeError::Config`] naming the key whose value the layer does not support, or the
    /// config field that the resulting config fails.
    pub fn to_config(&self, n_tokens: Option<usize>) -> Result<MoeLayerConfig> {
        let scoring = Scoring::parse(&self.scoring).ok_or_else(|| {
            meta_error(format!(
                "`scoring` is {:?}; expected \"softmax\" or \"sigmoid\"",
                self.scoring
            ))
        })?;
        let activation = match (self.activation.as_str(), self.swiglu_alpha, self.swiglu_limit) {
            ("swiglu_clamped", Some(alpha), Some(limit)) => Activation::clamped_swiglu(alpha, limit)
                .map_err(|e| meta_error(format!("`swiglu_alpha` / `swiglu_limit`: {e}")))?,
            ("swiglu_clamped", _, _) => {
                return Err(meta_error(
                    "`activation` is \"swiglu_clamped\", which needs `swiglu_alpha` and `swiglu_limit`",
                ))
            }
            (name, _, _) => Activation::parse(name).ok_or_else(|| {
                meta_error(format!(
                    "`activation` is {name:?}; expected gelu, relu, swiglu or swiglu_clamped"
                ))
            })?,
        };
        let shared_gate = match self.shared.as_ref().map(|s| s.gate.as_deref()) {
            None | Some(None) => false,
            Some(Some("sigmoid")) => true,
            Some(Some(other)) => {
                return Err(meta_error(format!(
                    "`shared.gate` is {other:?}; expected \"sigmoid\" or null"
                )))
            }
        };
        let capacity_factor = match (self.capacity_factor, self.capacity) {
            (Some(f), _) => Some(f),
            (None, None) => None,
            (None, Some(c)) => {
                let t = n_tokens.ok_or_else(|| {
                    meta_error("`capacity` is a fixed limit, which needs the batch size; give `capacity_factor` instead")
                })?;
                // Half a slot of headroom makes floor(factor · T · k / E) land on c exactly
                // despite rounding.
                Some((c as f64 + 0.5) * self.n_experts as f64 / (t.max(1) * self.top_k) as f64)
            }
        };
        let config = MoeLayerConfig::new(self.d_model, self.d_hidden, self.n_experts, self.top_k)
            .with_activation(activation)
            .with_bias(self.bias)
            .with_router_bias(self.router_bias.unwrap_or(self.bias))
            .with_scoring(scoring)
            .with_normalize_topk(self.normalize_topk)
            .with_n_group(self.n_group.unwrap_or(1))
            .with_topk_group(self.topk_group.unwrap_or(self.n_group.unwrap_or(1)))
            .with_score_bias(self.score_bias.unwrap_or(scoring == Scoring::Sigmoid))
            .with_routed_scaling_factor(self.routed_scaling_factor.unwrap_or(1.0))
            .with_capacity_factor(capacity_factor)
            .with_shared_expert(self.shared.as_ref().map(|s| s.d_hidden))
            .with_shared_expert_gate(shared_gate)
            .with_weights_on_input(self.weights_on_input);
        config.validate()?;
        Ok(config)
    }

    /// The meta of a layer with this config.
    pub fn from_config(config: &MoeLayerConfig) -> Self {
        let sigmoid = config.scoring == Scoring::Sigmoid;
        let grouped = config.n_group > 1 || sigmoid;
        let swiglu = match config.activation {
            Activation::ClampedSwiGlu { alpha, limit } => Some((alpha as f64, limit as f64)),
            _ => None,
        };
        Self {
            top_k: config.top_k,
            scoring: config.scoring.name().to_string(),
            normalize_topk: config.normalize_topk,
            activation: config.activation.name().to_string(),
            bias: config.bias,
            capacity: None,
            n_experts: config.n_experts,
            d_model: config.d_model,
            d_hidden: config.d_hidden,
            shared: config.shared_expert.map(|h| SharedMeta {
                d_hidden: h,
                gate: config.shared_expert_gate.then(|| "sigmoid".into()),
            }),
            n_group: grouped.then_some(config.n_group),
            topk_group: grouped.then_some(config.topk_group),
            routed_scaling_factor: (sigmoid || config.routed_scaling_factor != 1.0)
                .then_some(config.routed_scaling_factor),
            kind: None,
            hf_layer: None,
            hf_dtype: None,
            router_bias: (config.router_bias != config.bias).then_some(config.router_bias),
            score_bias: (config.score_bias != sigmoid).then_some(config.score_bias),
            capacity_factor: config.capacity_factor,
            weights_on_input: config.weights_on_input,
            swiglu_alpha: swiglu.map(|(alpha, _)| alpha),
            swiglu_limit: swiglu.map(|(_, limit)| limit),
        }
    }
}
