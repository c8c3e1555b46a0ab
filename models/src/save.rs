//! A whole model written back as a Hugging Face folder.

use std::collections::HashMap;
use std::path::Path;

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use mpipemoe::format::TensorMap;
use mpipemoe::hf::{write_model_with, ExportOptions, ExportReport, HfCheckpoint};
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
    /// (another model's folder), or naming `out_dir` as [`write_model_with`] does.
    pub fn save_hf(
        &self,
        checkpoint: impl AsRef<Path>,
        out_dir: impl AsRef<Path>,
        options: &ExportOptions,
    ) -> Result<Option<ExportReport>> {
        let checkpoint = checkpoint.as_ref();
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
        let ckpt = HfCheckpoint::open(checkpoint)?;
        let others = self.dense_tensors(ckpt.root())?;
        drop(ckpt);
        let layers: Vec<(usize, &TensorMap)> = gathered.iter().map(|(i, t)| (*i, t)).collect();
        write_model_with(checkpoint, &layers, others, out_dir, options).map(Some)
    }

    /// Every tensor but the MoE layers', under the Hugging Face names and in their layout
    /// (`[out, in]` matrices), as f32.
    fn dense_tensors(&self, root: &str) -> Result<HashMap<String, Vec<f32>>> {
        let mut out = HashMap::new();
        let mut linear = |name: String, l: &Linear<B>| -> Result<()> {
            out.insert(format!("{name}.weight"), values(l.weight.val().transpose())?);
            if let Some(b) = &l.bias {
                out.insert(format!("{name}.bias"), values(b.val())?);
            }
            Ok(())
        };
        for (i, layer) in self.layers.iter().enumerate() {
            let p = format!("{root}layers.{i}");
            linear(format!("{p}.self_attn.q_proj"), &layer.attn.q)?;
            linear(format!("{p}.self_attn.k_proj"), &layer.attn.k)?;
            linear(format!("{p}.self_attn.v_proj"), &layer.attn.v)?;
            linear(format!("{p}.self_attn.o_proj"), &layer.attn.o)?;
            if let Some(mlp) = &layer.mlp {
                linear(format!("{p}.mlp.gate_proj"), &mlp.gate)?;
                linear(format!("{p}.mlp.up_proj"), &mlp.up)?;
                linear(format!("{p}.mlp.down_proj"), &mlp.down)?;
            }
        }
        if let Some(head) = &self.lm_head {
            linear("lm_head".into(), head)?;
        }
        let vector = |p: &Param<Tensor<B, 1>>| values(p.val());
        out.insert(
            format!("{root}embed_tokens.weight"),
            values(self.embed.weight.val())?,
        );
        out.insert(format!("{root}norm.weight"), vector(&self.norm.weight)?);
        for (i, layer) in self.layers.iter().enumerate() {
            let p = format!("{root}layers.{i}");
            out.insert(
                format!("{p}.input_layernorm.weight"),
                vector(&layer.attn_norm.weight)?,
            );
            out.insert(
                format!("{p}.post_attention_layernorm.weight"),
                vector(&layer.ffn_norm.weight)?,
            );
            if let Some(n) = &layer.attn.q_norm {
                out.insert(format!("{p}.self_attn.q_norm.weight"), vector(&n.weight)?);
            }
            if let Some(n) = &layer.attn.k_norm {
                out.insert(format!("{p}.self_attn.k_norm.weight"), vector(&n.weight)?);
            }
        }
        Ok(out)
    }
}

fn values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .into_vec()
        .map_err(|e| MoeError::Input(format!("a weight: {e:?}")))
}
