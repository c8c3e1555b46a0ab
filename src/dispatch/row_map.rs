//! Which row of a `[n_targets, width]` tensor each row of a row-ordered tensor is, and back:
//! the host index of step 4's permutation (tokens → rows of `T_I`, and the combine weights'
//! slots → rows) and of step 6's combine (rows → tokens).

/// Row `i` of a row-ordered tensor is row `target(i)` of a `[n_targets, width]` one. A target
/// may have any number of rows (a token has up to `top_k`, a dropped assignment none), so the
/// way back sums: target `t` receives the sum of its rows, in ascending row order, as burn's
/// `select_assign` adds them onto zeros.
///
/// The map also keeps the inverse as compressed rows (each target's rows, ascending), so a
/// device kernel can sum each target's rows in one thread per output element without atomics:
/// deterministic, and the same bits as the sequential sum.
///
/// # Shapes
/// - `targets`: `[n_rows]`, each below `n_targets`
/// - `offsets`: `[n_targets + 1]`, `order`: `[n_rows]`
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowMap {
    targets: Vec<usize>,
    n_targets: usize,
    offsets: Vec<usize>,
    order: Vec<usize>,
}

impl RowMap {
    /// The map of rows whose targets are `targets`, into a tensor of `n_targets` rows.
    ///
    /// # Panics
    /// If a target is `n_targets` or more (a contract violation: the plans that build maps
    /// index tokens and slots they counted).
    pub fn new(targets: Vec<usize>, n_targets: usize) -> Self {
        let mut offsets = vec![0usize; n_targets + 1];
        for &t in &targets {
            assert!(
                t < n_targets,
                "RowMap: target {t} of a tensor of {n_targets} rows"
            );
            offsets[t + 1] += 1;
        }
        for t in 0..n_targets {
            offsets[t + 1] += offsets[t];
        }
        let (order, _) = place_rows(&targets, &offsets);
        Self {
            targets,
            n_targets,
            offsets,
            order,
        }
    }

    /// The map of rows whose targets are distinct (a combine's slots: each has at most one
    /// row), the same as [`new`](Self::new) gives for them, in one pass over the rows and one
    /// over the targets instead of a counting sort.
    ///
    /// # Errors
    /// The first target, in row order, that a second row maps to.
    ///
    /// # Panics
    /// If a target is `n_targets` or more (a contract violation, as for [`new`](Self::new)).
    pub fn with_distinct_targets(targets: Vec<usize>, n_targets: usize) -> Result<Self, usize> {
        const NO_ROW: usize = usize::MAX;
        let mut row_of = vec![NO_ROW; n_targets];
        for (row, &t) in targets.iter().enumerate() {
            assert!(
                t < n_targets,
                "RowMap: target {t} of a tensor of {n_targets} rows"
            );
            if row_of[t] != NO_ROW {
                return Err(t);
            }
            row_of[t] = row;
        }
        // Every target has its row (a batch without drops): `row_of` is the order as it is and
        // each target's rows start at the target, so the two passes below would copy it.
        if targets.len() == n_targets {
            return Ok(Self {
                targets,
                n_targets,
                offsets: (0..=n_targets).collect(),
                order: row_of,
            });
        }
        // Two tight passes over the targets rather than one with two pushes a target.
        let mut offsets = Vec::with_capacity(n_targets + 1);
        offsets.push(0);
        let mut n_rows = 0;
        offsets.extend(row_of.iter().map(|&row| {
            n_rows += usize::from(row != NO_ROW);
            n_rows
        }));
        let mut order = Vec::with_capacity(targets.len());
        order.extend(row_of.into_iter().filter(|&row| row != NO_ROW));
        Ok(Self {
            targets,
            n_targets,
            offsets,
            order,
        })
    }

    /// The map of rows onto targets that each have `per_target` rows (a batch's tokens where
    /// capacity dropped none of their `top_k` choices), the same as [`new`](Self::new) gives
    /// for them: each target's rows start at `t · per_target`, known before the rows are read,
    /// so the counting sort's pass that counts them is left out.
    ///
    /// # Panics
    /// If there are not `n_targets · per_target` rows, a target is `n_targets` or more, or a
    /// target has another number of rows (a contract violation: the dispatch plan takes this
    /// path only where no assignment was dropped).
    pub fn with_uniform_counts(targets: Vec<usize>, n_targets: usize, per_target: usize) -> Self {
        assert_eq!(
            Some(targets.len()),
            n_targets.checked_mul(per_target),
            "RowMap: {} rows are not {per_target} for each of {n_targets} targets",
            targets.len()
        );
        let offsets: Vec<usize> = (0..=n_targets).map(|t| t * per_target).collect();
        // A target past the end is refused as the rows are placed; one with more rows than its
        // share writes into the next target's (caught below) or past the end (caught by the
        // index).
        let (order, next) = place_rows(&targets, &offsets);
        assert!(
            next.iter().zip(&offsets[1..]).all(|(n, end)| n == end),
            "RowMap: a target does not have {per_target} rows"
        );
        Self {
            targets,
            n_targets,
            offsets,
            order,
        }
    }

    /// The target of each row. `[n_rows]`
    pub fn targets(&self) -> &[usize] {
        &self.targets
    }

    /// Rows of the row-ordered tensor.
    pub fn n_rows(&self) -> usize {
        self.targets.len()
    }

    /// Rows of the target tensor.
    pub fn n_targets(&self) -> usize {
        self.n_targets
    }

