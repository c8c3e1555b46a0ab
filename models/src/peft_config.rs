//! PEFT's `adapter_config.json`: what of it this crate runs, and which modules it adapts.
//!
//! Loading an adapter folder, PEFT builds adapters on the modules its config targets and
//! loads the file's tensors into them (`check_target_module_exists` in PEFT's
//! `tuners/tuners_utils.py`): an attention projection is adapted when its path ends with one
//! of `target_modules`, none of `exclude_modules`, and lies in `layers_to_transform`; an
//! expert parameter when its path ends with one of `target_parameters`. A tensor for any other
//! module is left out with a warning. So applying every tensor of a file whose config does not
//! target it computes what PEFT does not: [`Targeting`] says what PEFT adapts, and the model
//! refuses such a tensor by name (`MoeCausalLm::with_adapter`). So is every field that changes
//! what an adapter computes and that this crate does not run (DoRA, aLoRA, KaSA, ...): read as
//! plain LoRA, each would give other logits without a word.

use std::path::Path;

use mpipemoe::files::{file_in, read_text};
use mpipemoe::format::{read_safetensors, TensorMap};
use mpipemoe::{LoraScaling, MoeError, Result};
use serde_json::Value;

use crate::lora::LoraSpec;

/// The adapter folder's configuration file.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The adapter folder's tensors.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// Fields that make an adapter compute something other than plain LoRA's `x·Aᵀ·Bᵀ·scale`
/// (PEFT marks most of them `is_lora_variant`), or change the model around it. Any of them
/// set is refused, whatever its type: PEFT's `use_bdlora`, for one, is a config object, not a
/// flag.
const UNSUPPORTED: &[(&str, &str)] = &[
    ("use_dora", "DoRA's magnitude vectors"),
    ("use_qalora", "QALoRA's pooled inputs"),
    ("use_bdlora", "BD-LoRA's block-diagonal factors"),
    ("lora_bias", "a bias on `lora_B`"),
    ("fan_in_fan_out", "weights stored (in, out)"),
    (
        "alora_invocation_tokens",
        "aLoRA's activation after its invocation tokens",
    ),
    ("kasa_config", "KaSA's singular values between the factors"),
    ("arrow_config", "Arrow's routing over adapters"),
    ("monteclora_config", "MonteCLoRA's sampled factors"),
    ("velora_config", "VeLoRA's compressed backward"),
    ("layer_replication", "replicated layers"),
    ("trainable_token_indices", "trained token embeddings"),
];

/// Which modules an adapter config targets, as PEFT decides it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Targeting {
    /// `target_modules`: attention projections by name.
    modules: Vec<String>,
    /// `target_parameters`: the experts' stacked weights, by name or path suffix.
    parameters: Vec<String>,
    /// `exclude_modules`: names or path suffixes left out of `modules`' matches.
    exclude: Vec<String>,
    /// `layers_to_transform`: the layers whose projections are adapted; `None` for all.
    layers: Option<Vec<u64>>,
}

/// PEFT's match of a module or parameter path against a list: the path itself, or a suffix
/// of it after a dot.
fn matches(names: &[String], path: &str) -> bool {
    names
        .iter()
        .any(|n| path == n || path.strip_suffix(n.as_str()).is_some_and(|p| p.ends_with('.')))
}

impl Targeting {
    /// Whether PEFT adapts the attention projection at `path`
    /// (`model.layers.3.self_attn.q_proj`), which lies in layer `layer`.
    pub(crate) fn adapts_module(&self, path: &str, layer: usize) -> bool {
        if matches(&self.exclude, path) {
            return false;
        }
        // A module named by its whole path is adapted whatever `layers_to_transform` says;
        // PEFT tests the layers on a match by suffix only.
        self.modules.iter().any(|m| m == path)
            || (matches(&self.modules, path)
                && self.layers.as_ref().is_none_or(|l| l.contains(&(layer as u64))))
    }

    /// Whether PEFT adapts the experts' parameter at `path`
    /// (`model.layers.3.mlp.experts.down_proj`). PEFT applies neither `exclude_modules` nor
    /// `layers_to_transform` to parameters.
    pub(crate) fn adapts_parameter(&self, path: &str) -> bool {
        matches(&self.parameters, path)
    }
}

/// A PEFT LoRA adapter folder, read: its spec, which modules it targets, and its tensors.
#[derive(Debug, Clone)]
pub struct PeftAdapter {
    /// Rank, alpha, scaling, targets and dropout as the folder's config gives them.
    pub spec: LoraSpec,
    pub(crate) targeting: Targeting,
    pub(crate) tensors: TensorMap,
}

fn bad(dir: &Path, reason: impl Into<String>) -> MoeError {
    MoeError::file(dir, reason.into())
}

/// Whether a config value is set: anything but absent, `null`, `false`, `[]` or `{}`.
fn is_set(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    }
}

