//! A whole model from a Hugging Face folder, every tensor read through mpipemoe's checkpoint
//! reader (bounded, shape-checked against `config.json`, FP8 dequantised, each rank reading
//! only its own experts).

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use burn::module::Param;
use burn::nn::{Embedding, Linear};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use mpipemoe::hf::HfCheckpoint;
use mpipemoe::{Communicator, MoeError, Result};

use crate::attention::{Attention, Heads};
use crate::config::{DecoderConfig, FfnKind};
use crate::family::decoder_config;
use crate::latent::{LatentAttention, LatentConfig};
use crate::layer::DecoderLayer;
use crate::mlp::Mlp;
use crate::model::{linear_weight, MoeCausalLm};
use crate::norm::RmsNorm;

/// Reads tensors by name and remembers which were read, so that the folder's other tensors
/// can be reported.
struct Reader<'a, B: Backend> {
    ckpt: &'a HfCheckpoint,
    device: &'a B::Device,
    used: BTreeSet<String>,
}

impl<B: Backend> Reader<'_, B> {
    fn tensor<const D: usize>(&mut self, name: &str, shape: [usize; D]) -> Result<Tensor<B, D>> {
        let values = self.ckpt.read_tensor(name, &shape)?;
        self.used.insert(name.to_string());
        // An FP8 weight was read with its block scales (dequantised): they are used too.
        if let Some(stem) = name.strip_suffix(".weight") {
            self.used.insert(format!("{stem}.weight_scale_inv"));
        }
        Ok(Tensor::from_data(TensorData::new(values, shape), self.device))
    }

    /// A `Linear` from `{prefix}.weight` (`[out, in]`) and, if `bias`, `{prefix}.bias`.
    fn linear(&mut self, prefix: &str, d_in: usize, d_out: usize, bias: bool) -> Result<Linear<B>> {
        let weight = linear_weight(self.tensor(&format!("{prefix}.weight"), [d_out, d_in])?);
        let bias = match bias {
            true => Some(Param::from_tensor(
                self.tensor(&format!("{prefix}.bias"), [d_out])?,
            )),
            false => None,
        };
        Ok(Linear { weight, bias })
    }

    fn norm(&mut self, name: &str, width: usize, eps: f64) -> Result<RmsNorm<B>> {
        Ok(RmsNorm {
            weight: Param::from_tensor(self.tensor(name, [width])?),
            eps,
        })
    }
}

impl<B: Backend> MoeCausalLm<B> {
    /// The model in the Hugging Face folder `dir` (`config.json`, safetensors shards), with
    /// this rank's experts of every MoE layer (all of them on one rank).
    ///
    /// # Errors
    /// [`MoeError::File`] naming `config.json` if the family is not supported or a key is bad
    /// (see [`family`](crate::family)); naming the shard and tensor if a tensor the model
    /// needs is missing or of another shape; naming the folder and the tensors the model does
    /// not read if there are any (transformers would leave them unused: a checkpoint of
    /// another shape or family); [`MoeError::Config`] if the experts do not split over the
    /// ranks.
    pub fn from_hf(dir: impl AsRef<Path>, device: &B::Device, comm: Arc<dyn Communicator>) -> Result<Self> {
        let ckpt = HfCheckpoint::open(dir)?;
        Self::from_checkpoint(&ckpt, device, comm)
    }

    /// As [`from_hf`](Self::from_hf), from a checkpoint already open.
    ///
    /// # Errors
    /// As [`from_hf`](Self::from_hf).
    pub fn from_checkpoint(
        ckpt: &HfCheckpoint,
        device: &B::Device,
        comm: Arc<dyn Communicator>,
    ) -> Result<Self> {
        let config = decoder_config(ckpt)?;
        let root = ckpt.root().to_string();
        let mut r = Reader::<B> {
            ckpt,
            device,
            used: BTreeSet::new(),
        };
        let (m, v, eps) = (config.d_model, config.vocab_size, config.rms_eps);
        let embed = Embedding {
            weight: Param::from_tensor(r.tensor(&format!("{root}embed_tokens.weight"), [v, m])?),
        };
        let mut layers = Vec::with_capacity(config.layers.len());
        for (i, spec) in config.layers.iter().enumerate() {
            let prefix = format!("{root}layers.{i}");
            let p = format!("{prefix}.self_attn");
            let (attn, mla) = match config.latent {
                None => (Some(read_attention(&mut r, &config, &p)?), None),
                Some(latent) => (None, Some(read_latent(&mut r, &config, latent, &p)?)),
            };
            let (mlp, moe) = match &spec.ffn {
                FfnKind::Dense { d_hidden } => {
                    let p = format!("{prefix}.{}", config.mlp_name);
                    let mlp = Mlp {
                        gate: r.linear(&format!("{p}.gate_proj"), m, *d_hidden, false)?,
                        up: r.linear(&format!("{p}.up_proj"), m, *d_hidden, false)?,
                        down: r.linear(&format!("{p}.down_proj"), *d_hidden, m, false)?,
                    };
                    (Some(mlp), None)
                }
                FfnKind::Moe(_) => {
                    r.used.extend(ckpt.layer_tensor_names(i)?);
                    (None, Some(ckpt.load_layer(i, device, comm.clone())?))
                }
            };
            layers.push(DecoderLayer {
                attn_norm: r.norm(&format!("{prefix}.input_layernorm.weight"), m, eps)?,
                attn,
                mla,
                ffn_norm: r.norm(&format!("{prefix}.post_attention_layernorm.weight"), m, eps)?,
                mlp,
                moe,
                rules: spec.attn,
                mlp_name: config.mlp_name.clone(),
            });
        }
        let norm = r.norm(&format!("{root}norm.weight"), m, eps)?;
        let lm_head = match config.tie_embeddings {
            true => None,
            false => Some(r.linear(&config.lm_head_name(), m, v, false)?),
        };
        // Tensors transformers itself skips on load are reported, not refused: DeepSeek-V3's
        // multi-token-prediction layers follow the decoder's (`layers.61` of the 61-layer
        // release: `_keys_to_ignore_on_load_unexpected`).
        let (ignored, unused): (Vec<&str>, Vec<&str>) = ckpt
            .tensor_names()
            .filter(|n| !r.used.contains(*n))
            .partition(|n| ignored_by_transformers(&config, &root, n));
        let ignored: Vec<String> = ignored.into_iter().map(str::to_string).collect();
        if !unused.is_empty() {
            let shown: Vec<&str> = unused.iter().take(5).copied().collect();
            return Err(MoeError::file(
                ckpt.dir(),
                format!(
                    "{} tensor(s) the {} model does not use (a checkpoint of another shape or family?): {}{}",
                    unused.len(),
                    config.model_type,
                    shown.join(", "),
                    if unused.len() > shown.len() { ", ..." } else { "" }
                ),
            ));
        }
        Ok(Self {
            embed,
            layers,
            norm,
            lm_head,
            config,
            ignored,
        })
    }
}

