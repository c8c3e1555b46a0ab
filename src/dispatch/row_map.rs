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
        // A stable counting sort: each target's rows stay ascending.
        let mut next = offsets.clone();
        let mut order = vec![0usize; targets.len()];
        for (row, &t) in targets.iter().enumerate() {
            order[next[t]] = row;
            next[t] += 1;
        }
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
            targets.truncate(n_targets * 2 / 3);
            let sorted = RowMap::new(targets.clone(), n_targets);
            assert_eq!(
                RowMap::with_distinct_targets(targets, n_targets),
                Ok(sorted),
                "{n_targets}"
            );
        }
        assert_eq!(RowMap::with_distinct_targets(vec![2, 0, 2, 0], 3), Err(2));
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
