//! The Hugging Face tensor names of one MoE layer ([`LayerNames`]), by family.

use super::family::{Family, Part};

/// The Hugging Face tensor names of one MoE layer.
#[derive(Debug, Clone)]
pub(crate) struct LayerNames {
    family: Family,
    prefix: String,
}

impl LayerNames {
    pub(crate) fn new(family: Family, root: &str, layer: usize) -> Self {
        let block = match family {
            Family::Mixtral => "block_sparse_moe",
            Family::Llama4 => "feed_forward",
            _ => "mlp",
        };
        Self {
            family,
            prefix: format!("{root}layers.{layer}.{block}."),
        }
    }

    /// The router's weight `[E, M]`.
    pub(crate) fn router(&self) -> String {
        match self.family {
            Family::Llama4 | Family::GptOss => format!("{}router.weight", self.prefix),
            _ => format!("{}gate.weight", self.prefix),
        }
    }

    /// The prefix every routed-expert tensor of this layer starts with (one matrix per expert
    /// or stacked, with their biases, scales or MXFP4 blocks).
    pub(crate) fn experts_prefix(&self) -> String {
        format!("{}experts.", self.prefix)
    }

    /// The router's bias `[E]` (GPT-OSS).
    pub(crate) fn router_bias(&self) -> String {
        format!("{}router.bias", self.prefix)
    }

    /// The stacked experts' biases: of the first matrix `[E, 2H]` (laid out as its columns)
    /// and of the second `[E, M]` (GPT-OSS).
    pub(crate) fn stacked_biases(&self) -> (String, String) {
        (
            format!("{}experts.gate_up_proj_bias", self.prefix),
            format!("{}experts.down_proj_bias", self.prefix),
        )
    }

    /// Whether the stacked first matrix interleaves gate and up columns.
    pub(crate) fn interleaved(&self) -> bool {
        self.family.interleaved_gate_up()
    }

    /// The stacked experts' first matrix `[E, M, 2H]`, gate half first, applied as `x · W`
    /// (families with [`Family::stacked_experts`]).
    pub(crate) fn stacked_gate_up(&self) -> String {
        format!("{}experts.gate_up_proj", self.prefix)
    }

    /// The stacked experts' second matrix `[E, H, M]`, applied as `h · W`.
    pub(crate) fn stacked_down(&self) -> String {
        format!("{}experts.down_proj", self.prefix)
    }

    /// Whether the experts are stacked (see [`Family::stacked_experts`]).
    pub(crate) fn stacked(&self) -> bool {
        self.family.stacked_experts()
    }

    /// DeepSeek's score-correction bias `[E]`.
    pub(crate) fn score_bias(&self) -> String {
        format!("{}gate.e_score_correction_bias", self.prefix)
    }

    /// Expert `e`'s projection `part`.
    pub(crate) fn expert(&self, e: usize, part: Part) -> String {
        let name = match (self.family, part) {
            (Family::Mixtral, Part::Gate) => "w1",
            (Family::Mixtral, Part::Up) => "w3",
            (Family::Mixtral, Part::Down) => "w2",
            (_, Part::Gate) => "gate_proj",
            (_, Part::Up) => "up_proj",
            (_, Part::Down) => "down_proj",
        };
        format!("{}experts.{e}.{name}.weight", self.prefix)
    }

    /// The shared expert's projection `part`.
    pub(crate) fn shared(&self, part: Part) -> String {
        let block = match self.family {
            Family::DeepseekV3 => "shared_experts",
            _ => "shared_expert",
        };
        let name = match part {
            Part::Gate => "gate_proj",
            Part::Up => "up_proj",
            Part::Down => "down_proj",
        };
        format!("{}{block}.{name}.weight", self.prefix)
    }

    /// The shared expert's sigmoid gate `[1, M]` (Qwen2-MoE).
    pub(crate) fn shared_gate(&self) -> String {
        format!("{}shared_expert_gate.weight", self.prefix)
    }
}
