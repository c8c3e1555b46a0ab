//! The rest of a checkpoint: any tensor by name, for a loader of whole models (attention,
//! norms, embeddings) that reads through the same bounded, shape-checked reader as the MoE
//! layers.

use std::collections::{BTreeSet, HashMap};

use safetensors::Dtype;
use serde_json::Value;

use super::checkpoint::dtype_name;
use super::fp8::scale_name;
use super::layout::{hf_entries, to_hf, HfEntry};
use super::model::HfCheckpoint;
use crate::error::Result;
use crate::layer::TensorMap;

impl HfCheckpoint {
    /// The text model's `config.json` keys (its `text_config` where a multimodal release
    /// nests them), for a loader that builds the rest of the model.
    pub fn config_json(&self) -> &Value {
        self.config.json()
    }

    /// What every text-model tensor name starts with before `layers.{l}.` (`model.`, or
    /// `language_model.model.` for Llama 4's multimodal releases).
    pub fn root(&self) -> &str {
        self.config.root
    }

    /// Every tensor name the folder holds, sorted.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.ckpt.weight_map.keys().map(String::as_str)
    }

    /// Tensor `name`'s stored shape and dtype (as transformers names it: `float32`,
    /// `bfloat16`, ...), from its shard's header; no data is read.
    ///
    /// # Errors
    /// [`MoeError::File`](crate::MoeError::File) naming the index if no shard holds it, or the
    /// shard if its header is bad.
    pub fn tensor_info(&self, name: &str) -> Result<(Vec<usize>, String)> {
        let (dtype, shape): (Dtype, Vec<usize>) = self.ckpt.header_shapes(&[name.to_string()])?[name].clone();
        Ok((shape, dtype_name(dtype)))
    }

    /// Tensor `name` as f32 values (row-major), widened from its stored dtype or dequantised
    /// (FP8 block-scaled weights), after checking that its stored shape is `shape`: a loader
    /// passes the shape `config.json` implies, so a file that disagrees is refused before
    /// anything is allocated from it.
    ///
    /// # Errors
    /// [`MoeError::File`](crate::MoeError::File) naming the shard and the tensor if it is
    /// missing, of another shape or an unsupported dtype, or (unless the checkpoint was opened
    /// with `allow_nonfinite`) holds a NaN or infinite value.
    pub fn read_tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let entry = HfEntry::whole(name.to_string(), shape.to_vec());
        let mut read = self.ckpt.read(std::slice::from_ref(&entry), &self.options)?;
        Ok(read.remove(name).map(|t| t.values).unwrap_or_default())
    }

    /// The stored tensors MoE layer `layer` is read from, every expert's (FP8 scales and
    /// MXFP4's blocks and scales included): with the rest of a model's tensors, what a loader
    /// checks the folder against, so that a tensor nothing reads is reported.
    ///
    /// # Errors
    /// As [`layer`](Self::layer).
    pub fn layer_tensor_names(&self, layer: usize) -> Result<BTreeSet<String>> {
        let info = self.layer(layer)?;
        // Every expert's names are enumerated below: the count must first agree with what
        // is stored.
        self.check_router(layer, &info)?;
        let names = info.names();
        let stored = &self.ckpt.weight_map;
        let mut out = BTreeSet::new();
        for entry in hf_entries(&info.config, &names, 0..info.config.n_experts) {
            let candidates = [
                entry.name.clone(),
                scale_name(&entry.name),
                format!("{}_blocks", entry.name),
                format!("{}_scales", entry.name),
            ];
            out.extend(candidates.into_iter().filter(|n| stored.contains_key(n)));
        }
        Ok(out)
    }

    /// MoE layer `layer`'s canonical tensors (every expert: `router.weight`, `experts.w_in`,
    /// ...; weights or their gradients) under the folder's names and in its layout (`[out,
    /// in]` matrices per expert, or stacked), as f32: what an exporter writes, and what a test
    /// compares with gradients stored under the checkpoint's names.
    ///
    /// # Errors
    /// As [`layer`](Self::layer); [`MoeError::Input`](crate::MoeError::Input) naming a
    /// canonical tensor that is missing or of the wrong shape.
    pub fn layer_to_hf(&self, layer: usize, tensors: &TensorMap) -> Result<HashMap<String, Vec<f32>>> {
        let info = self.layer(layer)?;
        to_hf(&info.config, &info.names(), tensors)
    }
}
