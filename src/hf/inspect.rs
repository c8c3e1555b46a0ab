//! Listing the MoE layers of a Hugging Face checkpoint.

use std::path::Path;

use serde::Serialize;

use super::family::{Family, Part};
use super::model::HfCheckpoint;
use crate::error::{MoeError, Result};

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

/// The MoE layers of the checkpoint in `dir`, from its `config.json`, each checked against
/// the shapes in the safetensors headers (the router, the first expert, the shared expert); no
/// tensor data is read.
///
/// # Errors
/// [`MoeError::File`](crate::MoeError::File) naming `config.json` if it cannot be read, its
/// family is not supported, or a layer's shape disagrees with the stored tensors; naming the
/// index or shard if a tensor is missing.
pub fn inspect(dir: impl AsRef<Path>) -> Result<Vec<LayerSummary>> {
    let dir = dir.as_ref();
    let source = HfCheckpoint::open(dir)?;
    let (hf, ckpt) = (&source.config, &source.ckpt);
    hf.moe_layers()?
        .into_iter()
        .map(|layer| {
            let c = hf.layer_config(layer)?;
            let (e, m, h) = (c.n_experts, c.d_model, c.d_hidden);
            let names = hf.names(layer);
            let first_expert = match names.stacked() {
                true => (names.stacked_gate_up(), vec![e, m, 2 * h]),
                false => (names.expert(0, Part::Gate), vec![h, m]),
            };
            let mut expected = vec![(names.router(), vec![e, m]), first_expert];
            if let Some(hs) = c.shared_expert {
                expected.push((names.shared(Part::Gate), vec![hs, m]));
            }
            let wanted: Vec<String> = expected.iter().map(|(n, _)| n.clone()).collect();
            let stored = ckpt.header_shapes(&wanted)?;
            for (name, shape) in &expected {
                let (_, found) = &stored[name];
                if found != shape {
                    return Err(MoeError::file(
                        dir.join("config.json"),
                        format!("layer {layer}: config.json implies `{name}` {shape:?}, the checkpoint holds {found:?}"),
                    ));
                }
            }
            let overflow = || MoeError::file(dir.join("config.json"), format!("layer {layer}: the parameter count overflows"));
            let shared = match c.shared_expert {
                Some(hs) => mul(&[3, hs, m])
                    .and_then(|p| p.checked_add(if c.shared_expert_gate { m } else { 0 }))
                    .ok_or_else(overflow)?,
                None => 0,
            };
            let parameters = mul(&[e, m])
                .and_then(|p| p.checked_add(if c.score_bias { e } else { 0 }))
                .and_then(|p| p.checked_add(if c.router_bias { e } else { 0 }))
                .and_then(|p| p.checked_add(mul(&[e, 3, h, m])?))
                .and_then(|p| p.checked_add(if c.bias { mul(&[e, 2 * h + m])? } else { 0 }))
                .and_then(|p| p.checked_add(shared))
                .ok_or_else(overflow)?;
            Ok(LayerSummary {
                layer,
                family: hf.family,
                n_experts: e,
                top_k: c.top_k,
                d_model: m,
                d_hidden: h,
                d_shared: c.shared_expert,
                scoring: c.scoring.name(),
                parameters,
            })
        })
        .collect()
}

/// The product of `factors`, or `None` on overflow.
fn mul(factors: &[usize]) -> Option<usize> {
    factors.iter().try_fold(1usize, |acc, &f| acc.checked_mul(f))
}