/// Whether transformers skips tensor `name` when it loads this family's text model:
/// DeepSeek-V3's layers past `num_hidden_layers` (its multi-token-prediction modules), and in
/// a multimodal release (Llama 4's) everything outside the language model (the vision tower,
/// the projector).
fn ignored_by_transformers(config: &DecoderConfig, root: &str, name: &str) -> bool {
    if let Some(outer) = root.strip_suffix("model.").filter(|o| !o.is_empty()) {
        if !name.starts_with(outer) {
            return true;
        }
    }
    if config.model_type != "deepseek_v3" {
        return false;
    }
    let layer = name
        .strip_prefix(root)
        .and_then(|rest| rest.strip_prefix("layers."))
        .and_then(|rest| rest.split('.').next())
        .and_then(|index| index.parse::<usize>().ok());
    layer.is_some_and(|l| l >= config.layers.len())
}

/// Grouped-query attention read from the checkpoint: every weight read (its stored shape
/// checked first) and nothing allocated from `config.json`'s sizes alone, so a config that
/// claims a huge `head_dim` or head count is refused by the first tensor's header.
fn read_attention<B: Backend>(
    r: &mut Reader<'_, B>,
    config: &DecoderConfig,
    p: &str,
) -> Result<Attention<B>> {
    let (m, hd, eps) = (config.d_model, config.head_dim, config.rms_eps);
    let (q_width, kv_width) = (config.n_heads * hd, config.n_kv_heads * hd);
    let (q_norm, k_norm) = Attention::<B>::norm_widths(config);
    Ok(Attention {
        q: r.linear(&format!("{p}.q_proj"), m, q_width, config.qkv_bias)?,
        k: r.linear(&format!("{p}.k_proj"), m, kv_width, config.qkv_bias)?,
        v: r.linear(&format!("{p}.v_proj"), m, kv_width, config.qkv_bias)?,
        o: r.linear(&format!("{p}.o_proj"), q_width, m, config.o_bias)?,
        q_norm: q_norm
            .map(|n| r.norm(&format!("{p}.q_norm.weight"), n, eps))
            .transpose()?,
        k_norm: k_norm
            .map(|n| r.norm(&format!("{p}.k_norm.weight"), n, eps))
            .transpose()?,
        sinks: match config.attention_sinks {
            true => Some(Param::from_tensor(
                r.tensor(&format!("{p}.sinks"), [config.n_heads])?,
            )),
            false => None,
        },
        lora: Vec::new(),
        shape: Heads::of(config),
    })
}

/// Latent attention read from the checkpoint, as [`read_attention`]: nothing allocated from
/// the config's sizes before a stored shape agrees with them.
fn read_latent<B: Backend>(
    r: &mut Reader<'_, B>,
    config: &DecoderConfig,
    c: LatentConfig,
    p: &str,
) -> Result<LatentAttention<B>> {
    let (m, h, eps, bias) = (config.d_model, config.n_heads, config.rms_eps, config.o_bias);
    let qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
    let (q, q_a, q_a_norm, q_b) = match c.q_lora_rank {
        None => (
            Some(r.linear(&format!("{p}.q_proj"), m, h * qk, false)?),
            None,
            None,
            None,
        ),
        Some(rank) => (
            None,
            Some(r.linear(&format!("{p}.q_a_proj"), m, rank, bias)?),
            Some(r.norm(&format!("{p}.q_a_layernorm.weight"), rank, eps)?),
            Some(r.linear(&format!("{p}.q_b_proj"), rank, h * qk, false)?),
        ),
    };
    Ok(LatentAttention {
        q,
        q_a,
        q_a_norm,
        q_b,
        kv_a: r.linear(
            &format!("{p}.kv_a_proj_with_mqa"),
            m,
            c.kv_lora_rank + c.qk_rope_head_dim,
            bias,
        )?,
        kv_a_norm: r.norm(&format!("{p}.kv_a_layernorm.weight"), c.kv_lora_rank, eps)?,
        lora: Vec::new(),
        kv_b: r.linear(
            &format!("{p}.kv_b_proj"),
            c.kv_lora_rank,
            h * (c.qk_nope_head_dim + c.v_head_dim),
            false,
        )?,
        o: r.linear(&format!("{p}.o_proj"), h * c.v_head_dim, m, bias)?,
        rules: (h, c),
    })
}
