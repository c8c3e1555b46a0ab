//! Expert capacity: which assignments an expert takes, globally in token order.

/// The per-expert limit for a global batch: `floor(factor · n_tokens · top_k / n_experts)`.
pub fn capacity_for(factor: f64, n_tokens_global: usize, top_k: usize, n_experts: usize) -> usize {
    (factor * n_tokens_global as f64 * top_k as f64 / n_experts as f64).floor() as usize
}

/// Which of this rank's assignments survive the capacity limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapacityDecision {
    /// `kept[t * top_k + j]`: whether token `t`'s `j`-th choice is kept.
    pub kept: Vec<bool>,
    /// Kept assignments per expert from this rank. `[n_experts]`
    pub kept_per_expert: Vec<usize>,
}

impl CapacityDecision {
    /// Applies `capacity` to this rank's assignments `indices` (`[n_tokens * top_k]`, best
    /// first within a token).
    ///
    /// Assignments are visited token by token and, within a token, best choice first; expert
    /// `e` takes the first `capacity` it sees over the global batch. `before[e]` is how many
    /// assignments to `e` the ranks before this one made (their tokens come first in the
    /// global order), which is all a rank needs to know to make the global decision locally.
    pub fn decide(indices: &[usize], n_experts: usize, capacity: Option<usize>, before: &[usize]) -> Self {
        let mut seen = before.to_vec();
        let mut kept_per_expert = vec![0; n_experts];
        let kept = indices
            .iter()
            .map(|&e| {
                let ordinal = seen[e];
                seen[e] += 1;
                let keep = capacity.is_none_or(|c| ordinal < c);
                kept_per_expert[e] += keep as usize;
                keep
            })
            .collect();
        Self {
            kept,
            kept_per_expert,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_global_in_token_order() {
        // Expert 0 chosen by tokens 0, 1, 2 on this rank; one assignment came before.
        let d = CapacityDecision::decide(&[0, 1, 0, 0], 2, Some(2), &[1, 0]);
        assert_eq!(d.kept, vec![true, true, false, false]);
        assert_eq!(d.kept_per_expert, vec![1, 1]);
        let all = CapacityDecision::decide(&[0, 1, 0, 0], 2, None, &[5, 5]);
        assert!(all.kept.iter().all(|&k| k));
        assert_eq!(capacity_for(1.25, 64, 1, 4), 20);
    }
}
