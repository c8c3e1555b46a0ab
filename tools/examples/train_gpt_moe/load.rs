//! Expert load over a training run: the imbalance summary and the heatmap.

use std::path::Path;

use mpipemoe_tools::report::{write_heatmaps, Heatmap};

/// Max over mean of one layer's per-expert load (1 when balanced or empty).
fn imbalance(load: &[usize]) -> f64 {
    let total: usize = load.iter().sum();
    if total == 0 {
        return 1.0;
    }
    *load.iter().max().unwrap_or(&0) as f64 * load.len() as f64 / total as f64
}

/// The load imbalance averaged over the layers and the first and last tenth of the steps.
pub fn imbalance_first_and_last(load: &[Vec<Vec<usize>>]) -> (f64, f64) {
    let tenth = (load.len() / 10).max(1).min(load.len());
    let mean = |steps: &[Vec<Vec<usize>>]| {
        let values: Vec<f64> = steps.iter().flatten().map(|l| imbalance(l)).collect();
        values.iter().sum::<f64>() / values.len().max(1) as f64
    };
    (mean(&load[..tenth]), mean(&load[load.len() - tenth..]))
}

/// Each expert's share of the assignments over the first tenth of the steps, summed over the
/// layers: the toy's measured routing, in the form the skew benchmark takes
/// (`MPIPEMOE_SKEW_MEASURED=weights:...`).
pub fn early_routing(load: &[Vec<Vec<usize>>]) -> Vec<f64> {
    let tenth = (load.len() / 10).max(1).min(load.len());
    let n_experts = load.first().and_then(|s| s.first()).map_or(0, Vec::len);
    let mut sums = vec![0usize; n_experts];
    for layer in load[..tenth].iter().flatten() {
        sums.iter_mut().zip(layer).for_each(|(s, l)| *s += l);
    }
    let total = sums.iter().sum::<usize>().max(1) as f64;
    sums.iter().map(|&s| s as f64 / total).collect()
}

/// One heatmap per MoE layer: each expert's share of the assignments over the steps, relative
/// to the balanced share (white = balanced, red = overloaded, blue = underloaded). Steps are
/// averaged into at most 200 columns.
pub fn write_heatmap(path: &Path, load: &[Vec<Vec<usize>>]) -> mpipemoe::Result<()> {
    let Some(first) = load.first() else {
        return Ok(());
    };
    let per_column = load.len().div_ceil(200).max(1);
    let maps = (0..first.len())
        .map(|layer| {
            let n_experts = first[layer].len();
            let mut values = vec![Vec::new(); n_experts];
            for chunk in load.chunks(per_column) {
                let mut sums = vec![0usize; n_experts];
                for step in chunk {
                    sums.iter_mut().zip(&step[layer]).for_each(|(s, l)| *s += l);
                }
                let total = sums.iter().sum::<usize>().max(1) as f64;
                for (e, &s) in sums.iter().enumerate() {
                    values[e].push(s as f64 * n_experts as f64 / total);
                }
            }
            Heatmap {
                title: format!("MoE layer {layer}: load / balanced load per expert"),
                x_label: "step".into(),
                y_label: "expert".into(),
                values,
                x_start: 0.0,
                x_step: per_column as f64,
                center: 1.0,
            }
        })
        .collect::<Vec<_>>();
    write_heatmaps(
        path,
        "Expert load over training (white = balanced, red = over, blue = under)",
        &maps,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn imbalance_is_max_over_mean() {
        assert_eq!(imbalance(&[2, 2, 2, 2]), 1.0);
        assert_eq!(imbalance(&[8, 0, 0, 0]), 4.0);
        assert_eq!(imbalance(&[]), 1.0);
    }
}
