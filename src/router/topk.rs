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
    let n_rows = values.len() / n_cols;
    let mut out = vec![0usize; n_rows * k];
    if k == 0 {
        return out;
    }
    let rows = |values: &[f32], out: &mut [usize]| {
        let mut chooser = RowChooser::new(k, n_group, topk_group);
        for (row, chosen) in values.chunks_exact(n_cols).zip(out.chunks_exact_mut(k)) {
            chooser.choose(row, chosen);
        }
    };
    // The rows are independent. A large batch of many experts (DeepSeek-V3's 256 at 4,096
    // tokens is a million values) is split over the cores, in blocks large enough that a
    // task's work outweighs handing it to a thread; a small one stays on the calling thread.
    const PER_TASK: usize = 1 << 15;
    let rows_per_task = PER_TASK.div_ceil(n_cols);
    if n_rows >= 2 * rows_per_task {
        use rayon::prelude::*;
        values
            .par_chunks(rows_per_task * n_cols)
            .zip(out.par_chunks_mut(rows_per_task * k))
            .for_each(|(values, out)| rows(values, out));
    } else {
        rows(values, &mut out);
    }
    out
}

/// [`group_limited_top_k`] by its definition: for each row, the best groups by their top-two
/// sums, then `k` scans for the largest remaining allowed value, the lower index on a tie (the
/// implementation before the one-pass choice, its buffers reused from row to row). The twin
/// the tests and the `routing` benchmark compare the choice with, and the choice for a row
/// with a NaN.
///
/// # Panics
/// As [`group_limited_top_k`].
pub fn group_limited_top_k_reference(
    values: &[f32],
    n_cols: usize,
    k: usize,
    n_group: usize,
    topk_group: usize,
) -> Vec<usize> {
    let per_group = n_cols / n_group;
    let limited = topk_group < n_group;
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
            for g in best_indices(&group_scores, topk_group, |_| true) {
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

/// One row's choice at a time, in one pass over the row where it holds no NaN, with the
/// buffers of one row kept for the next.
///
/// The host makes this choice between the routing read and the plan, while a GPU waits for
/// the next launch. The definition ([`group_limited_top_k_reference`]) scans a row once per
/// chosen expert, so its cost grows with `k · n_experts` a token: milliseconds a step for
/// the fine-grained routers at a few thousand tokens (the `routing` benchmark).
struct RowChooser {
    k: usize,
    n_group: usize,
    topk_group: usize,
    /// The row's best experts, as (value, column), best first.
    best: Vec<(f32, usize)>,
    /// The groups' scores (the sums of their two largest values), by group.
    groups: Vec<f32>,
    /// The row's best groups, as (score, group).
    kept: Vec<(f32, usize)>,
}

impl RowChooser {
    fn new(k: usize, n_group: usize, topk_group: usize) -> Self {
        Self {
            k,
            n_group,
            topk_group,
            best: vec![(0.0, 0); k],
            groups: Vec::with_capacity(n_group),
            kept: vec![(0.0, 0); topk_group],
        }
    }

    /// Writes `row`'s `k` chosen columns into `chosen`, best first.
    fn choose(&mut self, row: &[f32], chosen: &mut [usize]) {
        // A NaN compares false both ways, so a one-pass choice could order it differently
        // from the definition's repeated scans; such a row (which the layer's finite check
        // refuses where it is on) takes the definition. A group of an infinity of each sign
        // sums to NaN, so its scores are checked too.
        let per_group = row.len() / self.n_group;
        let limited = self.topk_group < self.n_group;
        // Folded without an early exit, so that the test vectorises.
        let mut finite_order = !row.iter().fold(false, |nan, v| nan | v.is_nan());
        if finite_order && limited {
            self.groups.clear();
            self.groups.extend(row.chunks_exact(per_group).map(top_two_sum));
            finite_order = !self.groups.iter().any(|v| v.is_nan());
        }
        if !finite_order {
            let reference =
                group_limited_top_k_reference(row, row.len(), self.k, self.n_group, self.topk_group);
            chosen.copy_from_slice(&reference);
            return;
        }
        let len = match limited {
            true => {
                largest(self.groups.iter().copied().zip(0..), &mut self.kept);
                // The kept groups' columns in increasing order, so that a tie still goes to
                // the lower column.
                self.kept.sort_unstable_by_key(|&(_, g)| g);
                let columns = self.kept.iter().flat_map(|&(_, g)| {
                    let start = g * per_group;
                    (start..start + per_group).map(move |c| (row[c], c))
                });
                largest(columns, &mut self.best)
            }
            // The goal shapes' routers (top-1 and top-2 of a few experts) take passes that
            // vectorise, without the mispredicted branch a new best costs the general scan.
            false if self.k <= 2 => {
                match self.k {
                    1 => chosen[0] = argmax(row),
                    _ => chosen.copy_from_slice(&top_two(row)),
                }
                return;
            }
            false => largest(row.iter().copied().zip(0..), &mut self.best),
        };
        assert_eq!(len, self.k, "enough experts are allowed");
        for (c, &(_, col)) in chosen.iter_mut().zip(&self.best) {
            *c = col;
        }
    }
}

/// The `best.len()` largest of `values`, (value, index) pairs without NaN in increasing
/// index, into `best` by value, descending, the lower index first among equal values: what
/// repeated scans for the largest remaining value choose. Returns how many were filled (fewer
/// than `best.len()` only where `values` has fewer).
///
/// A new pair has the largest index so far, so it goes after every kept value it does not
/// exceed, and a full list takes it only where it beats the last kept value: after the
/// first few values of a row, one comparison a value.
fn largest(values: impl Iterator<Item = (f32, usize)>, best: &mut [(f32, usize)]) -> usize {
    let k = best.len();
    let mut len = 0;
    for (v, c) in values {
        if len == k && v <= best[k - 1].0 {
            continue;
        }
        let mut at = if len == k { k - 1 } else { len };
        while at > 0 && v > best[at - 1].0 {
            best[at] = best[at - 1];
            at -= 1;
        }
        best[at] = (v, c);
        len = (len + 1).min(k);
    }
    len
}

/// The column of `row`'s largest value, the lower column among equal values: the maximum by
/// a fold, then the first column that holds it. `row` is not empty and has no NaN.
fn argmax(row: &[f32]) -> usize {
    let max = row.iter().fold(f32::NEG_INFINITY, |max, &v| max.max(v));
    row.iter()
        .position(|&v| v == max)
        .expect("a row without NaN holds its maximum")
}

/// The columns of `row`'s two largest values, best first, the lower column first among equal
/// values: one pass whose updates are selects rather than branches. `row` has at least two
/// values and no NaN.
fn top_two(row: &[f32]) -> [usize; 2] {
    let (mut first, mut second) = match row[1] > row[0] {
        true => ((row[1], 1), (row[0], 0)),
        false => ((row[0], 0), (row[1], 1)),
    };
    for (c, &v) in row.iter().enumerate().skip(2) {
        // A value equal to a kept one ranks after it: it came later.
        let (beats_first, beats_second) = (v > first.0, v > second.0);
        second = if beats_first {
            first
        } else if beats_second {
            (v, c)
        } else {
            second
        };
        first = if beats_first { (v, c) } else { first };
    }
    [first.1, second.1]
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

/// Whether every value is finite: the finite check on the values the choice reads. A fold
/// without an early exit vectorises where `Iterator::all` cannot, so blocks of 256 values
/// are folded whole and the scan stops at the first block with a value that is not.
pub fn all_finite(values: &[f32]) -> bool {
    values
        .chunks(256)
        .all(|block| block.iter().fold(true, |finite, v| finite & v.is_finite()))
}

/// Router values with many ties: drawn from a few levels, a signed zero and two subnormals
/// among them, so that many rows hold equal values at their top and the tie rule decides;
/// `seed` varies them. What the device's choice is held to the host's on
/// (`harness::kernel_checks`, `router/cubecl_tests.rs`).
#[cfg(any(test, feature = "testkit"))]
pub(crate) fn tied_values(n_values: usize, seed: u64) -> Vec<f32> {
    const LEVELS: [f32; 8] = [-1.5, -0.0, 0.0, 0.25, 0.25, 1.0, 1e-40, 2e-40];
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n_values)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            LEVELS[(state >> 32) as usize % LEVELS.len()]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_that_is_not_finite_is_found_in_any_block() {
        assert!(all_finite(&[]));
        let mut values = vec![1.5f32; 1000];
        assert!(all_finite(&values));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 255, 256, 999] {
                values[at] = bad;
                assert!(!all_finite(&values), "{bad} at {at}");
                values[at] = -0.0;
            }
        }
    }

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

    proptest::proptest! {
        /// The one-pass choice against its twin, row by row: the same experts in the same
        /// order for any values, groups and `k`. The values come from a small set (ties in
        /// most rows, both zeros, both infinities, and NaN in some rows, which take the twin),
        /// so a one-pass choice that broke a tie toward the higher index, dropped an equal
        /// value, kept a disallowed expert or mishandled -inf chooses differently here.
        #[test]
        fn the_one_pass_choice_is_the_reference_choice(
            n_group in 1usize..5,
            per_group in 1usize..6,
            group_cut in 0usize..4,
            k_seed in 0usize..64,
            picks in proptest::collection::vec(0usize..9, 1..240),
        ) {
            const VALUES: [f32; 9] =
                [-1.5, 0.0, -0.0, 0.25, 0.25, 2.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
            let n_cols = n_group * per_group;
            let topk_group = n_group - group_cut.min(n_group - 1);
            let allowed = match topk_group < n_group {
                true => topk_group * per_group,
                false => n_cols,
            };
            let k = k_seed % (allowed + 1);
            let rows = picks.len().div_ceil(n_cols);
            let values: Vec<f32> = (0..rows * n_cols)
                .map(|i| match VALUES[picks[i % picks.len()]] {
                    // NaN in every third row only: the others take the one-pass choice.
                    v if v.is_nan() && (i / n_cols) % 3 != 0 => 1.0,
                    v => v,
                })
                .collect();
            let chosen = group_limited_top_k(&values, n_cols, k, n_group, topk_group);
            let twin = group_limited_top_k_reference(&values, n_cols, k, n_group, topk_group);
            proptest::prop_assert_eq!(chosen, twin);
        }
    }

    /// A batch large enough to be split over threads chooses what the definition chooses,
    /// row by row, with blocks of rows that do not divide the batch: a block written to the
    /// wrong rows of the output, or a last block left out, fails here. (The property test
    /// above stays under the split's size.)
    #[test]
    fn a_batch_split_over_threads_is_the_reference_choice() {
        let (n_rows, n_cols) = (5_003, 16);
        let mut state = 7u64;
        let values: Vec<f32> = (0..n_rows * n_cols)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                // 64 levels: ties in most rows.
                (state >> 58) as f32 / 8.0 - 4.0
            })
            .collect();
        for (k, n_group, topk_group) in [(1, 1, 1), (3, 1, 1), (4, 4, 2)] {
            assert_eq!(
                group_limited_top_k(&values, n_cols, k, n_group, topk_group),
                group_limited_top_k_reference(&values, n_cols, k, n_group, topk_group),
                "k {k}, {topk_group} of {n_group} groups"
            );
        }
    }

    #[test]
    fn group_ties_go_to_the_lower_group() {
        let v = [0.5, 0.5, 0.5, 0.5];
        assert_eq!(group_limited_top_k(&v, 4, 2, 2, 1), vec![0, 1]);
    }
}
