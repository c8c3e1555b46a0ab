//! Reading one MoE layer out of a Hugging Face checkpoint.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use burn::tensor::backend::Backend;

use super::checkpoint::ImportOptions;
use super::config::HfConfig;
use super::family::Family;
use super::model::HfCheckpoint;
use super::names::LayerNames;
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
    /// What the checkpoint's tensor names start with before `layers.` (`model.`, or
    /// `language_model.model.` in a multimodal Llama 4).
    #[serde(skip)]
    pub(crate) root: &'static str,
    /// The dtype the layer is stored in (`float32`, `bfloat16`, `float16`): after
    /// [`read_layer`], the tensors' own; from [`HfLayer::read`] alone, what `config.json` says.
    pub dtype: Option<String>,
}

impl HfLayer {
    /// Reads `config.json` of the checkpoint in `dir` for MoE layer `layer`.
    ///
    /// # Errors
    /// [`MoeError::File`](crate::MoeError::File) naming `config.json` if the family is not
    /// supported, the layer does not exist or is a dense MLP, or a key is missing.
    pub fn read(dir: impl AsRef<Path>, layer: usize) -> Result<Self> {
        Self::from_config(&HfConfig::read(dir.as_ref())?, layer)
    }

    /// MoE layer `layer` of a parsed `config.json`.
    pub(crate) fn from_config(hf: &HfConfig, layer: usize) -> Result<Self> {
        Ok(Self {
            family: hf.family,
            layer,
            root: hf.root,
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
        LayerNames::new(self.family, self.root, self.layer)
    }
}

/// Reads MoE layer `layer` of the checkpoint in `dir` into canonical f32 tensors, with the
/// experts in `experts` only (global indices; `0..n_experts` for all). Only that layer's
/// tensors, and of its experts only those in `experts`, are read, through memory maps of the
/// shards that hold them. NaN or infinite weights are an error ([`read_layer_with`] can
/// accept them).
///
/// # Errors
/// [`MoeError::File`](crate::MoeError::File) naming the file and tensor if a tensor is
/// missing, has a shape that disagrees with `config.json`, an unsupported dtype, a non-finite
/// value, or the layer's tensors are stored in more than one dtype; the errors of
/// [`HfLayer::read`].
pub fn read_layer(
    dir: impl AsRef<Path>,
    layer: usize,
    experts: Range<usize>,
) -> Result<(HfLayer, TensorMap)> {
    read_layer_with(dir, layer, experts, &ImportOptions::default())
}

/// [`read_layer`] with options.
///
/// # Errors
/// As [`read_layer`].
pub fn read_layer_with(
    dir: impl AsRef<Path>,
    layer: usize,
    experts: Range<usize>,
    options: &ImportOptions,
) -> Result<(HfLayer, TensorMap)> {
    HfCheckpoint::open(dir)?
        .with_options(*options)
        .read_layer(layer, experts)
}

/// Writes MoE layer `layer` of the checkpoint in `dir` as a canonical float32 layer file (the
/// cases' tensor names and meta, plus `kind`, `hf_layer` and `hf_dtype`): what
/// `mpipemoe convert` does. The file is written whole (into a temporary file beside `out`,
/// then renamed); an existing `out` is replaced. Returns the layer's description.
///
/// # Errors
/// As [`read_layer`], and [`MoeError::File`](crate::MoeError::File) naming `out` if it cannot be written.
pub fn convert_to_file(dir: impl AsRef<Path>, layer: usize, out: impl AsRef<Path>) -> Result<HfLayer> {
    convert_to_file_with(dir, layer, out, &ImportOptions::default())
}

/// [`convert_to_file`] with options.
///
/// # Errors
/// As [`convert_to_file`].
pub fn convert_to_file_with(
    dir: impl AsRef<Path>,
    layer: usize,
    out: impl AsRef<Path>,
    options: &ImportOptions,
) -> Result<HfLayer> {
    let hf = HfConfig::read(dir.as_ref())?;
    let n_experts = hf.layer_config(layer)?.n_experts;
    let (info, tensors) = read_layer_with(dir, layer, 0..n_experts, options)?;
    let meta = serde_json::to_string(&info.meta()).expect("layer meta serializes");
    write_safetensors(out.as_ref(), &tensors, &meta)?;
    Ok(info)
}

impl<B: Backend> MoeLayer<B> {
    /// Imports MoE layer `layer` of the Hugging Face checkpoint in `dir` (Mixtral, Qwen2-MoE,
    /// Qwen3-MoE, OLMoE, DeepSeek-V3, Llama 4 or GPT-OSS; one file or shards; f32, bf16 or f16
    /// stored, or FP8 block-scaled) as a single-rank layer.
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
        HfCheckpoint::open(dir)?.load_layer(layer, device, comm)
    }
}
