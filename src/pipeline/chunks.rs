//! Cutting `total` rows into `n` near-equal chunks: how partitions split every group of rows,
//! and how ranks split a batch.

/// Size of chunk `i` when `total` rows are cut into `n` chunks whose sizes differ by at most
/// one (the first `total % n` chunks are one longer).
pub fn chunk_len(total: usize, n: usize, i: usize) -> usize {
    total / n + usize::from(i < total % n)
}

/// Row range of chunk `i` of `total` rows cut into `n` chunks (see [`chunk_len`]).
pub fn chunk_range(total: usize, n: usize, i: usize) -> std::ops::Range<usize> {
    let start = i * (total / n) + i.min(total % n);
    start..start + chunk_len(total, n, i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_every_row_once_and_differ_by_at_most_one() {
        for total in 0..20 {
            for n in 1..7 {
                let mut next = 0;
                for i in 0..n {
                    let r = chunk_range(total, n, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == total / n || r.len() == total / n + 1);
                    next = r.end;
                }
                assert_eq!(next, total);
            }
        }
    }
}
