//! A whole Hugging Face checkpoint, opened once: every MoE layer of a model read from one
//! parse of `config.json` and the index and one map of each shard.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use burn::tensor::backend::Backend;

use super::checkpoint::{dtype_name, Checkpoint, ImportOptions, ReadStats};
use super::config::HfConfig;
use super::family::Family;
use super::import::HfLayer;
use super::layout::{hf_entries, to_canonical};
use crate::comm::Communicator;
use crate::error::{MoeError, Result};
use crate::layer::{MoeLayer, TensorMap};

/// A Hugging Face checkpoint folder, opened once for many layers.
///
/// [`MoeLayer::from_hf`] opens the folder for the one layer it reads: it parses
/// `config.json` and the index, maps the shards that hold the layer and parses their
/// headers, every call. A model with 60 MoE layers in 160 shards pays that 60 times.
/// `HfCheckpoint` parses the config and the index once, maps each shard and parses its header
/// the first time a layer needs it, and keeps them until it is dropped; tensor data is
/// copied out of the maps only for the layers and experts asked for.
///
/// ```no_run
/// use std::sync::Arc;
/// use burn::backend::{Autodiff, NdArray};
/// use mpipemoe::{comm::SingleRank, hf::HfCheckpoint};
///
/// let ckpt = HfCheckpoint::open("Qwen1.5-MoE-A2.7B")?;
/// let layers = ckpt.load_layers::<Autodiff<NdArray>>(&Default::default(), Arc::new(SingleRank))?;
/// for (index, layer) in &layers {
///     println!("layer {index}: {} experts", layer.config().n_experts);
/// }
/// println!("{:?}", ckpt.stats());
/// # Ok::<(), mpipemoe::MoeError>(())
/// ```
pub struct HfCheckpoint {
    pub(crate) config: HfConfig,
    /// The folder's tensors, with the FP8 block size from `config`.
    pub(crate) ckpt: Checkpoint,
    pub(crate) options: ImportOptions,
}

