//! Canonical safetensors files: the reference cases' tensor names, layouts and meta JSON.
//!
//! A layer file holds `router.weight [E, M]`, `router.bias [E]`, `experts.w_in [E, M, F]`,
//! `experts.b_in [E, F]`, `experts.w_out [E, H, M]`, `experts.b_out [E, M]` and, with a shared
//! expert, `shared.w_in [M, 2Hs]`, `shared.w_out [Hs, M]`, `shared.gate.weight [1, M]`; the
//! safetensors metadata key `meta` holds the JSON described by [`LayerMeta`].

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use burn::module::Param;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use super::{MoeContext, MoeLayer, MoeLayerConfig};
use crate::comm::{Communicator, Payload, SingleRank};
use crate::error::{MoeError, Result};
use crate::experts::{Activation, Experts, SharedExpert};
use crate::router::Router;

/// Tensors by name, as read from a file (always f32).
pub type TensorMap = BTreeMap<String, TensorData>;

/// The `meta` JSON of a canonical file. Unknown keys are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerMeta {
    /// Experts per token.
    pub top_k: usize,
    /// Router scoring function; only `softmax` is defined.
    #[serde(default = "softmax")]
    pub scoring: String,
    /// Renormalise the top-k weights.
    pub normalize_topk: bool,
    /// `gelu` (exact erf), `relu` or `swiglu`.
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
    /// mpipemoe's extension: a router bias setting different from `bias`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_bias: Option<bool>,
    /// mpipemoe's extension: capacity as a factor (takes precedence over `capacity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_factor: Option<f64>,
}

/// The shared expert's part of [`LayerMeta`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedMeta {
    /// Hidden width of the shared expert.
    #[serde(rename = "H")]
    pub d_hidden: usize,
    /// Gate function; only `sigmoid` is defined.
    pub gate: String,
}

fn softmax() -> String {
    "softmax".to_string()
}

impl LayerMeta {
    /// Parses the JSON; the error names the missing or malformed key.
    pub fn parse(json: &str) -> std::result::Result<Self, String> {
        serde_json::from_str(json).map_err(|e| format!("bad meta JSON: {e}"))
    }

    /// The layer config this meta describes. A fixed `capacity` is turned into the factor
    /// that reproduces it for a batch of `n_tokens` (the file's own batch).
    pub fn to_config(&self, n_tokens: Option<usize>) -> std::result::Result<MoeLayerConfig, String> {
        if self.scoring != "softmax" {
            return Err(format!(
                "meta `scoring` is {:?}; only \"softmax\" is supported",
                self.scoring
            ));
        }
        let activation = Activation::parse(&self.activation).ok_or_else(|| {
            format!(
                "meta `activation` is {:?}; expected gelu, relu or swiglu",
                self.activation
            )
        })?;
        if let Some(shared) = &self.shared {
            if shared.gate != "sigmoid" {
                return Err(format!(
                    "meta `shared.gate` is {:?}; only \"sigmoid\" is supported",
                    shared.gate
                ));
            }
        }
        let capacity_factor = match (self.capacity_factor, self.capacity) {
            (Some(f), _) => Some(f),
            (None, None) => None,
            (None, Some(c)) => {
                let t = n_tokens.ok_or("meta `capacity` is a fixed limit, which needs the batch size; give `capacity_factor` instead")?;
                // Half a slot of headroom makes floor(factor · T · k / E) land on c exactly
                // despite rounding.
                Some((c as f64 + 0.5) * self.n_experts as f64 / (t.max(1) * self.top_k) as f64)
            }
        };
        let config = MoeLayerConfig::new(self.d_model, self.d_hidden, self.n_experts, self.top_k)
            .with_activation(activation)
            .with_bias(self.bias)
            .with_router_bias(self.router_bias.unwrap_or(self.bias))
            .with_normalize_topk(self.normalize_topk)
            .with_capacity_factor(capacity_factor)
            .with_shared_expert(self.shared.as_ref().map(|s| s.d_hidden));
        config.validate().map_err(|e| e.to_string())?;
        Ok(config)
    }

