//! Expert selection on the host: plain and group-limited top-k.

/// Group-limited top-k (DeepSeek-V3): the `n_cols` experts of a row form `n_group` contiguous
/// groups; a group's score is the sum of its two largest values (its only value, for groups of
/// one); the `topk_group` best groups are kept, and the row's `k` largest values among the
/// kept experts are chosen, best first. With `n_group = 1` this is plain top-k. Ties go to the
/// lower index, for groups and experts alike.
///
/// # Panics
/// If `n_group` does not divide `n_cols`, `topk_group` is not in `1..=n_group`, or the kept
/// groups hold fewer than `k` experts (the layer's config validation rules all three out).
pub fn group_limited_top_k(
    values: &[f32],
    n_cols: usize,
    k: usize,
    n_group: usize,
    topk_group: usize,
) -> Vec<usize> {
    assert!(n_cols > 0 && values.len().is_multiple_of(n_cols));
    assert!(
        n_group >= 1 && n_cols.is_multiple_of(n_group),
        "{n_group} groups of {n_cols} experts"
    );
    assert!((1..=n_group).contains(&topk_group));
    let per_group = n_cols / n_group;
    let limited = topk_group < n_group;
    assert!(
        k <= if limited { topk_group * per_group } else { n_cols },
        "top_k {k} too large"
    );
    let mut out = Vec::with_capacity(values.len() / n_cols * k);
    let mut allowed = vec![true; n_cols];
    let mut picked = vec![false; n_cols];
    let mut group_scores = vec![0f32; n_group];
    for row in values.chunks_exact(n_cols) {
        if limited {
            for (g, score) in group_scores.iter_mut().enumerate() {
                *score = top_two_sum(&row[g * per_group..(g + 1) * per_group]);
            }
            allowed.iter_mut().for_each(|a| *a = false);
            let best_groups = best_indices(&group_scores, topk_group, |_| true);
            for g in best_groups {
                allowed[g * per_group..(g + 1) * per_group]
                    .iter_mut()
                    .for_each(|a| *a = true);
            }
        }
        picked.iter_mut().for_each(|p| *p = false);
        for _ in 0..k {
            let best = best_index(row, |c| allowed[c] && !picked[c]).expect("enough experts are allowed");
            picked[best] = true;
            out.push(best);
        }
    }
    out
}

/// The sum of the two largest values (the only value of a one-element slice).
fn top_two_sum(values: &[f32]) -> f32 {
    let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in values {
        if v > first {
            second = first;
            first = v;
        } else if v > second {
            second = v;
        }
    }
    if values.len() == 1 {
        first
    } else {
        first + second
    }
}

/// The index of the largest value among those `eligible`, the lowest index on a tie.
fn best_index(values: &[f32], eligible: impl Fn(usize) -> bool) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (c, &v) in values.iter().enumerate() {
        if eligible(c) && best.is_none_or(|b| v > values[b]) {
            best = Some(c);
        }
    }
    best
}

/// The indices of the `count` largest values, best first.
fn best_indices(values: &[f32], count: usize, eligible: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut taken = vec![false; values.len()];
    (0..count)
        .filter_map(|_| {
            let best = best_index(values, |c| eligible(c) && !taken[c])?;
            taken[best] = true;
            Some(best)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_largest_best_first_and_breaks_ties_by_index() {
        let v = [0.1, 0.5, 0.5, 0.2, /* row 2 */ 3.0, -1.0, 2.0, 2.5];
        assert_eq!(group_limited_top_k(&v, 4, 2, 1, 1), vec![1, 2, 0, 3]);
        assert_eq!(group_limited_top_k(&v, 4, 1, 1, 1), vec![1, 0]);
    }

    #[test]
    fn group_limit_excludes_experts_outside_the_best_groups() {
        // Four groups of two. Group sums: [0.9+0.1, 0.8+0.7, 0.95+0.0, 0.6+0.5] = [1.0, 1.5,
        // 0.95, 1.1]: the two best groups are 1 and 3, so expert 4 (0.95, the row's largest)
        // and expert 0 (0.9) are excluded.
        let v = [0.9, 0.1, 0.8, 0.7, 0.95, 0.0, 0.6, 0.5];
        assert_eq!(group_limited_top_k(&v, 8, 2, 4, 2), vec![2, 3]);
        assert_eq!(group_limited_top_k(&v, 8, 3, 4, 2), vec![2, 3, 6]);
        // Without the limit, the plain top-3.
        assert_eq!(group_limited_top_k(&v, 8, 3, 4, 4), vec![4, 0, 2]);
        assert_eq!(group_limited_top_k(&v, 8, 3, 1, 1), vec![4, 0, 2]);
    }

    #[test]
    fn group_ties_go_to_the_lower_group() {
        let v = [0.5, 0.5, 0.5, 0.5];
        assert_eq!(group_limited_top_k(&v, 4, 2, 2, 1), vec![0, 1]);
    }
}