impl HfCheckpoint {
    /// Opens the checkpoint in `dir`: reads `config.json` and the index (or the single file's
    /// header); no tensor data is read.
    ///
    /// # Errors
    /// [`MoeError::File`] naming `config.json` if its family is not supported, a key is bad,
    /// or the folder's tensors disagree with the layer kinds the config decides (a dense
    /// layer holding expert tensors, a MoE layer without its router: named with the layer,
    /// the deciding keys and a tensor); naming the index if it is not JSON or names a shard
    /// outside the folder.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = HfConfig::read(dir)?;
        let mut ckpt = Checkpoint::open(dir)?;
        config.check_layer_kinds(&ckpt.weight_map)?;
        ckpt.quant = config.quantization()?;
        if config.family.stacked_experts() {
            for layer in config.moe_layers()? {
                let names = config.names(layer);
                ckpt.refuse_unpacked_experts(&[names.stacked_gate_up(), names.stacked_down()])?;
            }
        }
        ckpt.count(|s| s.metadata_bytes += config.bytes as u64);
        Ok(Self {
            config,
            ckpt,
            options: ImportOptions::default(),
        })
    }

    /// The same checkpoint read with `options` (non-finite weights accepted or not).
    pub fn with_options(self, options: ImportOptions) -> Self {
        Self { options, ..self }
    }

    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.ckpt.dir
    }

    /// The architecture.
    pub fn family(&self) -> Family {
        self.config.family
    }

    /// The indices of the model's MoE layers, in order (dense layers left out).
    ///
    /// # Errors
    /// [`MoeError::File`] naming `config.json` if a key that decides it is bad.
    pub fn moe_layers(&self) -> Result<Vec<usize>> {
        self.config.moe_layers()
    }

    /// MoE layer `layer`'s description, from `config.json` only.
    ///
    /// # Errors
    /// As [`HfLayer::read`].
    pub fn layer(&self, layer: usize) -> Result<HfLayer> {
        HfLayer::from_config(&self.config, layer)
    }

    /// What has been read so far: shards mapped, metadata parsed, tensor bytes copied.
    pub fn stats(&self) -> ReadStats {
        self.ckpt.stats()
    }

    /// Refuses MoE layer `layer` where `config.json`'s expert count and width disagree with
    /// the router's stored shape (read from its shard's header, nothing else): the router
    /// bounds every size the config gives before anything is allocated or enumerated from
    /// them, so a config that claims 10^9 experts is refused here.
    ///
    /// # Errors
    /// [`MoeError::File`] naming `config.json`, the layer and the router's stored shape.
    pub(crate) fn check_router(&self, layer: usize, info: &HfLayer) -> Result<()> {
        let (e_all, m) = (info.config.n_experts, info.config.d_model);
        let router = info.names().router();
        let (_, router_shape) = self.ckpt.header_shapes(std::slice::from_ref(&router))?[&router].clone();
        if router_shape != [e_all, m] {
            return Err(MoeError::file(
                self.dir().join("config.json"),
                format!(
                    "layer {layer}: config.json implies {e_all} experts of width {m} (router [{e_all}, {m}]), but the checkpoint's `{router}` is {router_shape:?}"
                ),
            ));
        }
        Ok(())
    }

    /// MoE layer `layer` as canonical f32 tensors, with the experts in `experts` only (global
    /// indices; `0..n_experts` for all).
    ///
    /// # Errors
    /// As [`read_layer`](super::read_layer).
    pub fn read_layer(&self, layer: usize, experts: Range<usize>) -> Result<(HfLayer, TensorMap)> {
        let mut info = self.layer(layer)?;
        let names = info.names();
        let e_all = info.config.n_experts;
        if experts.start > experts.end || experts.end > e_all {
            return Err(MoeError::config(
                "experts",
                format!("{experts:?} is not a range of the layer's {e_all} experts"),
            ));
        }
        self.check_router(layer, &info)?;
        let router = names.router();
        let entries = hf_entries(&info.config, &names, experts.clone());
        let stored = self.ckpt.read(&entries, &self.options)?;
        // The dtype is what the tensors are stored in, not what config.json says; a layer
        // whose tensors disagree has no one dtype to write back, so it is refused. Quantised
        // weights (FP8, MXFP4; dequantised above) sit beside an unquantised router, as
        // published.
        let router_dtype = stored[&router].dtype;
        let quantized = stored.values().any(|t| t.quantized);
        if let Some((other, t)) = stored
            .iter()
            .find(|(_, t)| t.dtype != router_dtype && !t.quantized)
        {
            return Err(MoeError::file(
                self.dir().join(self.ckpt.shard_of(other)?),
                format!(
                    "layer {layer} mixes dtypes: `{router}` is {} but `{other}` is {}",
                    dtype_name(router_dtype),
                    dtype_name(t.dtype)
                ),
            ));
        }
        info.dtype = Some(match (quantized, self.ckpt.quant) {
            (true, Some(q)) => format!("{} + {}", dtype_name(router_dtype), q.describe()),
            _ => dtype_name(router_dtype),
        });
        let values: HashMap<String, Vec<f32>> =
            stored.into_iter().map(|(name, t)| (name, t.values)).collect();
        let tensors = to_canonical(&info.config, &names, experts, &values);
        Ok((info, tensors))
    }

    /// This rank's part of MoE layer `layer`: the router (and shared expert) and experts
    /// `[r·E/N, (r+1)·E/N)`, reading only those experts' tensors.
    ///
    /// # Errors
    /// As [`read_layer`](Self::read_layer); [`MoeError::Config`] if the experts do not split
    /// evenly over the ranks.
    pub fn load_layer<B: Backend>(
        &self,
        layer: usize,
        device: &B::Device,
        comm: Arc<dyn Communicator>,
    ) -> Result<MoeLayer<B>> {
        let info = self.layer(layer)?;
        info.config.validate_for_ranks(comm.n_ranks())?;
        let n_local = info.config.n_experts / comm.n_ranks();
        let mine = comm.rank() * n_local..(comm.rank() + 1) * n_local;
        let (info, tensors) = self.read_layer(layer, mine)?;
        MoeLayer::from_local_tensors(&info.config, &tensors, self.dir(), device, comm)
    }

    /// Every MoE layer of the model, in order, as this rank's part of each
    /// ([`load_layer`](Self::load_layer)): `(layer index, layer)`.
    ///
    /// # Errors
    /// The first error of [`load_layer`](Self::load_layer).
    pub fn load_layers<B: Backend>(
        &self,
        device: &B::Device,
        comm: Arc<dyn Communicator>,
    ) -> Result<Vec<(usize, MoeLayer<B>)>> {
        self.moe_layers()?
            .into_iter()
            .map(|layer| Ok((layer, self.load_layer(layer, device, comm.clone())?)))
            .collect()
    }
}

impl<B: Backend> MoeLayer<B> {
    /// Every MoE layer of the Hugging Face checkpoint in `dir`, in order, as this rank's part
    /// of each: `(layer index, layer)`. The folder is opened once ([`HfCheckpoint`]); with
    /// expert parallelism each rank reads its own experts only.
    ///
    /// # Errors
    /// As [`HfCheckpoint::open`] and [`HfCheckpoint::load_layer`].
    pub fn from_hf_layers(
        dir: impl AsRef<Path>,
        device: &B::Device,
        comm: Arc<dyn Communicator>,
    ) -> Result<Vec<(usize, Self)>> {
        HfCheckpoint::open(dir)?.load_layers(device, comm)
    }
}
