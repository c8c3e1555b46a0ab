//! What a Hugging Face folder says about generating: `generation_config.json`, read as
//! transformers' `GenerationConfig.from_pretrained` reads it for `generate` — the stop ids
//! (`eos_token_id`, one id or a list; where the file gives them they are the ones
//! transformers stops at, not `config.json`'s) and the sampling defaults (`do_sample`,
//! `temperature`, `top_k`, `top_p`), which a published chat model often sets.

use std::path::Path;

use mpipemoe::{MoeError, Result};
use serde_json::Value;

use crate::sampling::Sampling;

/// The file's name in a model folder.
pub const GENERATION_CONFIG: &str = "generation_config.json";

/// `generation_config.json`'s keys that `generate` uses; all unset without the file.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationDefaults {
    /// `eos_token_id`: the ids that end generation, where the file gives any.
    pub eos_token_ids: Option<Vec<usize>>,
    /// `do_sample`: sample (with the settings below) rather than take the argmax.
    pub do_sample: bool,
    /// `temperature` (transformers: none means 1).
    pub temperature: Option<f64>,
    /// `top_k` (none or 0: every token).
    pub top_k: Option<usize>,
    /// `top_p` (none or 1: every token).
    pub top_p: Option<f64>,
}

impl GenerationDefaults {
    /// The folder's `generation_config.json`, or the defaults (greedy, no stop ids of its
    /// own) where there is none, as transformers falls back to the model config's.
    ///
    /// # Errors
    /// [`MoeError::File`] naming the file and the key if it is not a JSON object, too
    /// large (the JSON cap of [`mpipemoe::files::read_text`]), a key has the wrong type, or
    /// it samples with a setting [`Sampling::validate`] refuses (a temperature of 0, say).
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join(GENERATION_CONFIG);
        if !path.exists() {
            return Ok(Self::default());
        }
        let text = mpipemoe::files::read_text(&path)?;
        let json: Value =
            serde_json::from_str(&text).map_err(|e| MoeError::file(&path, format!("not JSON: {e}")))?;
        let bad = |key: &str, what: &str| MoeError::file(&path, format!("`{key}` is not {what}"));
        let get = |key: &str| json.get(key).filter(|v| !v.is_null());
        let number = |key: &str| -> Result<Option<f64>> {
            get(key)
                .map(|v| v.as_f64().ok_or_else(|| bad(key, "a number")))
                .transpose()
        };
        let eos_token_ids = match get("eos_token_id") {
            None => None,
            Some(Value::Array(ids)) => Some(
                ids.iter()
                    .map(|v| {
                        v.as_u64()
                            .map(|id| id as usize)
                            .ok_or_else(|| bad("eos_token_id", "a token id or a list of them"))
                    })
                    .collect::<Result<Vec<_>>>()?,
            ),
            Some(v) => Some(vec![v
                .as_u64()
                .ok_or_else(|| bad("eos_token_id", "a token id or a list of them"))?
                as usize]),
        };
        let do_sample = match get("do_sample") {
            None => false,
            Some(v) => v.as_bool().ok_or_else(|| bad("do_sample", "true or false"))?,
        };
        let top_k = match get("top_k") {
            None => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| bad("top_k", "a count"))? as usize),
        };
        let defaults = Self {
            eos_token_ids,
            do_sample,
            temperature: number("temperature")?,
            top_k,
            top_p: number("top_p")?,
        };
        // Settings the sampler would refuse are refused here, naming this file.
        if let Some(sampling) = defaults.sampling(0) {
            sampling
                .validate()
                .map_err(|e| MoeError::file(&path, e.to_string()))?;
        }
        Ok(defaults)
    }

    /// The sampling these defaults ask for, with `seed`: `None` (greedy) unless `do_sample`;
    /// an unset temperature is 1, a `top_k` of 0 and a `top_p` of 1 keep every token, as in
    /// transformers.
    pub fn sampling(&self, seed: u64) -> Option<Sampling> {
        self.do_sample.then(|| Sampling {
            temperature: self.temperature.unwrap_or(1.0),
            top_k: self.top_k.filter(|&k| k != 0),
            top_p: self.top_p.filter(|&p| p < 1.0),
            seed,
        })
    }
}

/// How [`MoeCausalLm::generate_with`](crate::MoeCausalLm::generate_with) continues a prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// The most new tokens (fewer where a stop id comes).
    pub max_new_tokens: usize,
    /// `None`: greedy (the argmax, the lowest id on a tie); else sampled.
    pub sampling: Option<Sampling>,
}

impl GenerateOptions {
    /// Greedy decoding of at most `max_new_tokens`.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            sampling: None,
        }
    }
}
