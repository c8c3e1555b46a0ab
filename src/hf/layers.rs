//! Which decoder layers of a `config.json` are MoE layers, as transformers decides it, and the
//! [`MoeLayerConfig`] of each.

use serde_json::Value;

use super::config::HfConfig;
use super::family::Family;
use crate::error::Result;
use crate::experts::Activation;
use crate::layer::MoeLayerConfig;
use crate::router::Scoring;

impl HfConfig {
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
        // Absent, it is transformers' default for every family, "silu". GPT-OSS's experts use
        // their own clamped SwiGLU whatever `hidden_act` says.
        match self.get("hidden_act") {
            None => {}
            Some(_) if self.family == Family::GptOss => {}
            Some(Value::String(act)) if act == "silu" => {}
            Some(Value::String(act)) => {
                return Err(self.error(format!(
                    "`hidden_act` is {act:?}; the experts of {} are SwiGLU, which needs \"silu\"",
                    self.family.model_type()
                )))
            }
            Some(act) => return Err(self.error(format!("`hidden_act` is {act}, not an activation's name"))),
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
