//! Top-k selection on the host.

/// The indices of the `k` largest values of each row of `values` (`[n_rows, n_cols]`,
/// row-major), best first. Equal values keep their column order (the lower index wins), so
/// the choice is deterministic.
///
/// # Panics
/// If `k > n_cols` or `values.len()` is not a multiple of `n_cols` (the layer validates both).
pub fn top_k_host(values: &[f32], n_cols: usize, k: usize) -> Vec<usize> {
    assert!(k <= n_cols, "top_k {k} > {n_cols} columns");
    assert!(n_cols > 0 && values.len() % n_cols == 0);
    let mut out = Vec::with_capacity(values.len() / n_cols * k);
    let mut picked = vec![false; n_cols];
    for row in values.chunks_exact(n_cols) {
        picked.iter_mut().for_each(|p| *p = false);
        for _ in 0..k {
            let mut best: Option<usize> = None;
            for (c, &v) in row.iter().enumerate() {
                if !picked[c] && best.is_none_or(|b| v > row[b]) {
                    best = Some(c);
                }
            }
            let best = best.expect("k <= n_cols leaves a column to pick");
            picked[best] = true;
            out.push(best);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_largest_best_first_and_breaks_ties_by_index() {
        let v = [0.1, 0.5, 0.5, 0.2, /* row 2 */ 3.0, -1.0, 2.0, 2.5];
        assert_eq!(top_k_host(&v, 4, 2), vec![1, 2, 0, 3]);
        assert_eq!(top_k_host(&v, 4, 1), vec![1, 0]);
    }
}
