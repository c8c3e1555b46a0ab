//! The canonical layer file: one MoE layer in safetensors, under the reference cases' tensor
//! names and layouts, with its settings in the metadata key `meta`.
//!
//! A layer file holds `router.weight [E, M]` (and `router.bias [E]`, `router.score_bias [E]`
//! where the layer has them), `experts.w_in [E, M, F]`, `experts.b_in [E, F]`,
//! `experts.w_out [E, H, M]`, `experts.b_out [E, M]` and, with a shared expert,
//! `shared.w_in [M, 2Hs]`, `shared.w_out [Hs, M]` and `shared.gate.weight [1, M]` (gated
//! shared experts only). [`MoeLayer::load_safetensors`](crate::MoeLayer::load_safetensors)
//! reads one, [`MoeLayer::save_safetensors`](crate::MoeLayer::save_safetensors) writes one,
//! and `mpipemoe convert` makes one from a Hugging Face checkpoint.

pub use crate::layer::{
    layer_file_config, read_safetensors, write_safetensors, LayerMeta, SharedMeta, TensorMap,
};