    /// The meta of a layer with this config.
    pub fn from_config(config: &MoeLayerConfig) -> Self {
        Self {
            top_k: config.top_k,
            scoring: softmax(),
            normalize_topk: config.normalize_topk,
            activation: config.activation.name().to_string(),
            bias: config.bias,
            capacity: None,
            n_experts: config.n_experts,
            d_model: config.d_model,
            d_hidden: config.d_hidden,
            shared: config.shared_expert.map(|h| SharedMeta {
                d_hidden: h,
                gate: "sigmoid".into(),
            }),
            router_bias: (config.router_bias != config.bias).then_some(config.router_bias),
            capacity_factor: config.capacity_factor,
        }
    }
}

/// The parameter tensors of a layer with `config` and their full (all-experts) shapes.
pub(crate) fn parameter_shapes(config: &MoeLayerConfig) -> Vec<(&'static str, Vec<usize>)> {
    let (e, m, h) = (config.n_experts, config.d_model, config.d_hidden);
    let f = config.activation.d_inner(h);
    let mut out = vec![("router.weight", vec![e, m])];
    if config.router_bias {
        out.push(("router.bias", vec![e]));
    }
    out.push(("experts.w_in", vec![e, m, f]));
    if config.bias {
        out.push(("experts.b_in", vec![e, f]));
    }
    out.push(("experts.w_out", vec![e, h, m]));
    if config.bias {
        out.push(("experts.b_out", vec![e, m]));
    }
    if let Some(hs) = config.shared_expert {
        out.push(("shared.w_in", vec![m, 2 * hs]));
        out.push(("shared.w_out", vec![hs, m]));
        out.push(("shared.gate.weight", vec![1, m]));
    }
    out
}

/// Reads every tensor of a safetensors file (as f32) and its `meta` JSON, if any.
pub fn read_safetensors(path: &Path) -> Result<(TensorMap, Option<String>)> {
    let bytes = std::fs::read(path).map_err(|e| MoeError::file(path, format!("cannot read: {e}")))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| MoeError::file(path, format!("not a safetensors file: {e:?}")))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| MoeError::file(path, format!("bad safetensors header: {e:?}")))?;
    let meta = header.metadata().as_ref().and_then(|m| m.get("meta").cloned());
    let mut tensors = TensorMap::new();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let data = match view.dtype() {
            Dtype::F32 => TensorData::from_bytes_vec(view.data().to_vec(), shape, DType::F32),
            Dtype::F64 => {
                TensorData::from_bytes_vec(view.data().to_vec(), shape, DType::F64).convert::<f32>()
            }
            other => {
                return Err(MoeError::file(
                    path,
                    format!("tensor `{name}` has dtype {other:?}; F32 and F64 are supported"),
                ))
            }
        };
        tensors.insert(name, data);
    }
    Ok((tensors, meta))
}

/// Writes `tensors` (f32) and the `meta` JSON to a safetensors file.
pub fn write_safetensors(path: &Path, tensors: &TensorMap, meta: &str) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(name, data)| {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, data.shape.to_vec(), data.as_bytes())
                .map_err(|e| MoeError::file(path, format!("tensor `{name}`: {e:?}")))?;
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    let info = HashMap::from([("meta".to_string(), meta.to_string())]);
    let bytes = safetensors::serialize(views, Some(info))
        .map_err(|e| MoeError::file(path, format!("cannot encode: {e:?}")))?;
    std::fs::write(path, bytes).map_err(|e| MoeError::file(path, format!("cannot write: {e}")))
}

