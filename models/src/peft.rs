//! PEFT's LoRA adapter folders in and out: `adapter_config.json` and
//! `adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them and
//! `PeftModel.from_pretrained` reads them.
//!
//! The keys are the module paths of the PEFT model: `base_model.model.` + the Hugging Face
//! module (`model.layers.{i}.self_attn.q_proj`) + `.lora_A.weight` (`[r, d_in]`) or
//! `.lora_B.weight` (`[d_out, r]`). The experts' stacked parameters (`target_parameters`) hold
//! all experts in one pair, `lora_A.weight` `[r · n_experts, in]` (expert-major rows) and
//! `lora_B.weight` `[out, r · n_experts]` (rank-major columns); with both of the experts'
//! parameters targeted PEFT nests its wrappers, the first parameter of the module
//! (`gate_up_proj`) under `experts.base_layer.`, `down_proj` under `experts.`. See
//! `peft_layout.rs` for how each family's parameter maps onto the layer's weights.

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::Module;
use burn::tensor::{Tensor, TensorData};
use mpipemoe::files::{check_apart, StagedDir};
use mpipemoe::format::{write_safetensors, TensorMap};
use mpipemoe::{LoraScaling, MoeBackend, MoeError, Result};
use serde_json::{json, Value};

use crate::lora::{LoraLinear, LoraSpec};
use crate::model::MoeCausalLm;
use crate::peft_config::{PeftAdapter, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use crate::peft_layout::{expert_factors, expert_role, peft_factors, ExpertLayout};

/// PEFT's prefix of every key.
const PREFIX: &str = "base_model.model.";

/// The error for a tensor whose module or parameter `path` the adapter's config does not
/// target: PEFT would leave it out, so applying it would compute what PEFT does not.
fn untargeted(key: &str, path: &str) -> MoeError {
    MoeError::Input(format!(
        "adapter tensor `{key}`: the adapter's config does not target `{path}` \
         (`target_modules`, `target_parameters`, `exclude_modules`, `layers_to_transform`), \
         so PEFT would leave the tensor out; the config and the tensors disagree"
    ))
}

/// Where a key of the adapter file points in the model.
enum Site {
    /// An attention projection of layer `layer`.
    Projection { layer: usize, name: String },
    /// The stacked experts of layer `layer`; `nested` for `experts.base_layer.`.
    Experts { layer: usize, nested: bool },
}

/// The pair `(A, B)` of one adapted module.
#[derive(Default)]
struct Pair {
    a: Option<TensorData>,
    b: Option<TensorData>,
}

fn dims2(data: &TensorData) -> Option<[usize; 2]> {
    match data.shape.as_slice() {
        [r, c] => Some([*r, *c]),
        _ => None,
    }
}

fn values(data: &TensorData) -> Vec<f32> {
    data.to_vec::<f32>().unwrap_or_default()
}

impl<B: MoeBackend> MoeCausalLm<B> {
    /// The PEFT site a key names, for this model's module names.
    fn site(&self, key: &str) -> Option<(Site, bool)> {
        let rest = key.strip_prefix(PREFIX)?;
        let rest = rest.strip_prefix(&self.config().hf_root)?;
        let rest = rest.strip_prefix("layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let layer: usize = layer.parse().ok()?;
        let (module, which) = rest.rsplit_once(".lora_")?;
        let is_a = match which {
            "A.weight" => true,
            "B.weight" => false,
            _ => return None,
        };
        if let Some(name) = module.strip_prefix("self_attn.") {
            return Some((
                Site::Projection {
                    layer,
                    name: name.to_string(),
                },
                is_a,
            ));
        }
        let experts = format!("{}.experts", self.config().mlp_name);
        let nested = match module.strip_prefix(&experts)? {
            "" => false,
            ".base_layer" => true,
            _ => return None,
        };
        Some((Site::Experts { layer, nested }, is_a))
    }

    /// The model with `adapter`'s tensors as its adapters (replacing any it had), the base
    /// weights frozen as [`with_lora`](Self::with_lora) leaves them. Like PEFT, the model this
    /// is called on is the base, whatever the config's `base_model_name_or_path` says. Each
    /// rank keeps its own experts' adapters.
    ///
    /// # Errors
    /// [`MoeError::Input`] naming the key: a tensor for a module this model lacks (another
    /// model's adapter), a rank that disagrees with `r`, a shape that does not fit the base
    /// weight, an `A` without its `B`, a tensor for a module or parameter the config does not
    /// target (PEFT would leave it out); and naming a target of the config this model lacks.
    pub fn with_adapter(self, adapter: &PeftAdapter) -> Result<Self> {
        let mut model = self.no_grad();
        let spec = &adapter.spec;
        let scale = spec.scale();
        let r = spec.rank;
        let mut pairs: BTreeMap<(usize, String), Pair> = BTreeMap::new();
        for (key, data) in &adapter.tensors {
            let (site, is_a) = model.site(key).ok_or_else(|| {
                MoeError::Input(format!("adapter tensor `{key}` names no module of this model"))
            })?;
            let id = match site {
                Site::Projection { layer, name } => (layer, name),
                Site::Experts { layer, nested } => (
                    layer,
                    format!("experts{}", if nested { ".base_layer" } else { "" }),
                ),
            };
            let pair = pairs.entry(id).or_default();
            let slot = if is_a { &mut pair.a } else { &mut pair.b };
            *slot = Some(data.clone());
        }
        let n_layers = model.layers.len();
        let root = model.config().hf_root.clone();
        let mut expert_pairs: BTreeMap<usize, Vec<(String, [TensorData; 2])>> = BTreeMap::new();
        for ((layer, name), pair) in pairs {
            let key = |ab: &str| format!("{PREFIX}{root}layers.{layer}.{name}.lora_{ab}.weight");
            let (Some(a), Some(b)) = (pair.a, pair.b) else {
                return Err(MoeError::Input(format!(
                    "adapter tensor `{}` has no partner",
                    key("A or B")
                )));
            };
            if layer >= n_layers {
                return Err(MoeError::Input(format!(
                    "adapter tensor `{}`: the model has {n_layers} layers",
                    key("A")
                )));
            }
            if name.starts_with("experts") {
                expert_pairs.entry(layer).or_default().push((key("A"), [a, b]));
                continue;
            }
            let path = format!("{root}layers.{layer}.self_attn.{name}");
            if !adapter.targeting.adapts_module(&path, layer) {
                return Err(untargeted(&key("A"), &path));
            }
            let device = model.layers[layer].attn_norm.weight.device();
            let target = &mut model.layers[layer];
            let dims = target.projection_dims(&name);
            let (Some([d_in, d_out]), Some([ra, ca]), Some([rb, cb])) = (dims, dims2(&a), dims2(&b)) else {
                return Err(MoeError::Input(format!(
                    "adapter tensor `{}` names no projection of layer {layer}",
                    key("A")
                )));
            };
            if ra != r || cb != r || ca != d_in || rb != d_out {
                return Err(MoeError::Input(format!(
                    "adapter tensors `{}` [{ra}, {ca}] and lora_B [{rb}, {cb}] do not fit: r = {r} and the \
                     projection is [{d_out}, {d_in}] (out, in)",
                    key("A")
                )));
            }
            let at = Tensor::<B, 2>::from_data(TensorData::new(values(&a), [r, d_in]), &device).transpose();
            let bt = Tensor::<B, 2>::from_data(TensorData::new(values(&b), [d_out, r]), &device).transpose();
            let (names, lora) = target.attention_lora_mut().expect("a projection was found");
            let i = names.iter().position(|n| *n == name).expect("a known projection");
            lora.resize_with(names.len(), || None);
            lora[i] = Some(LoraLinear {
                a: burn::module::Param::from_tensor(at.detach()),
                b: burn::module::Param::from_tensor(bt.detach()),
                scale,
                dropout: spec.dropout,
            });
        }
        let layout = ExpertLayout::of(&model.config().model_type);
        let mlp_name = model.config().mlp_name.clone();
        for (layer, found) in expert_pairs {
            let Some(moe) = model.layers[layer].moe.as_mut() else {
                return Err(MoeError::Input(format!(
                    "adapter tensor `{}`: layer {layer} has no experts",
                    found[0].0
                )));
            };
            let cfg = moe.config().clone();
            let (m, h, e) = (cfg.d_model, cfg.d_hidden, cfg.n_experts);
            let f = cfg.activation.d_inner(h);
            let mut w_in = None;
            let mut w_out = None;
            for (key, [a, b]) in found {
                let (Some(da), Some(db)) = (dims2(&a), dims2(&b)) else {
                    return Err(MoeError::Input(format!("adapter tensor `{key}` is not a matrix")));
                };
                let role = expert_role(layout, da, db, r, e, (m, f, h)).ok_or_else(|| {
                    MoeError::Input(format!(
                        "adapter tensors `{key}` {da:?} and lora_B {db:?} fit neither of the experts' weights \
                         (r = {r}, {e} experts, d_model {m}, d_hidden {h})"
                    ))
                })?;
                let param = if role { "gate_up_proj" } else { "down_proj" };
                let path = format!("{root}layers.{layer}.{mlp_name}.experts.{param}");
                if !adapter.targeting.adapts_parameter(&path) {
                    return Err(untargeted(&key, &path));
                }
                let (rows, cols) = if role { (m, f) } else { (h, m) };
                let device = moe.experts.w_in.device();
                let (fa, fb) = expert_factors(layout, &values(&a), &values(&b), r, e, rows, cols, role);
                let fa = Tensor::<B, 3>::from_data(TensorData::new(fa, [e, rows, r]), &device);
                let fb = Tensor::<B, 3>::from_data(TensorData::new(fb, [e, r, cols]), &device);
                let slot = if role { &mut w_in } else { &mut w_out };
                if slot.replace((fa, fb)).is_some() {
                    return Err(MoeError::Input(format!(
                        "adapter tensor `{key}`: a second adapter on the same expert weight"
                    )));
                }
            }
            moe.set_adapters(w_in, w_out, scale)?;
        }
        for target in spec.attention_targets() {
            if !model.layers.iter().any(|l| l.projection_dims(target).is_some()) {
                return Err(MoeError::Input(format!(
                    "the adapter targets `{target}`, which this model's attention does not have"
                )));
            }
        }
        let (gate_up, down) = spec.expert_targets();
        if (gate_up || down) && model.moe_layers().next().is_none() {
            return Err(MoeError::Input(
                "the adapter targets the experts; this model has no MoE layer".into(),
            ));
        }
        Ok(model)
    }

    /// The model's adapters as PEFT stores them: every tensor under its key, in PEFT's layout
    /// (the experts' gathered from every rank). A collective with expert parallelism: every
    /// rank calls it; rank 0 gets the tensors, the other ranks `None`, as does a model
    /// without adapters.
    ///
    /// # Errors
    /// [`MoeError::Comm`] if a peer fails.
    pub fn adapter_tensors(&self) -> Result<Option<TensorMap>> {
        Ok(self.collect_adapters()?.map(|c| c.tensors))
    }

    fn collect_adapters(&self) -> Result<Option<Collected>> {
        let root = self.config().hf_root.clone();
        let mut c = Collected::default();
        let f32s = |t: Tensor<B, 2>| t.into_data().convert::<f32>();
        for (i, layer) in self.layers.iter().enumerate() {
            let Some((names, lora)) = layer.attention_lora() else {
                continue;
            };
            for (name, lora) in names.iter().zip(lora) {
                let Some(lora) = lora else { continue };
                c.ranks.push(lora.a.dims()[1]);
                let key = format!("{PREFIX}{root}layers.{i}.self_attn.{name}");
                c.tensors
                    .insert(format!("{key}.lora_A.weight"), f32s(lora.a.val().transpose()));
                c.tensors
                    .insert(format!("{key}.lora_B.weight"), f32s(lora.b.val().transpose()));
                if !c.modules.contains(&name.to_string()) {
                    c.modules.push(name.to_string());
                }
            }
        }
        let layout = ExpertLayout::of(&self.config().model_type);
        let mut on_rank_0 = true;
        for (i, moe) in self.moe_layers() {
            // Every rank gathers every layer, in order; rank 0 receives them.
            let Some(gathered) = moe.gather_adapters()? else {
                on_rank_0 &= moe.adapters.is_none();
                continue;
            };
            let cfg = moe.config();
            let e = cfg.n_experts;
            let both = gathered.contains_key("w_in.a") && gathered.contains_key("w_out.a");
            for (role, name, rows, cols) in [
                (
                    true,
                    "gate_up_proj",
                    cfg.d_model,
                    cfg.activation.d_inner(cfg.d_hidden),
                ),
                (false, "down_proj", cfg.d_hidden, cfg.d_model),
            ] {
                let prefix = if role { "w_in" } else { "w_out" };
                let (Some(a), Some(b)) = (
                    gathered.get(&format!("{prefix}.a")),
                    gathered.get(&format!("{prefix}.b")),
                ) else {
                    continue;
                };
                let r = a.shape[2];
                c.ranks.push(r);
                let (pa, pb, da, db) = peft_factors(layout, &values(a), &values(b), r, e, rows, cols, role);
                let nest = if role && both { ".base_layer" } else { "" };
                let key = format!(
                    "{PREFIX}{root}layers.{i}.{}.experts{nest}",
                    self.config().mlp_name
                );
                c.tensors
                    .insert(format!("{key}.lora_A.weight"), TensorData::new(pa, da));
                c.tensors
                    .insert(format!("{key}.lora_B.weight"), TensorData::new(pb, db));
                let param = format!("experts.{name}");
                if !c.parameters.contains(&param) {
                    c.parameters.push(param);
                }
            }
        }
        let rank = self
            .moe_layers()
            .next()
            .map_or(0, |(_, m)| m.context().comm().rank());
        if rank != 0 || !on_rank_0 || c.tensors.is_empty() {
            return Ok(None);
        }
        // PEFT nests the experts' wrappers in the module's parameter order.
        c.parameters.sort_by_key(|p| p != "experts.gate_up_proj");
        Ok(Some(c))
    }

    /// Writes the model's adapters as a PEFT folder `out_dir` (`adapter_config.json` with
    /// `spec`'s rank, alpha and scaling and the targets the model has adapters on;
    /// `adapter_model.safetensors` in f32), whole or not at all, never into the base folder
    /// `base_dir`. A collective with expert parallelism: every rank calls it, rank 0 writes.
    ///
    /// # Errors
    /// [`MoeError::Input`] if the model has no adapters or their rank is not `spec.rank`;
    /// [`MoeError::File`] naming `out_dir` if it is the base folder or cannot be written;
    /// [`MoeError::Comm`] if a peer fails.
    pub fn save_adapter(&self, spec: &LoraSpec, base_dir: &Path, out_dir: &Path) -> Result<()> {
        check_apart(base_dir, out_dir, "--out")?;
        if !self.has_lora() {
            return Err(MoeError::Input("the model has no adapters to save".into()));
        }
        let Some(c) = self.collect_adapters()? else {
            return Ok(());
        };
        if let Some(r) = c.ranks.iter().find(|&&r| r != spec.rank) {
            return Err(MoeError::Input(format!(
                "an adapter has rank {r}, the spec {}",
                spec.rank
            )));
        }
        let config = json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": spec.rank,
            "lora_alpha": spec.alpha,
            "use_rslora": spec.scaling == LoraScaling::RsLora,
            "lora_dropout": spec.dropout,
            "bias": "none",
            "fan_in_fan_out": false,
            "use_dora": false,
            "lora_bias": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "target_modules": c.modules,
            "target_parameters": if c.parameters.is_empty() { Value::Null } else { json!(c.parameters) },
            "base_model_name_or_path": base_dir.file_name().and_then(|n| n.to_str()).unwrap_or(""),
            "rank_pattern": {},
            "alpha_pattern": {},
        });
        let staged = StagedDir::new(out_dir)?;
        let text = serde_json::to_string_pretty(&config)
            .map_err(|e| MoeError::file(out_dir, format!("cannot encode the config: {e}")))?;
        mpipemoe::files::write_whole(&staged.path().join(ADAPTER_CONFIG), text.as_bytes(), false)?;
        write_safetensors(
            &staged.path().join(ADAPTER_WEIGHTS),
            &c.tensors,
            "{\"format\":\"pt\"}",
        )?;
        staged.commit()
    }
}

/// The adapters as PEFT stores them, with what the config lists.
#[derive(Default)]
struct Collected {
    tensors: TensorMap,
    /// `target_modules`.
    modules: Vec<String>,
    /// `target_parameters`.
    parameters: Vec<String>,
    /// Every adapter's rank.
    ranks: Vec<usize>,
}
