//! Whole Mixture-of-Experts language models in burn, built around [`mpipemoe::MoeLayer`].
//!
//! One decoder ([`MoeCausalLm`]) made of shared parts — [`RmsNorm`], [`Rotary`] embeddings,
//! [`Attention`] with grouped-query heads, optional q/k norms and sliding windows, a dense
//! [`Mlp`] or an `MoeLayer` per layer, and a [`KvCache`] — configured by a
//! [`DecoderConfig`]. A family is a description, not a copy of the decoder: [`family`] reads a
//! Hugging Face `config.json` of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 (with
//! [`LatentAttention`]), GPT-OSS (attention sinks) or Llama 4 (chunked attention,
//! NoPE layers) into a
//! `DecoderConfig` (which rule each switches on), and [`MoeCausalLm::from_hf`] loads the
//! folder's tensors through mpipemoe's checkpoint reader, each rank reading its own experts.
//!
//! ```no_run
//! use std::sync::Arc;
//! use burn::backend::NdArray;
//! use burn::tensor::{Int, Tensor};
//! use mpipemoe::comm::SingleRank;
//! use mpipemoe_models::MoeCausalLm;
//!
//! let device = Default::default();
//! let model = MoeCausalLm::<NdArray>::from_hf("Mixtral-tiny", &device, Arc::new(SingleRank))?;
//! let ids = Tensor::<NdArray, 2, Int>::from_ints([[1, 5, 9]], &device);
//! let logits = model.forward(ids, None).logits; // [1, 3, vocab]
//! let new_ids = model.generate(&[1, 5, 9], 32, &device)?;
//! // Prompts of different lengths in one batch, left-padded as transformers pads them.
//! let prompts: [&[usize]; 2] = [&[1, 5, 9], &[7, 2]];
//! let options = mpipemoe_models::GenerateOptions::greedy(32);
//! let rows = model.generate_batch(&prompts, &options, &device)?; // each prompt's new ids
//! # Ok::<(), mpipemoe::MoeError>(())
//! ```

mod attention;
mod cache;
mod config;
pub mod family;
mod finetune;
mod generate;
mod generation;
mod host_memory;
mod latent;
mod layer;
mod linear;
mod load;
mod lora;
mod mlp;
mod model;
mod norm;
mod peft;
mod peft_config;
mod peft_layout;
mod places;
mod rotary;
mod sampling;
mod save;
mod tokenizer;

pub use attention::{Attention, QkNorm};
pub use cache::{KvCache, LayerCache};
pub use config::{AttnRules, DecoderConfig, FfnKind, LayerSpec};
pub use finetune::{finetune_rank, window_starts, FinetuneOptions, FinetuneReport, FinetuneStep};
pub use generation::{GenerateOptions, GenerationDefaults, GENERATION_CONFIG};
pub use host_memory::{attention_weights_bytes, check_host_bytes, forward_floor_bytes};
pub use latent::{LatentAttention, LatentConfig};
pub use layer::DecoderLayer;
pub use linear::DenseProducts;
pub use lora::{LoraLinear, LoraSpec, LORA_TARGETS};
pub use mlp::Mlp;
pub use model::{HfParts, LmOutput, MoeCausalLm};
pub use mpipemoe::rng::SplitMix64;
pub use norm::{NamedParts, RmsNorm};
pub use peft_config::{PeftAdapter, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
pub use places::Places;
pub use rotary::{RopeScaling, Rotary};
pub use sampling::Sampling;
pub use tokenizer::{TextTokenizer, MAX_TOKENIZER_BYTES};