/// Looks up `name` in `tensors` and checks its shape; errors name the file and the tensor.
pub(crate) fn expect_tensor<'a>(
    tensors: &'a TensorMap,
    name: &str,
    shape: &[usize],
    source: &Path,
) -> Result<&'a TensorData> {
    let data = tensors
        .get(name)
        .ok_or_else(|| MoeError::file(source, format!("missing tensor `{name}`")))?;
    if data.shape.to_vec() != shape {
        return Err(MoeError::file(
            source,
            format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                data.shape.to_vec()
            ),
        ));
    }
    Ok(data)
}

/// Rows `range` of a tensor along its first dimension.
pub(crate) fn slice_first_dim(data: &TensorData, range: std::ops::Range<usize>) -> TensorData {
    let dims = &data.shape.to_vec();
    let row: usize = dims[1..].iter().product::<usize>() * data.dtype.size();
    let bytes = data.as_bytes()[range.start * row..range.end * row].to_vec();
    let mut shape = dims.clone();
    shape[0] = range.len();
    TensorData::from_bytes_vec(bytes, shape, data.dtype)
}

impl<B: Backend> MoeLayer<B> {
    /// Loads a single-rank layer from a canonical safetensors file.
    pub fn load_safetensors(path: impl AsRef<Path>, device: &B::Device) -> Result<Self> {
        Self::load_safetensors_rank(path, device, Arc::new(SingleRank))
    }

    /// Loads this rank's part of a layer from a canonical safetensors file: the router (and
    /// shared expert) and experts `[r·E/N, (r+1)·E/N)`.
    pub fn load_safetensors_rank(
        path: impl AsRef<Path>,
        device: &B::Device,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let path = path.as_ref();
        let (tensors, meta) = read_safetensors(path)?;
        let meta = meta.ok_or_else(|| MoeError::file(path, "no `meta` key in the safetensors metadata"))?;
        let meta = LayerMeta::parse(&meta).map_err(|e| MoeError::file(path, e))?;
        let n_tokens = tensors.get("x").map(|x| x.shape.to_vec()[0]);
        let config = meta.to_config(n_tokens).map_err(|e| MoeError::file(path, e))?;
        Self::from_tensor_map(&config, &tensors, path, device, comm)
    }

    /// Builds this rank's part of a layer from named tensors in the canonical layout.
    /// `source` names where they came from, for errors.
    pub fn from_tensor_map(
        config: &MoeLayerConfig,
        tensors: &TensorMap,
        source: &Path,
        device: &B::Device,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        config.validate_for_ranks(comm.n_ranks())?;
        let shapes: BTreeMap<_, _> = parameter_shapes(config).into_iter().collect();
        let get = |name: &str| expect_tensor(tensors, name, &shapes[name], source);
        let n_local = config.n_experts / comm.n_ranks();
        let local = comm.rank() * n_local..(comm.rank() + 1) * n_local;
        // Host data is f32; the backend's float type may differ (f64 for the golden reference).
        let float = |d: TensorData| d.convert::<B::FloatElem>();
        let param2 = |d: &TensorData| Param::from_tensor(Tensor::<B, 2>::from_data(float(d.clone()), device));
        let experts3 = |name: &str| -> Result<Param<Tensor<B, 3>>> {
            Ok(Param::from_tensor(Tensor::from_data(
                float(slice_first_dim(get(name)?, local.clone())),
                device,
            )))
        };
        let experts2 = |name: &str| -> Result<Param<Tensor<B, 2>>> {
            Ok(Param::from_tensor(Tensor::from_data(
                float(slice_first_dim(get(name)?, local.clone())),
                device,
            )))
        };
        let router = Router {
            weight: param2(get("router.weight")?),
            bias: match config.router_bias {
                true => Some(Param::from_tensor(Tensor::from_data(
                    float(get("router.bias")?.clone()),
                    device,
                ))),
                false => None,
            },
        };
        let experts = Experts {
            w_in: experts3("experts.w_in")?,
            b_in: config.bias.then(|| experts2("experts.b_in")).transpose()?,
            w_out: experts3("experts.w_out")?,
            b_out: config.bias.then(|| experts2("experts.b_out")).transpose()?,
            activation: config.activation,
            first_expert: local.start,
        };
        let shared = match config.shared_expert {
            Some(_) => Some(SharedExpert {
                w_in: param2(get("shared.w_in")?),
                w_out: param2(get("shared.w_out")?),
                gate: param2(get("shared.gate.weight")?),
            }),
            None => None,
        };
        Ok(Self::from_parts(
            router,
            experts,
            shared,
            MoeContext::new(config.clone(), comm),
        ))
    }

