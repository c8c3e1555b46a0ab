//! `config.json` read as far as the MoE layers go ([`HfConfig`]): the family, the layer count,
//! the text model's keys (nested in a multimodal model's), and bounded readers of its numbers.

use std::path::Path;

use serde_json::Value;

use super::family::Family;
use super::names::LayerNames;
use crate::error::{MoeError, Result};

/// The most decoder layers a `config.json` may give (real models have at most a few hundred).
const MAX_LAYERS: usize = 1 << 16;

/// The largest integer a `config.json` size may be (2^32).
const MAX_CONFIG_INT: u64 = 1 << 32;

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

    pub(super) fn new(
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

    pub(super) fn error(&self, reason: impl Into<String>) -> MoeError {
        MoeError::file(&self.source, reason)
    }

    pub(super) fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    pub(super) fn usize(&self, key: &str) -> Result<usize> {
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

    pub(super) fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.usize(key),
        }
    }

    pub(super) fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.error(format!("`{key}` is {v}, expected true or false"))),
        }
    }

    pub(super) fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
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
}
