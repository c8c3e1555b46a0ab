//! The Hugging Face MoE families ([`Family`]: `config.json`'s `model_type`) and the parts of a
//! SwiGLU FFN their tensors name. What `config.json` says of a family's layers is in
//! `config.rs` and `layers.rs`, the tensors' names in `names.rs`.

/// A supported Hugging Face MoE architecture (`config.json`'s `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Family {
    /// `mixtral`: `block_sparse_moe.gate`, `experts.{i}.w1/w2/w3`, renormalised top-k.
    Mixtral,
    /// `qwen2_moe`: `mlp.gate`, `mlp.experts.{i}.*_proj`, a sigmoid-gated shared expert.
    Qwen2Moe,
    /// `qwen3_moe`: like Qwen2-MoE without the shared expert, renormalised by default.
    Qwen3Moe,
    /// `olmoe`: `mlp.gate`, `mlp.experts.{i}.*_proj`, not renormalised by default.
    Olmoe,
    /// `deepseek_v3`: sigmoid scores with a score-correction bias, group-limited top-k, a
    /// routed scaling factor, ungated shared experts, and dense first layers.
    DeepseekV3,
    /// `llama4_text`, or the multimodal `llama4` around it (`text_config`,
    /// `language_model.model.layers.*`): `feed_forward.router`, the experts stacked in one
    /// `feed_forward.experts.gate_up_proj [E, M, 2H]` and `down_proj [E, H, M]`, top-k by the
    /// logits with `sigmoid(logit)` multiplied into the expert's input, an ungated
    /// `shared_expert`.
    Llama4,
    /// `gpt_oss`: `mlp.router` with a bias, softmax over the top-k logits, the experts
    /// stacked in `mlp.experts.gate_up_proj [E, M, 2H]` with gate and up columns interleaved,
    /// per-expert biases, and the clamped SwiGLU; the projections stored as they are or, as
    /// the Hub's releases store them, in MXFP4 (`_blocks` and `_scales`).
    GptOss,
}

impl Family {
    /// Every supported family.
    pub const ALL: [Family; 7] = [
        Family::Mixtral,
        Family::Qwen2Moe,
        Family::Qwen3Moe,
        Family::Olmoe,
        Family::DeepseekV3,
        Family::Llama4,
        Family::GptOss,
    ];

    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Mixtral => "mixtral",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Qwen3Moe => "qwen3_moe",
            Family::Olmoe => "olmoe",
            Family::DeepseekV3 => "deepseek_v3",
            Family::Llama4 => "llama4_text",
            Family::GptOss => "gpt_oss",
        }
    }

    /// Whether the checkpoint stores a layer's experts stacked in one 3-D tensor per
    /// projection rather than one matrix per expert.
    pub fn stacked_experts(self) -> bool {
        matches!(self, Family::Llama4 | Family::GptOss)
    }

    /// Whether the stacked first matrix interleaves the gate and up columns
    /// (`gate = W[..., ::2]`, `up = W[..., 1::2]`) rather than storing the gate half first.
    pub fn interleaved_gate_up(self) -> bool {
        matches!(self, Family::GptOss)
    }

    pub(super) fn parse(model_type: &str) -> Option<Self> {
        Family::ALL.into_iter().find(|f| f.model_type() == model_type)
    }
}

/// Which part of a SwiGLU FFN a tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// The gate projection `[H, M]` (Mixtral's `w1`).
    Gate,
    /// The up projection `[H, M]` (Mixtral's `w3`).
    Up,
    /// The down projection `[M, H]` (Mixtral's `w2`).
    Down,
}