    /// Every parameter in the canonical layout, with the experts gathered from all ranks.
    ///
    /// A collective: every rank must call it. Rank 0 receives the full map; other ranks get
    /// `None`.
    pub fn gather_tensor_map(&self) -> Result<Option<TensorMap>> {
        let comm = self.context().comm().clone();
        let mut own = TensorMap::new();
        own.insert(
            "router.weight".into(),
            self.router.weight.val().into_data().convert::<f32>(),
        );
        if let Some(b) = &self.router.bias {
            own.insert("router.bias".into(), b.val().into_data().convert::<f32>());
        }
        if let Some(s) = &self.shared {
            own.insert("shared.w_in".into(), s.w_in.val().into_data().convert::<f32>());
            own.insert("shared.w_out".into(), s.w_out.val().into_data().convert::<f32>());
            own.insert(
                "shared.gate.weight".into(),
                s.gate.val().into_data().convert::<f32>(),
            );
        }
        let mut local: Vec<(&str, TensorData)> = vec![
            (
                "experts.w_in",
                self.experts.w_in.val().into_data().convert::<f32>(),
            ),
            (
                "experts.w_out",
                self.experts.w_out.val().into_data().convert::<f32>(),
            ),
        ];
        if let (Some(b_in), Some(b_out)) = (&self.experts.b_in, &self.experts.b_out) {
            local.push(("experts.b_in", b_in.val().into_data().convert::<f32>()));
            local.push(("experts.b_out", b_out.val().into_data().convert::<f32>()));
        }
        let mut payload = Vec::new();
        for (_, data) in &local {
            payload.extend_from_slice(data.as_bytes());
        }
        let mut outgoing = vec![Payload::Bytes(Vec::new()); comm.n_ranks()];
        outgoing[0] = Payload::Bytes(payload);
        let incoming = comm.exchange("gather_tensor_map", outgoing)?;
        if comm.rank() != 0 {
            return Ok(None);
        }
        // Every rank holds the same number of experts, so blocks line up tensor by tensor.
        let blocks: Vec<Vec<u8>> = incoming
            .into_iter()
            .map(|p| match p {
                Payload::Bytes(b) => Ok(b),
                _ => Err(MoeError::comm("gather_tensor_map", 0, "expected a bytes payload")),
            })
            .collect::<Result<_>>()?;
        let mut cursor = 0;
        for (name, data) in &local {
            let len = data.as_bytes().len();
            let mut bytes = Vec::with_capacity(len * blocks.len());
            for block in &blocks {
                bytes.extend_from_slice(&block[cursor..cursor + len]);
            }
            cursor += len;
            let mut shape = data.shape.to_vec();
            shape[0] *= blocks.len();
            own.insert(
                name.to_string(),
                TensorData::from_bytes_vec(bytes, shape, DType::F32),
            );
        }
        Ok(Some(own))
    }

    /// Saves the whole layer (experts gathered from all ranks) to a canonical safetensors
    /// file. A collective: every rank calls it; rank 0 writes.
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        if let Some(tensors) = self.gather_tensor_map()? {
            let meta = serde_json::to_string(&LayerMeta::from_config(self.config()))
                .map_err(|e| MoeError::file(path.as_ref(), format!("cannot encode meta: {e}")))?;
            write_safetensors(path.as_ref(), &tensors, &meta)?;
        }
        Ok(())
    }
}
