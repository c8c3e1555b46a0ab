//! Building a layer from named tensors (a file, or this rank's share of one) and gathering a
//! layer's tensors back, for the canonical layer file (`file.rs`).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use burn::module::Param;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use super::file::{
    expect_tensor, layer_file_config, parameter_shapes, read_safetensors, slice_first_dim, write_safetensors,
    TensorMap,
};
use super::{LayerMeta, MoeContext, MoeLayer, MoeLayerConfig};
use crate::comm::{Communicator, Payload, SingleRank};
use crate::error::{MoeError, Result};
use crate::experts::{ExpertShard, Experts, ShardCheck, SharedExpert};
use crate::router::{buffer, Router};

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
        let config = layer_file_config(&tensors, meta.as_deref(), path)?;
        Self::from_tensor_map(&config, &tensors, path, device, comm)
    }

    /// Builds this rank's part of a layer from named tensors in the canonical layout, with all
    /// `n_experts` experts in the expert tensors (this rank keeps its own).
    /// `source` names where they came from, for errors.
    pub fn from_tensor_map(
        config: &MoeLayerConfig,
        tensors: &TensorMap,
        source: &Path,
        device: &B::Device,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        config.validate_for_ranks(comm.n_ranks())?;
        let n_local = config.n_experts / comm.n_ranks();
        let local = comm.rank() * n_local..(comm.rank() + 1) * n_local;
        let mut mine = TensorMap::new();
        for (name, shape) in parameter_shapes(config) {
            let data = expect_tensor(tensors, name, &shape, source)?;
            let data = match name.starts_with("experts.") {
                true => slice_first_dim(data, local.clone()),
                false => data.clone(),
            };
            mine.insert(name.to_string(), data);
        }
        Self::from_local_tensors(config, &mine, source, device, comm)
    }

    /// Builds this rank's part of a layer from named tensors in the canonical layout whose
    /// expert tensors hold only this rank's `n_experts / n_ranks` experts (what an import that
    /// reads only its own experts produces). Host data of any float dtype is converted to the
    /// backend's float type.
    pub fn from_local_tensors(
        config: &MoeLayerConfig,
        tensors: &TensorMap,
        source: &Path,
        device: &B::Device,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        config.validate_for_ranks(comm.n_ranks())?;
        let n_local = config.n_experts / comm.n_ranks();
        let shapes: BTreeMap<_, _> = parameter_shapes(config)
            .into_iter()
            .map(|(name, mut shape)| {
                if name.starts_with("experts.") {
                    shape[0] = n_local;
                }
                (name, shape)
            })
            .collect();
        let get = |name: &str| -> Result<TensorData> {
            Ok(expect_tensor(tensors, name, &shapes[name], source)?
                .clone()
                .convert::<B::FloatElem>())
        };
        let param1 = |name: &str| -> Result<Param<Tensor<B, 1>>> {
            Ok(Param::from_tensor(Tensor::from_data(get(name)?, device)))
        };
        let param2 = |name: &str| -> Result<Param<Tensor<B, 2>>> {
            Ok(Param::from_tensor(Tensor::from_data(get(name)?, device)))
        };
        let param3 = |name: &str| -> Result<Param<Tensor<B, 3>>> {
            Ok(Param::from_tensor(Tensor::from_data(get(name)?, device)))
        };
        let router = Router {
            weight: param2("router.weight")?,
            bias: config.router_bias.then(|| param1("router.bias")).transpose()?,
            score_bias: config
                .score_bias
                .then(|| Ok::<_, MoeError>(buffer(Tensor::from_data(get("router.score_bias")?, device))))
                .transpose()?,
        };
        let rank = comm.rank();
        let experts = Experts {
            w_in: param3("experts.w_in")?,
            b_in: config.bias.then(|| param2("experts.b_in")).transpose()?,
            w_out: param3("experts.w_out")?,
            b_out: config.bias.then(|| param2("experts.b_out")).transpose()?,
            activation: config.activation,
            shard: ShardCheck::new(ExpertShard {
                first_expert: rank * n_local,
                n_local,
                n_experts: config.n_experts,
                rank,
                n_ranks: comm.n_ranks(),
            }),
        };
        let shared = match config.shared_expert {
            Some(_) => Some(SharedExpert {
                w_in: param2("shared.w_in")?,
                w_out: param2("shared.w_out")?,
                gate: config
                    .shared_expert_gate
                    .then(|| param2("shared.gate.weight"))
                    .transpose()?,
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
        if let Some(b) = &self.router.score_bias {
            own.insert("router.score_bias".into(), b.val().into_data().convert::<f32>());
        }
        if let Some(s) = &self.shared {
            own.insert("shared.w_in".into(), s.w_in.val().into_data().convert::<f32>());
            own.insert("shared.w_out".into(), s.w_out.val().into_data().convert::<f32>());
            if let Some(gate) = &s.gate {
                own.insert(
                    "shared.gate.weight".into(),
                    gate.val().into_data().convert::<f32>(),
                );
            }
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
        let Some(gathered) = gather_experts(comm.as_ref(), "gather_tensor_map", local)? else {
            return Ok(None);
        };
        own.extend(gathered);
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

/// Each rank's expert tensors `local` (stacked along the first dimension, the same names and
/// shapes on every rank), stacked over the ranks in rank order on rank 0; `None` on the other
/// ranks. A collective: every rank calls it with tensors of the same shapes.
pub(crate) fn gather_experts(
    comm: &dyn Communicator,
    op: &'static str,
    local: Vec<(&str, TensorData)>,
) -> Result<Option<TensorMap>> {
    let mut payload = Vec::new();
    for (_, data) in &local {
        payload.extend_from_slice(data.as_bytes());
    }
    let mut outgoing = vec![Payload::Bytes(Vec::new()); comm.n_ranks()];
    outgoing[0] = Payload::Bytes(payload);
    let incoming = comm.exchange(op, outgoing)?;
    if comm.rank() != 0 {
        return Ok(None);
    }
    let blocks: Vec<Vec<u8>> = incoming
        .into_iter()
        .map(|p| match p {
            Payload::Bytes(b) => Ok(b),
            _ => Err(MoeError::comm(op, 0, "expected a bytes payload")),
        })
        .collect::<Result<_>>()?;
    // Every rank holds the same number of experts, so blocks line up tensor by tensor.
    let mut out = TensorMap::new();
    let mut cursor = 0;
    for (name, data) in &local {
        let len = data.as_bytes().len();
        let mut bytes = Vec::with_capacity(len * blocks.len());
        for block in &blocks {
            let part = block
                .get(cursor..cursor + len)
                .ok_or_else(|| MoeError::comm(op, 0, format!("a rank sent too few bytes for `{name}`")))?;
            bytes.extend_from_slice(part);
        }
        cursor += len;
        let mut shape = data.shape.to_vec();
        shape[0] *= blocks.len();
        out.insert(
            name.to_string(),
            TensorData::from_bytes_vec(bytes, shape, DType::F32),
        );
    }
    Ok(Some(out))
}
