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
//! [`ExpertLayout`] for how each family's parameter maps onto the layer's weights.

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

/// PEFT's prefix of every key.
const PREFIX: &str = "base_model.model.";

/// How transformers 5 stores a family's stacked expert parameter, and so how PEFT's factors
/// map onto the layer's `w [rows, cols]` (`x · w`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExpertLayout {
    /// `[E, out, in]` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3): PEFT's delta is `B·A` in
    /// that layout, the layer's `(B·A)ᵀ = Aᵀ·Bᵀ`.
    OutIn,
    /// `[E, in, out]` marked `is_transposed` (GPT-OSS, gate and up columns interleaved):
    /// PEFT's delta is `Aᵀ·Bᵀ` in the layer's own layout.
    InOut { interleaved: bool },
    /// `[E, in, out]` without the mark (Llama 4): PEFT takes the first dimension for the
    /// output and its delta `B·A` is in the layer's layout.
    InOutUnmarked,
}

impl ExpertLayout {
    fn of(model_type: &str) -> Self {
        match model_type {
            "gpt_oss" => ExpertLayout::InOut { interleaved: true },
            "llama4" | "llama4_text" => ExpertLayout::InOutUnmarked,
            _ => ExpertLayout::OutIn,
        }
    }
}

/// A LoRA adapter read from a PEFT folder, before it is put on a model.
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

/// Whether a pair `lora_A [da]`, `lora_B [db]` is the adapter on `w_in` (`true`) or `w_out`
/// (`false`) of experts with `d_model` `m`, `d_inner` `f` and `d_hidden` `h`; `None` if it
/// fits neither.
fn expert_role(
    layout: ExpertLayout,
    da: [usize; 2],
    db: [usize; 2],
    r: usize,
    e: usize,
    (m, f, h): (usize, usize, usize),
) -> Option<bool> {
    if da[0] != r * e || db[1] != r * e {
        return None;
    }
    // The layer's `[rows, cols]` the pair stands for.
    let (rows, cols) = match layout {
        ExpertLayout::OutIn | ExpertLayout::InOut { .. } => (da[1], db[0]),
        ExpertLayout::InOutUnmarked => (db[0], da[1]),
    };
    match (rows, cols) {
        (rows, cols) if rows == m && cols == f => Some(true),
        (rows, cols) if rows == h && cols == m => Some(false),
        _ => None,
    }
}

/// Column `c` of a halves layout (`gate..., up...`, `2·half` wide) in the interleaved one.
fn interleaved_column(c: usize, half: usize) -> usize {
    if c < half {
        2 * c
    } else {
        2 * (c - half) + 1
    }
}

/// Where each value of the layer's factors sits in PEFT's tensors: for each index of `a
/// [e, rows, r]`, then of `b [e, r, cols]`, whether it is in `lora_B` (else `lora_A`) and
/// its index there. One map serves both directions ([`expert_factors`], [`peft_factors`]).
struct FactorPlaces {
    a: Vec<(bool, usize)>,
    b: Vec<(bool, usize)>,
}

fn factor_places(
    layout: ExpertLayout,
    r: usize,
    e: usize,
    rows: usize,
    cols: usize,
    w_in: bool,
) -> FactorPlaces {
    let mut a = vec![(false, 0); e * rows * r];
    let mut b = vec![(false, 0); e * r * cols];
    let column = |c: usize| match layout {
        ExpertLayout::InOut { interleaved: true } if w_in => interleaved_column(c, cols / 2),
        _ => c,
    };
    for x in 0..e {
        for k in 0..r {
            match layout {
                // a[x][j][k] = A[x·r + k][j]; b[x][k][i] = B[i][k·E + x].
                ExpertLayout::OutIn | ExpertLayout::InOut { .. } => {
                    for j in 0..rows {
                        a[(x * rows + j) * r + k] = (false, (x * r + k) * rows + j);
                    }
                    for c in 0..cols {
                        b[(x * r + k) * cols + c] = (true, column(c) * r * e + k * e + x);
                    }
                }
                // a[x][i][k] = B[i][k·E + x]; b[x][k][j] = A[x·r + k][j].
                ExpertLayout::InOutUnmarked => {
                    for i in 0..rows {
                        a[(x * rows + i) * r + k] = (true, i * r * e + k * e + x);
                    }
                    for j in 0..cols {
                        b[(x * r + k) * cols + j] = (false, (x * r + k) * cols + j);
                    }
                }
            }
        }
    }
    FactorPlaces { a, b }
}

/// PEFT's `lora_A` and `lora_B` values as the layer's factors `a [e, rows, r]` and
/// `b [e, r, cols]`.
#[allow(clippy::too_many_arguments)]
fn expert_factors(
    layout: ExpertLayout,
    lora_a: &[f32],
    lora_b: &[f32],
    r: usize,
    e: usize,
    rows: usize,
    cols: usize,
    w_in: bool,
) -> (Vec<f32>, Vec<f32>) {
    let places = factor_places(layout, r, e, rows, cols, w_in);
    let read = |&(in_b, i): &(bool, usize)| if in_b { lora_b[i] } else { lora_a[i] };
    (
        places.a.iter().map(read).collect(),
        places.b.iter().map(read).collect(),
    )
}

/// The inverse of [`expert_factors`]: PEFT's `lora_A` and `lora_B` values and shapes.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn peft_factors(
    layout: ExpertLayout,
    a: &[f32],
    b: &[f32],
    r: usize,
    e: usize,
    rows: usize,
    cols: usize,
    w_in: bool,
) -> (Vec<f32>, Vec<f32>, [usize; 2], [usize; 2]) {
    // PEFT's `lora_A` holds the layer's `a` values in the first layouts, its `b` in the last.
    let (len_a, len_b) = match layout {
        ExpertLayout::InOutUnmarked => (b.len(), a.len()),
        _ => (a.len(), b.len()),
    };
    let mut lora_a = vec![0.0; len_a];
    let mut lora_b = vec![0.0; len_b];
    let places = factor_places(layout, r, e, rows, cols, w_in);
    for (&(in_b, i), &v) in places.a.iter().zip(a).chain(places.b.iter().zip(b)) {
        if in_b {
            lora_b[i] = v;
        } else {
            lora_a[i] = v;
        }
    }
    match layout {
        ExpertLayout::OutIn | ExpertLayout::InOut { .. } => (lora_a, lora_b, [r * e, rows], [cols, r * e]),
        ExpertLayout::InOutUnmarked => (lora_a, lora_b, [r * e, cols], [rows, r * e]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every layout's factors survive the way out and back, value for value.
    #[test]
    fn expert_factors_round_trip_in_every_layout() {
        let (r, e, rows, cols) = (2, 3, 4, 6);
        let a: Vec<f32> = (0..e * rows * r).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..e * r * cols).map(|i| 1000.0 + i as f32).collect();
        for layout in [
            ExpertLayout::OutIn,
            ExpertLayout::InOut { interleaved: true },
            ExpertLayout::InOutUnmarked,
        ] {
            for w_in in [true, false] {
                let (pa, pb, _, _) = peft_factors(layout, &a, &b, r, e, rows, cols, w_in);
                let (back_a, back_b) = expert_factors(layout, &pa, &pb, r, e, rows, cols, w_in);
                assert_eq!((back_a, back_b), (a.clone(), b.clone()), "{layout:?} {w_in}");
            }
        }
    }
}
