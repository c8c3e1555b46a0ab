//! Step 6's map with the combine weights in it: which token each row of `T_O` is summed onto
//! and which of that token's `top_k` weights scales it.

use std::sync::Arc;

use super::RowMap;

/// The rows of `T_O` mapped to their tokens (the combine's sums) and to their slots (`t ·
/// top_k + j`, the weight of choice `j` of token `t`). A slot has at most one row, and none
/// where capacity dropped the assignment.
///
/// # Shapes
/// - `tokens`: `n_rows` rows onto `n_tokens` targets
/// - `slots`: `n_rows` rows onto `n_tokens · top_k` targets
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CombineMap {
    tokens: Arc<RowMap>,
    slots: Arc<RowMap>,
    top_k: usize,
}

impl CombineMap {
    /// The map of rows whose slots are `row_slot` (`t · top_k + j`), onto `tokens`, the same
    /// rows' map to their tokens (`row_slot[i] / top_k`), shared with step 4's gather.
    ///
    /// # Panics
    /// If `top_k` is 0, a slot is past `tokens.n_targets() · top_k`, a slot has two rows, or
    /// a row's token is not its slot's (a contract violation: the dispatch plan builds both
    /// from the same assignments).
    pub fn new(tokens: Arc<RowMap>, row_slot: Vec<usize>, top_k: usize) -> Self {
        assert!(top_k > 0, "CombineMap: top_k is 0");
        assert_eq!(
            row_slot.len(),
            tokens.n_rows(),
            "CombineMap: {} slots for {} rows",
            row_slot.len(),
            tokens.n_rows()
        );
        // A slot's token is `slot / top_k`; checked by a product, as a division a row costs
        // more than the rest of the check, and folded without a branch a row (which
        // vectorises); the row is looked for only where the check fails. (A slot below its
        // token's first wraps past `top_k`.)
        let of_its_token =
            |(&slot, &token): (&usize, &usize)| slot.wrapping_sub(token.wrapping_mul(top_k)) < top_k;
        let pairs = || row_slot.iter().zip(tokens.targets());
        if !pairs().fold(true, |all, pair| all & of_its_token(pair)) {
            let row = pairs()
                .position(|pair| !of_its_token(pair))
                .expect("the fold found one");
            panic!(
                "CombineMap: row {row}'s slot {} is not its token {}'s",
                row_slot[row],
                tokens.targets()[row]
            );
        }
        let n_slots = tokens.n_targets() * top_k;
        let slots = RowMap::with_distinct_targets(row_slot, n_slots)
            .unwrap_or_else(|s| panic!("CombineMap: slot {s} has two rows"));
        Self {
            tokens,
            slots: Arc::new(slots),
            top_k,
        }
    }

    /// Each row's token, and each token's rows.
    pub fn tokens(&self) -> &Arc<RowMap> {
        &self.tokens
    }

    /// Each row's slot, and each slot's row (at most one).
    pub fn slots(&self) -> &Arc<RowMap> {
        &self.slots
    }

    /// Choices per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Tokens of the combined tensor.
    pub fn n_tokens(&self) -> usize {
        self.tokens.n_targets()
    }

    /// Rows of `T_O`.
    pub fn n_rows(&self) -> usize {
        self.tokens.n_rows()
    }

    /// The row of slot `s`, `None` where its assignment was dropped.
    pub fn row_of_slot(&self, s: usize) -> Option<usize> {
        self.slots.rows_of(s).first().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(row_slot: &[usize], top_k: usize, n_tokens: usize) -> Arc<RowMap> {
        Arc::new(RowMap::new(
            row_slot.iter().map(|s| s / top_k).collect(),
            n_tokens,
        ))
    }

    #[test]
    fn slots_find_their_rows_and_dropped_ones_none() {
        // Top-2 over 3 tokens: slot 3 (token 1's second choice) dropped, rows out of order.
        let row_slot = vec![4, 0, 2, 5, 1];
        let map = CombineMap::new(tokens(&row_slot, 2, 3), row_slot, 2);
        assert_eq!(map.n_rows(), 5);
        assert_eq!(map.n_tokens(), 3);
        let rows: Vec<_> = (0..6).map(|s| map.row_of_slot(s)).collect();
        assert_eq!(rows, [Some(1), Some(4), Some(2), None, Some(0), Some(3)]);
        assert_eq!(map.tokens().rows_of(2), &[0, 3]);
    }

    #[test]
    #[should_panic(expected = "slot 1 has two rows")]
    fn a_slot_with_two_rows_is_refused() {
        let row_slot = vec![1, 1];
        CombineMap::new(tokens(&row_slot, 2, 1), row_slot, 2);
    }

    #[test]
    #[should_panic(expected = "is not its token")]
    fn a_row_on_another_token_is_refused() {
        let row_slot = vec![0, 3];
        CombineMap::new(Arc::new(RowMap::new(vec![0, 0], 2)), row_slot, 2);
    }
}