impl PeftAdapter {
    /// Reads `dir/adapter_config.json` and `dir/adapter_model.safetensors`.
    ///
    /// # Errors
    /// [`MoeError::File`] naming the file and the field when the config is not a LoRA config
    /// this crate runs: `peft_type`, `r`, `lora_alpha`, `use_rslora`, `bias`, `lora_dropout`,
    /// `rank_pattern`, `alpha_pattern`, `modules_to_save`, a LoRA variant set (`use_dora`,
    /// `alora_invocation_tokens`, `kasa_config`, ...), `target_modules` or `exclude_modules`
    /// as a regular expression, `target_modules` naming no attention projection,
    /// `layers_to_transform` not layer indices, or `layers_pattern` naming no stack these
    /// models have; or when a file is missing or malformed.
    pub fn read(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config_path = file_in(dir, ADAPTER_CONFIG, dir)?;
        let text = read_text(&config_path)?;
        let config: Value =
            serde_json::from_str(&text).map_err(|e| bad(&config_path, format!("is not JSON: {e}")))?;
        let field = |name: &str| config.get(name).filter(|v| !v.is_null());
        let refuse = |name: &str, why: &str| bad(&config_path, format!("`{name}`: {why}"));
        match field("peft_type").and_then(Value::as_str) {
            Some("LORA") => {}
            other => return Err(refuse("peft_type", &format!("{other:?} is not \"LORA\""))),
        }
        let rank = field("r")
            .and_then(Value::as_u64)
            .filter(|r| (1..=1 << 16).contains(r))
            .ok_or_else(|| refuse("r", "is not an integer in 1..=65536"))? as usize;
        let alpha = field("lora_alpha")
            .and_then(Value::as_f64)
            .filter(|a| a.is_finite())
            .ok_or_else(|| refuse("lora_alpha", "is not a finite number"))?;
        for (name, what) in UNSUPPORTED {
            if is_set(config.get(*name)) {
                return Err(refuse(
                    name,
                    &format!("is set; {what} are not supported, only plain LoRA adapters"),
                ));
            }
        }
        let rslora = match field("use_rslora") {
            None => false,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| refuse("use_rslora", "is not true or false"))?,
        };
        if let Some(b) = field("bias").filter(|b| b.as_str() != Some("none")) {
            return Err(refuse("bias", &format!("{b}: only \"none\" is supported")));
        }
        for name in ["rank_pattern", "alpha_pattern"] {
            if is_set(field(name)) {
                return Err(refuse(name, "per-module ranks or alphas are not supported"));
            }
        }
        if is_set(field("modules_to_save")) {
            return Err(refuse(
                "modules_to_save",
                "fully trained module copies are not supported",
            ));
        }
        let dropout = match field("lora_dropout") {
            None => 0.0,
            Some(v) => v
                .as_f64()
                .filter(|d| (0.0..1.0).contains(d))
                .ok_or_else(|| refuse("lora_dropout", "is not a number in [0, 1)"))?,
        };
        let names = |name: &str| -> Result<Vec<String>> {
            match field(name) {
                None => Ok(Vec::new()),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_string)
                            .ok_or_else(|| refuse(name, "holds a non-string"))
                    })
                    .collect(),
                // PEFT's shorthand for every linear layer but the head: the dense MLPs' and
                // the shared experts' too, which this crate does not adapt.
                Some(Value::String(s)) if s == "all-linear" => Err(refuse(
                    name,
                    "\"all-linear\" adapts the MLPs' linear layers too, which this crate does not; \
                     list the attention projections",
                )),
                Some(Value::String(_)) => Err(refuse(
                    name,
                    "a regular expression is not supported; list the names",
                )),
                Some(_) => Err(refuse(name, "is not a list of names")),
            }
        };
        let modules = names("target_modules")?;
        // A target may be a path's tail (`self_attn.q_proj`); the spec names the projection.
        let last = |p: &str| p.rsplit('.').next().unwrap_or(p).to_string();
        let mut targets = Vec::new();
        for m in &modules {
            let name = last(m);
            // The experts are adapted through `target_parameters` alone: in PEFT these names
            // in `target_modules` would match other modules (a dense block's `down_proj`) or
            // none.
            if matches!(
                name.as_str(),
                "experts" | "attention" | "gate_up_proj" | "down_proj"
            ) {
                return Err(refuse(
                    "target_modules",
                    &format!(
                        "`{m}` is not an attention projection; the experts are targeted by \
                         `target_parameters`"
                    ),
                ));
            }
            targets.push(name);
        }
        let parameters = names("target_parameters")?;
        for p in &parameters {
            let name = last(p);
            if !matches!(name.as_str(), "gate_up_proj" | "down_proj") {
                return Err(refuse(
                    "target_parameters",
                    &format!("`{p}` is not an expert parameter"),
                ));
            }
            targets.push(name);
        }
        let layers = layers_to_transform(field("layers_to_transform"))
            .ok_or_else(|| refuse("layers_to_transform", "is not a layer index or a list of them"))?;
        if layers.is_some() {
            // PEFT finds a projection's layer after the first of these names in its path;
            // these models' stacks are all `layers`, so any other names none.
            let patterns = match field("layers_pattern") {
                None => Some(Vec::new()),
                Some(Value::String(s)) => Some(vec![s.clone()]),
                Some(Value::Array(a)) => a.iter().map(|v| v.as_str().map(str::to_string)).collect(),
                Some(_) => None,
            }
            .ok_or_else(|| refuse("layers_pattern", "is not a name or a list of names"))?;
            let patterns: Vec<_> = patterns.into_iter().filter(|p| !p.is_empty()).collect();
            if !patterns.is_empty() && !patterns.iter().any(|p| p == "layers") {
                return Err(refuse(
                    "layers_pattern",
                    &format!("{patterns:?} names no layer stack of these models (theirs is `layers`)"),
                ));
            }
        }
        let spec = LoraSpec {
            rank,
            alpha,
            scaling: match rslora {
                true => LoraScaling::RsLora,
                false => LoraScaling::Standard,
            },
            targets,
            dropout,
        };
        spec.validate().map_err(|e| bad(&config_path, e.to_string()))?;
        let targeting = Targeting {
            modules,
            parameters,
            exclude: names("exclude_modules")?,
            layers,
        };
        let (tensors, _) = read_safetensors(&file_in(dir, ADAPTER_WEIGHTS, dir)?)?;
        Ok(Self {
            spec,
            targeting,
            tensors,
        })
    }
}

