//! Reading one MoE layer out of a Hugging Face checkpoint.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use burn::tensor::backend::Backend;

use super::checkpoint::{dtype_name, Checkpoint};
use super::family::{Family, HfConfig, LayerNames};
use super::layout::{hf_entries, to_canonical};
use crate::comm::{Communicator, SingleRank};
use crate::error::Result;
use crate::layer::{write_safetensors, LayerMeta, MoeLayer, MoeLayerConfig, TensorMap};

/// One MoE layer of a Hugging Face checkpoint: where it is and the layer config it implies.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HfLayer {
    /// The architecture.
    pub family: Family,
    /// The layer's index in the model.
    pub layer: usize,
    /// The layer config `config.json` implies.
    #[serde(skip)]
    pub config: MoeLayerConfig,
    /// The dtype the checkpoint is stored in (`float32`, `bfloat16`, `float16`), as
    /// `config.json` says.
    pub dtype: Option<String>,
}

impl HfLayer {
    /// Reads `config.json` of the checkpoint in `dir` for MoE layer `layer`.
    ///
    /// # Errors
    /// [`MoeError::File`](crate::MoeError::File) naming `config.json` if the family is not
    /// supported, the layer does not exist or is a dense MLP, or a key is missing.
    pub fn read(dir: impl AsRef<Path>, layer: usize) -> Result<Self> {
        let hf = HfConfig::read(dir.as_ref())?;
        Ok(Self {
            family: hf.family,
            layer,
            config: hf.layer_config(layer)?,
            dtype: hf.dtype(),
        })
    }

    /// The canonical file's meta for this layer: the config's, plus `kind`, `hf_layer` and
    /// `hf_dtype`.
    pub fn meta(&self) -> LayerMeta {
        LayerMeta {
            kind: Some(self.family.model_type().to_string()),
            hf_layer: Some(self.layer),
            hf_dtype: self.dtype.clone(),
            ..LayerMeta::from_config(&self.config)
        }
    }

    pub(crate) fn names(&self) -> LayerNames {
        LayerNames::new(self.family, self.layer)
    }
}

/// Reads MoE layer `layer` of the checkpoint in `dir` into canonical f32 tensors, with the
/// experts in `experts` only (global indices; `0..n_experts` for all). Only that layer's
/// tensors, and of its experts only those in `experts`, are read, through memory maps of the
/// shards that hold them.
///
/// # Errors
/// [`MoeError::File`](crate::MoeError::File) naming the file and tensor if a tensor is
/// missing, has a shape that disagrees with `config.json`, or an unsupported dtype; the
/// errors of [`HfLayer::read`].
pub fn read_layer(
    dir: impl AsRef<Path>,
    layer: usize,
    experts: Range<usize>,
) -> Result<(HfLayer, TensorMap)> {
    let dir = dir.as_ref();
    let mut info = HfLayer::read(dir, layer)?;
    let names = info.names();
    let entries = hf_entries(&info.config, &names, experts.clone());
    let stored = Checkpoint::open(dir)?.read(&entries)?;
    if info.dtype.is_none() {
        // Older configs may not say: the router's stored dtype does.
        info.dtype = stored.get(&names.router()).map(|t| dtype_name(t.dtype));
    }
    let values: HashMap<String, Vec<f32>> = stored.into_iter().map(|(name, t)| (name, t.values)).collect();
    let tensors = to_canonical(&info.config, &names, experts, &values);
    Ok((info, tensors))
}

/// Writes MoE layer `layer` of the checkpoint in `dir` as a canonical float32 layer file (the
/// cases' tensor names and meta, plus `kind`, `hf_layer` and `hf_dtype`): what
/// `mpipemoe convert --from-hf` does. Returns the layer's description.
pub fn convert_to_file(dir: impl AsRef<Path>, layer: usize, out: impl AsRef<Path>) -> Result<HfLayer> {
    let hf = HfConfig::read(dir.as_ref())?;
    let n_experts = hf.layer_config(layer)?.n_experts;
    let (info, tensors) = read_layer(dir, layer, 0..n_experts)?;
    let meta = serde_json::to_string(&info.meta()).expect("layer meta serializes");
    write_safetensors(out.as_ref(), &tensors, &meta)?;
    Ok(info)
}

impl<B: Backend> MoeLayer<B> {
    /// Imports MoE layer `layer` of the Hugging Face checkpoint in `dir` (Mixtral, Qwen2-MoE,
    /// Qwen3-MoE, OLMoE or DeepSeek-V3; one file or shards; f32, bf16 or f16 stored) as a
    /// single-rank layer.
    ///
    /// ```no_run
    /// use burn::backend::{Autodiff, NdArray};
    /// use mpipemoe::MoeLayer;
    ///
    /// let device = Default::default();
    /// let layer = MoeLayer::<Autodiff<NdArray>>::from_hf("Mixtral-8x7B-v0.1", 3, &device)?;
    /// # Ok::<(), mpipemoe::MoeError>(())
    /// ```
    ///
    /// # Errors
    /// See [`read_layer`].
    pub fn from_hf(dir: impl AsRef<Path>, layer: usize, device: &B::Device) -> Result<Self> {
        Self::from_hf_rank(dir, layer, device, Arc::new(SingleRank))
    }

    /// This rank's part of MoE layer `layer` of a Hugging Face checkpoint: the router (and
    /// shared expert) and experts `[r·E/N, (r+1)·E/N)`, reading only those experts' tensors.
    ///
    /// # Errors
    /// See [`read_layer`]; [`MoeError::Config`](crate::MoeError::Config) if the experts do not
    /// split evenly over the ranks.
    pub fn from_hf_rank(
        dir: impl AsRef<Path>,
        layer: usize,
        device: &B::Device,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let info = HfLayer::read(dir, layer)?;
        info.config.validate_for_ranks(comm.n_ranks())?;
        let n_local = info.config.n_experts / comm.n_ranks();
        let mine = comm.rank() * n_local..(comm.rank() + 1) * n_local;
        let (info, tensors) = read_layer(dir, layer, mine)?;
        Self::from_local_tensors(&info.config, &tensors, dir, device, comm)
    }
}
