//! Hugging Face checkpoints in and out.
//!
//! Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-V3 checkpoints (one `model.safetensors`
//! or shards with `model.safetensors.index.json`; f32, bf16 or f16 stored) hold their MoE
//! layers as one `[out, in]` matrix per projection and expert. [`read_layer`] and
//! [`MoeLayer::from_hf_rank`](crate::MoeLayer::from_hf_rank) read one layer's tensors, and
//! with expert parallelism only this rank's experts, through memory maps of the shards that
//! hold them; [`write_layer`] and [`MoeLayer::save_hf`](crate::MoeLayer::save_hf) write a
//! layer back under the same names, dtypes and shards, so that a fine-tuned model loads in
//! transformers again. [`inspect`] lists a checkpoint's MoE layers.
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
mod export;
mod family;
mod import;
mod inspect;
mod layout;

pub use checkpoint::ImportOptions;
pub use export::{write_layer, write_layer_with, ExportOptions, ExportReport};
pub use family::Family;
pub use import::{convert_to_file, convert_to_file_with, read_layer, read_layer_with, HfLayer};
pub use inspect::{inspect, LayerSummary};
