//! A whole model written back as a Hugging Face folder.

use std::collections::HashMap;
use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use mpipemoe::format::TensorMap;
use mpipemoe::hf::{write_model_with, ExportOptions, ExportReport};
use mpipemoe::{MoeError, Result};

use crate::model::MoeCausalLm;

impl<B: Backend> MoeCausalLm<B> {
    /// Writes the model back into the layout of the Hugging Face folder `checkpoint` it was
    /// loaded from, as a complete folder in `out_dir`: every tensor under its name, in the
    /// dtype, shard and quantisation the folder stores it in (FP8 weights re-quantised in their
    /// blocks), the index, `config.json` and the other files (tokenizer, generation config)
    /// copied. All or nothing ([`write_model_with`]). A collective with expert parallelism:
    /// every rank calls it; the experts are gathered and rank 0 writes (it returns the report,
    /// the other ranks `None`).
    ///
    /// # Errors
    /// [`MoeError::File`] naming the tensor if the folder's layout differs from the model's
    /// (another model's folder), or naming `out_dir` as [`write_model_with`] does;
    /// [`MoeError::Input`] if the model has adapters (merge or save them first).
    pub fn save_hf(
        &self,
        checkpoint: impl AsRef<Path>,
        out_dir: impl AsRef<Path>,
        options: &ExportOptions,
    ) -> Result<Option<ExportReport>> {
        let checkpoint = checkpoint.as_ref();
        if self.has_lora() {
            return Err(MoeError::Input(
                "the model has LoRA adapters, which its folder's layout has no place for: merge them \
                 first (merge_lora) or save them as a PEFT folder (save_adapter)"
                    .into(),
            ));
        }
        // Every rank takes part in every gather, in the same order; rank 0 gets them all.
        let mut gathered = Vec::new();
        for (i, layer) in self.moe_layers() {
            if let Some(tensors) = layer.gather_tensor_map()? {
                gathered.push((i, tensors));
            }
        }
        if gathered.len() != self.moe_layers().count() {
            return Ok(None);
        }
        let others = self.dense_tensors()?;
        let layers: Vec<(usize, &TensorMap)> = gathered.iter().map(|(i, t)| (*i, t)).collect();
        write_model_with(checkpoint, &layers, others, out_dir, options).map(Some)
    }

    /// Every tensor but the MoE layers', under the Hugging Face names and in their layout
    /// (`[out, in]` matrices), as f32.
    fn dense_tensors(&self) -> Result<HashMap<String, Vec<f32>>> {
        let parts = self.hf_parts();
        let mut out = HashMap::new();
        for (name, l) in parts.parts.linears {
            out.insert(format!("{name}.weight"), values(l.weight.val().transpose())?);
            if let Some(b) = &l.bias {
                out.insert(format!("{name}.bias"), values(b.val())?);
            }
        }
        for (name, v) in parts.parts.vectors {
            out.insert(name, values(v.val())?);
        }
        let (name, weight) = parts.embedding;
        out.insert(name, values(weight.val())?);
        Ok(out)
    }
}

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .into_vec()
        .map_err(|e| MoeError::Input(format!("a weight: {e:?}")))
}
