//! Cutting the all-to-all into partitions (the paper's micro-batches).

/// How the exchange is split into partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum SplitScheme {
    /// MPipeMoE: every (source, destination, expert) group is cut into `n` near-equal
    /// contiguous chunks along the token dimension; partition `i` is chunk `i` of every group,
    /// so each partition is a full all-to-all carrying about 1/n of every expert's load.
    Tokens(usize),
    /// FasterMoE: partition `i` holds all rows this rank sends to rank `(rank + i) mod N`
    /// (and receives from `(rank − i) mod N`): N point-to-point steps.
    Ranks,
}

impl SplitScheme {
    /// Number of partitions for a group of `n_ranks`.
    pub fn n_partitions(self, n_ranks: usize) -> usize {
        match self {
            SplitScheme::Tokens(n) => n,
            SplitScheme::Ranks => n_ranks,
        }
    }
}

/// What one partition of the exchange moves, from this rank's point of view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionPlan {
    /// First row of this partition in `T_I` (partitions are contiguous in `T_I`).
    pub send_offset: usize,
    /// Rows sent to each destination rank. `[n_ranks]`
    pub send_per_rank: Vec<usize>,
    /// Rows received from each source rank. `[n_ranks]`
    pub recv_per_rank: Vec<usize>,
    /// Received rows per local expert. `[n_local_experts]`
    pub rows_per_expert: Vec<usize>,
    /// Received rows are grouped by source rank, then expert. The experts want them grouped
    /// by expert, then source: `to_expert_major[i]` is the received row that becomes
    /// expert-major row `i`. `None` when the two orders coincide.
    pub to_expert_major: Option<Vec<usize>>,
    /// The inverse permutation: `from_expert_major[j]` is the expert-major row that becomes
    /// received-order row `j`.
    pub from_expert_major: Option<Vec<usize>>,
}

impl PartitionPlan {
    /// Rows this rank sends in this partition.
    pub fn send_rows(&self) -> usize {
        self.send_per_rank.iter().sum()
    }

    /// Rows this rank receives (and computes on) in this partition.
    pub fn recv_rows(&self) -> usize {
        self.recv_per_rank.iter().sum()
    }

    /// Builds partition `i`.
    ///
    /// `send_groups` / `recv_groups` are this partition's row counts for every (rank, local
    /// expert) group, rank-major. `send_offset` is where the partition starts in `T_I`.
    pub(crate) fn new(
        send_offset: usize,
        send_groups: &[usize],
        recv_groups: &[usize],
        n_ranks: usize,
        n_local: usize,
    ) -> Self {
        let per_rank = |groups: &[usize]| -> Vec<usize> {
            groups.chunks_exact(n_local).map(|c| c.iter().sum()).collect()
        };
        let mut rows_per_expert = vec![0; n_local];
        for (g, &count) in recv_groups.iter().enumerate() {
            rows_per_expert[g % n_local] += count;
        }
        // Start of each (src, expert) group in the received buffer.
        let mut group_start = Vec::with_capacity(recv_groups.len());
        let mut acc = 0;
        for &count in recv_groups {
            group_start.push(acc);
            acc += count;
        }
        let (to_expert_major, from_expert_major) = if n_ranks == 1 || n_local == 1 {
            (None, None)
        } else {
            let mut to = Vec::with_capacity(acc);
            for e in 0..n_local {
                for src in 0..n_ranks {
                    let g = src * n_local + e;
                    to.extend(group_start[g]..group_start[g] + recv_groups[g]);
                }
            }
            let mut from = vec![0; acc];
            for (i, &j) in to.iter().enumerate() {
                from[j] = i;
            }
            (Some(to), Some(from))
        };
        debug_assert_eq!(send_groups.len(), n_ranks * n_local);
        Self {
            send_offset,
            send_per_rank: per_rank(send_groups),
            recv_per_rank: per_rank(recv_groups),
            rows_per_expert,
            to_expert_major,
            from_expert_major,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_major_permutation_groups_by_expert() {
        // Two sources, two experts: groups (s0,e0)=1, (s0,e1)=2, (s1,e0)=1, (s1,e1)=0.
        let p = PartitionPlan::new(0, &[0; 4], &[1, 2, 1, 0], 2, 2);
        assert_eq!(p.rows_per_expert, vec![2, 2]);
        assert_eq!(p.to_expert_major, Some(vec![0, 3, 1, 2]));
        assert_eq!(p.from_expert_major, Some(vec![0, 2, 3, 1]));
    }
}
