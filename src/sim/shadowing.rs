//! What shadowing hot experts would save on a cluster: the shadowing rule's step model
//! ([`shadowed_step_time`]) on expected counts from an expert popularity, for clusters far
//! larger than this machine (issue 45).

use crate::error::{MoeError, Result};
use crate::memory::LayerShape;
use crate::tuning::{choose_shadows, shadowed_step_time, Profile, ShadowCosts};

/// The predicted step of one layer with and without shadowing.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ShadowingPrediction {
    /// Modelled step time without shadows, seconds.
    pub off_seconds: f64,
    /// With the shadows `Auto` picks when each shadow is sent once per link (NCCL's ring
    /// broadcast and all-reduce: the layer's path on CUDA with NCCL), seconds.
    pub ring_seconds: f64,
    /// The experts shadowed in `ring_seconds`.
    pub ring_shadows: Vec<usize>,
    /// With the shadows `Auto` picks under the host path of the broadcast (the owner sends
    /// each shadow to every other rank, `ShadowCosts::with_host_broadcast`), seconds.
    pub host_seconds: f64,
    /// The experts shadowed in `host_seconds`.
    pub host_shadows: Vec<usize>,
}

impl ShadowingPrediction {
    /// `off_seconds / ring_seconds`.
    pub fn ring_speedup(&self) -> f64 {
        self.off_seconds / self.ring_seconds
    }

    /// `off_seconds / host_seconds`.
    pub fn host_speedup(&self) -> f64 {
        self.off_seconds / self.host_seconds
    }
}

/// Every rank routes `shape.tokens · top_k` rows, a share `popularity[e]` of them (normalised)
/// to expert `e`; experts are owned in blocks of `n_experts / n_ranks`. The step model is the
/// slowest rank's compute or exchange plus the shadows' traffic (`docs/design-notes.md`,
/// "Shadowing hot experts"), not the stream simulator's timeline.
///
/// # Errors
/// [`MoeError::Config`] if `popularity` does not have one finite weight `>= 0` per expert with
/// a positive sum, or the experts do not split over the ranks.
pub fn predict_shadowing(
    shape: &LayerShape,
    profile: &Profile,
    popularity: &[f64],
    elem_bytes: usize,
) -> Result<ShadowingPrediction> {
    let (n_experts, n_ranks) = (shape.n_experts, shape.n_ranks);
    if popularity.len() != n_experts {
        return Err(MoeError::config(
            "popularity",
            format!("has {} weights for {n_experts} experts", popularity.len()),
        ));
    }
    let total: f64 = popularity.iter().sum();
    if popularity.iter().any(|p| !p.is_finite() || *p < 0.0) || !(total > 0.0 && total.is_finite()) {
        return Err(MoeError::config(
            "popularity",
            "needs finite weights >= 0 with a positive sum",
        ));
    }
    if n_ranks == 0 || !n_experts.is_multiple_of(n_ranks) {
        return Err(MoeError::config(
            "n_experts",
            format!("{n_experts} experts cannot be split evenly over {n_ranks} ranks"),
        ));
    }
    let rows = (shape.tokens * shape.top_k) as f64;
    let per_rank: Vec<usize> = popularity
        .iter()
        .map(|p| (rows * p / total).round() as usize)
        .collect();
    let counts = vec![per_rank; n_ranks];
    let n_local = n_experts / n_ranks;
    let owner: Vec<usize> = (0..n_experts).map(|e| e / n_local).collect();
    let gemms = (shape.d_inner() + shape.d_hidden) / shape.d_hidden;
    let ring = ShadowCosts::from_profile(profile, shape.d_model, shape.d_hidden, gemms, elem_bytes);
    let host = ring.with_host_broadcast(n_ranks);
    let limit = n_experts.saturating_sub(1);
    let time = |shadows: &[usize], costs: &ShadowCosts| {
        let mut flags = vec![false; n_experts];
        shadows.iter().for_each(|&e| flags[e] = true);
        shadowed_step_time(&counts, &owner, &flags, costs)
    };
    let ring_shadows = choose_shadows(&counts, &owner, &ring, limit);
    let host_shadows = choose_shadows(&counts, &owner, &host, limit);
    Ok(ShadowingPrediction {
        off_seconds: time(&[], &ring),
        ring_seconds: time(&ring_shadows, &ring),
        host_seconds: time(&host_shadows, &host),
        ring_shadows,
        host_shadows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::experts::Activation;

    fn shape(n_ranks: usize) -> LayerShape {
        LayerShape {
            tokens: 4096,
            top_k: 1,
            d_model: 1024,
            d_hidden: 4096,
            activation: Activation::Gelu,
            shared_expert: None,
            shared_expert_gate: false,
            shared_expert_overlap: false,
            weights_on_input: false,
            n_experts: n_ranks,
            n_ranks,
            n_partitions: 1,
        }
    }

    #[test]
    fn balanced_routing_gains_nothing_and_one_hot_expert_gains_up_to_the_rank_count() {
        let profile = Profile::a100_cluster(16);
        let balanced = predict_shadowing(&shape(16), &profile, &[1.0; 16], 4).unwrap();
        assert!(balanced.ring_shadows.is_empty() && balanced.host_shadows.is_empty());
        assert_eq!(balanced.ring_speedup(), 1.0);
        let mut one = vec![0.0; 16];
        one[3] = 1.0;
        let hot = predict_shadowing(&shape(16), &profile, &one, 4).unwrap();
        assert_eq!(hot.ring_shadows, vec![3]);
        // Sixteen ranks' rows on one expert: compute-bound on its owner; shadowed, each rank
        // computes its own sixteenth, so the gain is below 16 by the shadow's traffic.
        assert!(hot.ring_speedup() > 4.0 && hot.ring_speedup() < 16.0, "{hot:?}");
        // This crate's transport sends 15 times the bytes: it gains less, never more.
        assert!(hot.host_speedup() <= hot.ring_speedup());
    }

    #[test]
    fn a_popularity_of_the_wrong_length_or_sign_is_refused() {
        let profile = Profile::a100_cluster(16);
        assert!(predict_shadowing(&shape(16), &profile, &[1.0; 15], 4).is_err());
        let mut bad = vec![1.0; 16];
        bad[0] = -1.0;
        assert!(predict_shadowing(&shape(16), &profile, &bad, 4).is_err());
        assert!(predict_shadowing(&shape(16), &profile, &[0.0; 16], 4).is_err());
    }
}