/// PEFT's `layers_to_transform`: absent, `null` or `[]` for every layer (`Some(None)`), one
/// index or a list of them; `None` for anything else.
fn layers_to_transform(v: Option<&Value>) -> Option<Option<Vec<u64>>> {
    match v {
        None => Some(None),
        Some(Value::Number(n)) => n.as_u64().map(|i| Some(vec![i])),
        Some(Value::Array(a)) if a.is_empty() => Some(None),
        Some(Value::Array(a)) => a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>().map(Some),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targeting(modules: &[&str], exclude: &[&str], layers: Option<Vec<u64>>) -> Targeting {
        let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        Targeting {
            modules: owned(modules),
            parameters: owned(&["experts.down_proj"]),
            exclude: owned(exclude),
            layers,
        }
    }

    #[test]
    fn a_module_is_adapted_as_peft_matches_it() {
        let path = "model.layers.2.self_attn.q_proj";
        assert!(targeting(&["q_proj"], &[], None).adapts_module(path, 2));
        // A suffix after a dot only: `_proj` is no module name.
        assert!(!targeting(&["_proj"], &[], None).adapts_module(path, 2));
        assert!(targeting(&["self_attn.q_proj"], &[], None).adapts_module(path, 2));
        assert!(!targeting(&["k_proj"], &[], None).adapts_module(path, 2));
        // Excluded by name or by its own path.
        assert!(!targeting(&["q_proj"], &["q_proj"], None).adapts_module(path, 2));
        assert!(!targeting(&["q_proj"], &[path], None).adapts_module(path, 2));
        assert!(targeting(&["q_proj"], &["model.layers.1.self_attn.q_proj"], None).adapts_module(path, 2));
        // Only the layers to transform.
        assert!(targeting(&["q_proj"], &[], Some(vec![0, 2])).adapts_module(path, 2));
        assert!(!targeting(&["q_proj"], &[], Some(vec![0, 1])).adapts_module(path, 2));
        assert!(targeting(&[path], &[], Some(vec![0, 1])).adapts_module(path, 2));
        // Parameters by suffix, whatever the layers and exclusions say.
        let t = targeting(&["q_proj"], &["down_proj"], Some(vec![0]));
        assert!(t.adapts_parameter("model.layers.2.mlp.experts.down_proj"));
        assert!(!t.adapts_parameter("model.layers.2.mlp.experts.gate_up_proj"));
        assert!(!t.adapts_parameter("model.layers.2.mlp.shared_experts.down_proj"));
    }

    #[test]
    fn layers_to_transform_takes_an_index_or_a_list() {
        use serde_json::json;
        let read = |v: Value| layers_to_transform(Some(&v));
        assert_eq!(layers_to_transform(None), Some(None));
        assert_eq!(read(json!([])), Some(None));
        assert_eq!(read(json!(3)), Some(Some(vec![3])));
        assert_eq!(read(json!([0, 2])), Some(Some(vec![0, 2])));
        assert_eq!(read(json!(-1)), None);
        assert_eq!(read(json!([0, "1"])), None);
        assert_eq!(read(json!(1.5)), None);
        assert_eq!(read(json!({})), None);
    }
}
