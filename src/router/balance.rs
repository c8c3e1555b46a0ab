//! DeepSeek-V3's auxiliary-loss-free load balancing.

/// The change of each expert's score bias after one step: `gamma · sign(mean_load − load[e])`,
/// with `load` the assignments each expert received over the global batch. Overloaded experts
/// are pushed down, underloaded ones up; an expert exactly at the mean stays put.
///
/// Every rank has the same global load after the counts exchange, so every rank computes the
/// same change and the replicated biases stay identical.
pub(crate) fn score_bias_step(load: &[usize], gamma: f64) -> Vec<f64> {
    if load.is_empty() {
        return Vec::new();
    }
    let mean = load.iter().sum::<usize>() as f64 / load.len() as f64;
    load.iter()
        .map(|&l| {
            let diff = mean - l as f64;
            if diff > 0.0 {
                gamma
            } else if diff < 0.0 {
                -gamma
            } else {
                0.0
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overloaded_experts_go_down_and_underloaded_up() {
        // Mean 4: expert 0 is over, 1 at, 2 and 3 under.
        assert_eq!(score_bias_step(&[10, 4, 1, 1], 0.5), vec![-0.5, 0.0, 0.5, 0.5]);
        assert!(score_bias_step(&[], 1.0).is_empty());
    }
}