    /// Where each target's rows start in [`order`](Self::order). `[n_targets + 1]`
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// The rows grouped by target, ascending within each target. `[n_rows]`
    pub fn order(&self) -> &[usize] {
        &self.order
    }

    /// Target `t`'s rows, ascending.
    pub fn rows_of(&self, t: usize) -> &[usize] {
        &self.order[self.offsets[t]..self.offsets[t + 1]]
    }
}

/// The second pass of a stable counting sort: each row placed at its target's next free
/// position from `offsets` (`[n_targets + 1]`), so each target's rows stay ascending. Returns
/// the order and each target's position after its last row (`offsets[t + 1]` where the
/// offsets counted the rows).
///
/// # Panics
/// If a target is `n_targets` or more (the lookup of its position checks it at no extra cost).
fn place_rows(targets: &[usize], offsets: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let n_targets = offsets.len() - 1;
    let mut next = offsets[..n_targets].to_vec();
    let mut order = vec![0usize; targets.len()];
    for (row, &t) in targets.iter().enumerate() {
        let Some(at) = next.get_mut(t) else {
            panic!("RowMap: target {t} of a tensor of {n_targets} rows");
        };
        order[*at] = row;
        *at += 1;
    }
    (order, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_lists_each_targets_rows_ascending() {
        // Token 1 has three rows, token 2 none, as in a top-3 plan with a dropped token.
        let map = RowMap::new(vec![1, 0, 1, 3, 1, 0], 4);
        assert_eq!(map.n_rows(), 6);
        assert_eq!(map.n_targets(), 4);
        assert_eq!(map.offsets(), &[0, 2, 5, 5, 6]);
        assert_eq!(map.rows_of(0), &[1, 5]);
        assert_eq!(map.rows_of(1), &[0, 2, 4]);
        assert!(map.rows_of(2).is_empty());
        assert_eq!(map.rows_of(3), &[3]);
        for t in 0..4 {
            for &r in map.rows_of(t) {
                assert_eq!(map.targets()[r], t);
            }
        }
    }

    /// The distinct-target map is the counting sort's: the same offsets and order, on rows
    /// that leave some targets empty, at sizes around the small ones the tests use.
    #[test]
    fn distinct_targets_map_as_the_counting_sort_does() {
        let mut rng = crate::rng::SplitMix64::new(11);
        for n_targets in [0, 1, 2, 7, 64, 1000] {
            // A random permutation of the targets, cut short: distinct, some left out.
            let mut targets: Vec<usize> = (0..n_targets).collect();
            for i in (1..n_targets).rev() {
                targets.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            // Every target (a batch without drops, the map's shortcut) and two thirds of them.
            for kept in [n_targets, n_targets * 2 / 3] {
                let targets = targets[..kept].to_vec();
                let sorted = RowMap::new(targets.clone(), n_targets);
                assert_eq!(
                    RowMap::with_distinct_targets(targets, n_targets),
                    Ok(sorted),
                    "{n_targets} targets, {kept} rows"
                );
            }
        }
        // A duplicate among as many rows as targets leaves one target without a row.
        assert_eq!(RowMap::with_distinct_targets(vec![1, 0, 1], 3), Err(1));
        assert_eq!(RowMap::with_distinct_targets(vec![2, 0, 2, 0], 3), Err(2));
    }

    /// With every target's rows counted in advance, the map is the counting sort's: tokens
    /// of a top-k batch without drops, their rows in the plan's order (by expert, not by
    /// token), at sizes around the tests'.
    #[test]
    fn uniform_counts_map_as_the_counting_sort_does() {
        let mut rng = crate::rng::SplitMix64::new(5);
        for (n_targets, per_target) in [(0, 2), (1, 1), (3, 2), (64, 1), (257, 4), (1000, 8)] {
            let mut targets: Vec<usize> = (0..n_targets * per_target).map(|s| s / per_target).collect();
            for i in (1..targets.len()).rev() {
                targets.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let sorted = RowMap::new(targets.clone(), n_targets);
            assert_eq!(
                RowMap::with_uniform_counts(targets, n_targets, per_target),
                sorted,
                "{n_targets} × {per_target}"
            );
        }
    }

    #[test]
    #[should_panic(expected = "target 2 of a tensor of 2 rows")]
    fn a_uniform_target_past_the_end_is_refused() {
        RowMap::with_uniform_counts(vec![0, 2], 2, 1);
    }

    #[test]
    #[should_panic(expected = "a target does not have 2 rows")]
    fn uneven_counts_are_refused_where_uniform_ones_are_promised() {
        // Target 0 has three rows and target 1 one: the right total, the wrong split.
        RowMap::with_uniform_counts(vec![0, 1, 0, 0], 2, 2);
    }

    #[test]
    #[should_panic(expected = "target 3 of a tensor of 3 rows")]
    fn a_distinct_target_past_the_end_is_refused() {
        let _ = RowMap::with_distinct_targets(vec![0, 3], 3);
    }

    #[test]
    fn empty_maps_have_offsets_only() {
        let map = RowMap::new(Vec::new(), 3);
        assert_eq!(map.offsets(), &[0, 0, 0, 0]);
        assert!(map.order().is_empty());
    }

    #[test]
    #[should_panic(expected = "target 3 of a tensor of 3 rows")]
    fn a_target_past_the_end_is_refused() {
        RowMap::new(vec![0, 3], 3);
    }
}
