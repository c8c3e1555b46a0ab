//! Listing the MoE layers of a Hugging Face checkpoint.

use std::path::Path;

use serde::Serialize;

use super::family::{Family, HfConfig};
use crate::error::Result;

/// One MoE layer as `mpipemoe inspect` lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerSummary {
    /// The layer's index in the model.
    pub layer: usize,
    /// The architecture.
    pub family: Family,
    /// Experts.
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Token width `M`.
    pub d_model: usize,
    /// Expert hidden width `H`.
    pub d_hidden: usize,
    /// Shared expert width, if any.
    pub d_shared: Option<usize>,
    /// Router scoring (`softmax`, `sigmoid`).
    pub scoring: &'static str,
    /// Parameters of the layer (router, score bias, experts, shared expert).
    pub parameters: usize,
}

/// The MoE layers of the checkpoint in `dir`, from its `config.json` (no tensor is read).
///
/// # Errors
/// [`MoeError::File`](crate::MoeError::File) naming `config.json` if it cannot be read, or
/// its family is not supported.
pub fn inspect(dir: impl AsRef<Path>) -> Result<Vec<LayerSummary>> {
    let hf = HfConfig::read(dir.as_ref())?;
    hf.moe_layers()?
        .into_iter()
        .map(|layer| {
            let c = hf.layer_config(layer)?;
            let (e, m, h) = (c.n_experts, c.d_model, c.d_hidden);
            let shared = c
                .shared_expert
                .map_or(0, |hs| 3 * hs * m + if c.shared_expert_gate { m } else { 0 });
            Ok(LayerSummary {
                layer,
                family: hf.family,
                n_experts: e,
                top_k: c.top_k,
                d_model: m,
                d_hidden: h,
                d_shared: c.shared_expert,
                scoring: c.scoring.name(),
                parameters: e * m + if c.score_bias { e } else { 0 } + e * 3 * h * m + shared,
            })
        })
        .collect()
}
