//! The host's work between the router's choice and the first launch of the exchange, at one
//! rank, as the layer does it: the counts and capacity (`RoutingCounts::gather`), the plans
//! for `n` partitions, and the two maps steps 4 and 6 move rows by. On a GPU the device waits
//! for this after the routing read, so the routing bench times it beside the choice.

use crate::comm::SingleRank;
use crate::dispatch::{RoutingCounts, SplitScheme};
use crate::error::Result;

/// The routers BENCHMARKS §15 times the choice for, as (label, `n_experts`, `top_k`,
/// `n_group`, `topk_group`): the goal shapes' 8 experts at top-1 and top-2, and the
/// fine-grained ones up to DeepSeek-V3's 256 in groups. The CPU routing bench and the GPU
/// bench's choice rows both run these.
pub const BENCH_ROUTERS: [(&str, usize, usize, usize, usize); 6] = [
    ("8e-top1", 8, 1, 1, 1),
    ("8e-top2", 8, 2, 1, 1),
    ("32e-top4", 32, 4, 1, 1),
    ("64e-top6", 64, 6, 1, 1),
    ("128e-top8", 128, 8, 1, 1),
    ("256e-top8-g4of8", 256, 8, 8, 4),
];

/// Plans one rank's batch from its choices and builds its row maps; returns the rows of `T_I`.
///
/// # Shapes
/// - `indices`: `[n_tokens * top_k]`, each below `n_experts`, best first within a token
///
/// # Errors
/// [`MoeError::Config`](crate::MoeError::Config) if `n_experts` or `n_partitions` is 0.
///
/// # Panics
/// If `top_k` is 0 or an index is `n_experts` or more (the router never makes such a choice).
pub fn plan_on_host(
    indices: &[usize],
    n_tokens: usize,
    top_k: usize,
    n_experts: usize,
    capacity_factor: Option<f64>,
    n_partitions: usize,
) -> Result<usize> {
    if n_experts == 0 || n_partitions == 0 {
        return Err(crate::MoeError::config(
            if n_experts == 0 {
                "n_experts"
            } else {
                "n_partitions"
            },
            "must be at least 1",
        ));
    }
    let counts = RoutingCounts::gather(
        indices,
        n_tokens,
        top_k,
        n_experts,
        capacity_factor,
        &SingleRank,
        &SingleRank,
    )?;
    let (dispatch, exchange) = counts.plans(SplitScheme::Tokens(n_partitions));
    let combine = dispatch.combine_map(dispatch.token_map());
    debug_assert_eq!(combine.n_rows(), exchange.send_rows());
    Ok(combine.n_rows())
}
