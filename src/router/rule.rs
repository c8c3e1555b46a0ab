//! How a router turns logits into choices and combine weights.

use serde::{Deserialize, Serialize};

/// How the router scores experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Scoring {
    /// Softmax over all experts (Switch, Mixtral, Qwen, OLMoE).
    #[default]
    Softmax,
    /// An independent sigmoid per expert (DeepSeek-V3).
    Sigmoid,
}

impl Scoring {
    /// `softmax` or `sigmoid`, as in case files and Hugging Face configs.
    pub fn name(self) -> &'static str {
        match self {
            Scoring::Softmax => "softmax",
            Scoring::Sigmoid => "sigmoid",
        }
    }

    /// Parses `softmax` or `sigmoid`.
    pub fn parse(name: &str) -> Option<Self> {
        [Scoring::Softmax, Scoring::Sigmoid]
            .into_iter()
            .find(|s| s.name().eq_ignore_ascii_case(name))
    }
}

/// Everything the router needs to know to route one batch, taken from the layer's config.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoutingRule {
    /// Experts per token.
    pub top_k: usize,
    /// Softmax or sigmoid scores.
    pub scoring: Scoring,
    /// Divide each token's `top_k` weights by their sum.
    pub normalize: bool,
    /// Contiguous groups of experts (1: no group limit).
    pub n_group: usize,
    /// Groups a token may choose experts from.
    pub topk_group: usize,
    /// Factor on every combine weight, after normalisation.
    pub scaling: f64,
}

impl RoutingRule {
    /// Plain top-k of a softmax router.
    pub fn top_k(top_k: usize, normalize: bool) -> Self {
        Self {
            top_k,
            scoring: Scoring::Softmax,
            normalize,
            n_group: 1,
            topk_group: 1,
            scaling: 1.0,
        }
    }

    /// Whether experts outside a token's best groups are excluded.
    pub fn group_limited(&self) -> bool {
        self.n_group > 1 && self.topk_group < self.n_group
    }
}
