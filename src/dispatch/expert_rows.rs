//! Each expert's kept assignments on this rank, in token order: one flat list cut by offsets,
//! built in one pass over the choices.

/// This rank's kept (token, choice) assignments grouped by expert, each group in token order:
/// what step 3's plans cut into partitions. Every assignment is kept with its slot (`t · top_k
/// + j`) and its token `t`, so the plans write `T_I`'s row order without a division per row.
///
/// # Shapes
/// - `offsets`: `[n_experts + 1]`; expert `e`'s assignments are `offsets[e]..offsets[e + 1]`
/// - `slots`, `tokens`: `[n_rows]`
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertRows {
    offsets: Vec<usize>,
    slots: Vec<usize>,
    tokens: Vec<usize>,
}

impl ExpertRows {
    /// Groups the choices `indices` (`[n_tokens * top_k]`, best first within a token) by
    /// expert, expert `e` keeping its first `kept_per_expert[e]` assignments in token order:
    /// capacity is first come, first served, so the counts alone say which are kept. A
    /// counting sort, one pass over the choices.
    ///
    /// # Panics
    /// If an index is `kept_per_expert.len()` or more, or an expert is to keep more
    /// assignments than it was chosen for (a contract violation: the counts step derives both
    /// from `indices`).
    pub fn new(indices: &[usize], top_k: usize, kept_per_expert: &[usize]) -> Self {
        let n_experts = kept_per_expert.len();
        let mut offsets = Vec::with_capacity(n_experts + 1);
        offsets.push(0);
        for &count in kept_per_expert {
            offsets.push(offsets[offsets.len() - 1] + count);
        }
        let mut next = offsets[..n_experts].to_vec();
        let (mut slots, mut tokens) = (vec![0; offsets[n_experts]], vec![0; offsets[n_experts]]);
        // The token of a slot is the chunk it lies in: counted, not divided. Where every
        // assignment is kept (no capacity, or none dropped) no expert's end is looked up.
        let keeps_all = offsets[n_experts] == indices.len();
        for (t, choices) in indices.chunks_exact(top_k.max(1)).enumerate() {
            for (j, &e) in choices.iter().enumerate() {
                let at = next[e];
                if keeps_all || at < offsets[e + 1] {
                    slots[at] = t * top_k + j;
                    tokens[at] = t;
                    next[e] = at + 1;
                }
            }
        }
        assert!(
            next.iter().zip(&offsets[1..]).all(|(n, end)| n == end),
            "ExpertRows: an expert keeps more assignments than it was chosen for"
        );
        Self {
            offsets,
            slots,
            tokens,
        }
    }

    /// Experts (or expert slots, after [`regrouped`](Self::regrouped)).
    pub fn n_experts(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Expert `e`'s assignment slots (`t · top_k + j`), in token order.
    pub fn slots_of(&self, e: usize) -> &[usize] {
        &self.slots[self.offsets[e]..self.offsets[e + 1]]
    }

    /// Expert `e`'s assignments' tokens, in token order.
    pub fn tokens_of(&self, e: usize) -> &[usize] {
        &self.tokens[self.offsets[e]..self.offsets[e + 1]]
    }

    /// Every assignment's slot, expert by expert.
    pub fn slots(&self) -> &[usize] {
        &self.slots
    }

    /// Every assignment's token, expert by expert.
    pub fn tokens(&self) -> &[usize] {
        &self.tokens
    }

    /// The same assignments in `n_groups` groups, expert `e`'s becoming group `target(e)`'s
    /// and the groups no expert maps to empty.
    ///
    /// # Panics
    /// If a target is `n_groups` or more, or two experts share one (a contract violation:
    /// the shadows' slots are distinct).
    pub fn regrouped(&self, n_groups: usize, target: impl Fn(usize) -> usize) -> Self {
        let mut source = vec![None; n_groups];
        for e in 0..self.n_experts() {
            let g = target(e);
            assert!(
                source[g].replace(e).is_none(),
                "ExpertRows: two experts in group {g}"
            );
        }
        let mut out = Self {
            offsets: Vec::with_capacity(n_groups + 1),
            slots: Vec::with_capacity(self.slots.len()),
            tokens: Vec::with_capacity(self.tokens.len()),
        };
        out.offsets.push(0);
        for e in source {
            if let Some(e) = e {
                out.slots.extend_from_slice(self.slots_of(e));
                out.tokens.extend_from_slice(self.tokens_of(e));
            }
            out.offsets.push(out.slots.len());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assignments_group_by_expert_in_token_order() {
        // Four tokens, top-2, three experts; expert 1's one assignment (slot 5) dropped.
        let indices = [2, 0, 0, 2, 2, 1, 0, 2];
        let rows = ExpertRows::new(&indices, 2, &[3, 0, 4]);
        assert_eq!(rows.n_experts(), 3);
        assert_eq!(rows.slots_of(0), &[1, 2, 6]);
        assert_eq!(rows.tokens_of(0), &[0, 1, 3]);
        assert!(rows.slots_of(1).is_empty());
        assert_eq!(rows.slots_of(2), &[0, 3, 4, 7]);
        assert_eq!(rows.tokens_of(2), &[0, 1, 2, 3]);
        // With every assignment kept, in expert order.
        let all = ExpertRows::new(&indices, 2, &[3, 1, 4]);
        assert_eq!(all.slots(), &[1, 2, 6, 5, 0, 3, 4, 7]);
        assert_eq!(all.tokens(), &[0, 1, 3, 2, 0, 1, 2, 3]);
        // Capacity keeps each expert's first assignments in token order.
        let capped = ExpertRows::new(&indices, 2, &[2, 1, 3]);
        assert_eq!(capped.slots(), &[1, 2, 5, 0, 3, 4]);
        assert_eq!(capped.tokens(), &[0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn regrouping_moves_each_experts_rows_whole() {
        let rows = ExpertRows::new(&[1, 0, 1, 2], 1, &[1, 2, 1]);
        // Expert 0 → group 3, 1 → 0, 2 → 1; group 2 empty.
        let moved = rows.regrouped(4, |e| [3, 0, 1][e]);
        assert_eq!(moved.n_experts(), 4);
        assert_eq!(moved.slots_of(0), rows.slots_of(1));
        assert_eq!(moved.slots_of(1), rows.slots_of(2));
        assert!(moved.slots_of(2).is_empty());
        assert_eq!(moved.tokens_of(3), rows.tokens_of(0));
    }

    #[test]
    #[should_panic(expected = "keeps more assignments than it was chosen for")]
    fn counts_of_assignments_never_made_are_refused() {
        ExpertRows::new(&[0, 1, 1], 1, &[1, 2, 1]);
    }
}
