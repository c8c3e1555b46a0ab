//! Hugging Face checkpoints in and out.
//!
//! Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 checkpoints (one `model.safetensors`
//! or shards with `model.safetensors.index.json`; f32, bf16 or f16 stored) hold their MoE
//! layers as one `[out, in]` matrix per projection and expert; Llama 4 (`llama4`, and the
//! text-only `llama4_text`) and
//! GPT-OSS (unquantised or MXFP4) stack each projection's experts in one 3-D tensor applied as `x · W`
//! (GPT-OSS with gate and up columns interleaved, per-expert biases and its clamped SwiGLU,
//! [`Activation::ClampedSwiGlu`](crate::Activation::ClampedSwiGlu); Llama 4 with the router's
//! weight on the expert's input, [`MoeLayerConfig::weights_on_input`](crate::MoeLayerConfig::weights_on_input)).
//! [`read_layer`] and
//! [`MoeLayer::from_hf_rank`](crate::MoeLayer::from_hf_rank) read one layer's tensors, and
//! with expert parallelism only this rank's experts, through memory maps of the shards that
//! hold them; [`write_layer`] and [`MoeLayer::save_hf`](crate::MoeLayer::save_hf) write a
//! layer back under the same names, dtypes and shards, so that a fine-tuned model loads in
//! transformers again. [`inspect`] lists a checkpoint's MoE layers. [`HfCheckpoint`] opens
//! a folder once for every MoE layer of a model ([`MoeLayer::from_hf_layers`](crate::MoeLayer::from_hf_layers),
//! [`MoeLayer::save_hf_layers`](crate::MoeLayer::save_hf_layers) and [`write_layers_with`]
//! write them back with each shard rewritten once).
//!
//! FP8 block-scaled weights (`float8_e4m3fn` with a `weight_scale_inv` per block of
//! `quantization_config.weight_block_size`, as DeepSeek-V3 and Qwen3 publish them) are
//! dequantised on import, `f32(q) · f32(scale)`, as transformers' `Fp8Dequantize` does;
//! exporting into such a checkpoint writes them as FP8 again in its blocks
//! ([`ExportReport::requantized`] says which and how many blocks needed a new scale).
//! GPT-OSS's MXFP4 experts (`_blocks` / `_scales`, `quant_method: "mxfp4"`) are dequantised
//! as transformers' `convert_moe_packed_tensors` does, and written back as MXFP4 the same
//! way.
//!
//! ```no_run
//! use burn::backend::{Autodiff, NdArray};
//! use mpipemoe::{hf, MoeLayer};
//!
//! for layer in hf::inspect("Qwen1.5-MoE-A2.7B")? {
//!     println!("layer {}: {} experts, top-{}", layer.layer, layer.n_experts, layer.top_k);
//! }
//! let device = Default::default();
//! let layer = MoeLayer::<Autodiff<NdArray>>::from_hf("Qwen1.5-MoE-A2.7B", 0, &device)?;
//! // ... fine-tune ...
//! layer.save_hf("Qwen1.5-MoE-A2.7B", 0, "Qwen1.5-MoE-A2.7B-tuned")?;
//! # Ok::<(), mpipemoe::MoeError>(())
//! ```

mod checkpoint;
mod config;
mod export;
mod family;
mod fp8;
mod import;
mod inspect;
mod layers;
mod layout;
mod model;
mod mxfp4;
mod names;
mod quantization;
mod tensors;

pub use checkpoint::{ImportOptions, ReadStats};
pub use export::{
    check_out_dir, write_layer, write_layer_with, write_layers_with, write_model_with, ExportOptions,
    ExportReport, Requantized,
};
pub use family::Family;
pub use import::{convert_to_file, convert_to_file_with, read_layer, read_layer_with, HfLayer};
pub use inspect::{inspect, LayerSummary};
pub use model::HfCheckpoint;
