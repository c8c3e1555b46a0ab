//! The dispatch plan (token → row of `T_I`) and the exchange plan (row counts per rank and
//! expert, cut into partitions).

use std::sync::Arc;

use super::{chunk_len, CombineMap, PartitionPlan, RowMap, SplitScheme};

/// What the router did with a batch, over all ranks.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct RoutingStats {
    /// Assignments each expert took after capacity, over the global batch. `[n_experts]`
    pub tokens_per_expert: Vec<usize>,
    /// Assignments the router made to each expert over the global batch, before capacity: the
    /// load that load balancing acts on. Under data parallelism, summed over every replica's
    /// batch. `[n_experts]`
    pub routed_per_expert: Vec<usize>,
    /// Assignments dropped by capacity over the global batch.
    pub dropped: usize,
    /// Assignments of this rank's tokens dropped by capacity.
    pub local_dropped: usize,
    /// The per-expert limit, if capacity is on.
    pub capacity: Option<usize>,
    /// Tokens in the expert-parallel group's batch.
    pub n_tokens_global: usize,
    /// Tokens in the batches of every data-parallel replica of the expert-parallel group (the
    /// losses' normalisation); equal to `n_tokens_global` without data parallelism.
    pub n_tokens_world: usize,
}

/// How this rank's (token, choice) assignments become the rows of `T_I` and come back.
///
/// Rows are ordered partition-major, then by destination rank and local expert (that is,
/// by global expert), then by token, so that each partition is a contiguous block of `T_I`.
#[derive(Debug, Clone, PartialEq)]
pub struct DispatchPlan {
    /// Tokens on this rank.
    pub n_tokens: usize,
    /// Choices per token.
    pub top_k: usize,
    /// Token of each row of `T_I`. `[n_rows]`
    pub row_token: Vec<usize>,
    /// Assignment of each row: `t * top_k + j`. `[n_rows]`
    pub row_slot: Vec<usize>,
    /// Fraction of all assignments (global, before capacity) routed to each expert: the
    /// `f_e` of the load-balancing loss. `[n_experts]`
    pub expert_fraction: Vec<f64>,
    /// Counts for reporting.
    pub stats: RoutingStats,
}

impl RoutingStats {
    /// The most loaded expert's assignments over the mean (before capacity): 1 is perfectly
    /// balanced, `n_experts / top_k` is every token on the same experts. 1 for an empty batch.
    pub fn load_imbalance(&self) -> f64 {
        let total: usize = self.routed_per_expert.iter().sum();
        if total == 0 {
            return 1.0;
        }
        let mean = total as f64 / self.routed_per_expert.len() as f64;
        *self.routed_per_expert.iter().max().expect("non-empty") as f64 / mean
    }
}

impl DispatchPlan {
    /// Rows of `T_I` (kept assignments on this rank).
    pub fn n_rows(&self) -> usize {
        self.row_token.len()
    }

    /// The map of `T_I`'s rows to their tokens: step 4 gathers by it, step 6 sums back by it.
    ///
    /// # Panics
    /// If a row's token is `n_tokens` or more, or, where there are `n_tokens · top_k` rows,
    /// a token does not have `top_k` of them (a contract violation: a token has a row for
    /// each of its kept choices).
    pub fn token_map(&self) -> Arc<RowMap> {
        let tokens = self.row_token.clone();
        // Nothing dropped: every token has its `top_k` rows, and their offsets are known.
        Arc::new(
            match self.n_tokens.checked_mul(self.top_k) == Some(self.n_rows()) {
                true => RowMap::with_uniform_counts(tokens, self.n_tokens, self.top_k),
                false => RowMap::new(tokens, self.n_tokens),
            },
        )
    }

    /// Step 6's map: `tokens` (this plan's [`token_map`](Self::token_map)) with each row's
    /// combine-weight slot.
    pub fn combine_map(&self, tokens: Arc<RowMap>) -> Arc<CombineMap> {
        Arc::new(CombineMap::new(tokens, self.row_slot.clone(), self.top_k))
    }
}

/// Row counts of the exchange for every (rank, rank, expert) triple this rank is part of,
/// and how they are cut into partitions.
#[derive(Debug, Clone, PartialEq)]
pub struct ExchangePlan {
    /// This rank.
    pub rank: usize,
    /// Ranks in the group.
    pub n_ranks: usize,
    /// Experts per rank.
    pub n_local_experts: usize,
    /// Rows this rank sends to each (destination rank, local expert). `[n_ranks * n_local_experts]`
    pub send_counts: Vec<usize>,
    /// Rows this rank receives from each (source rank, local expert). `[n_ranks * n_local_experts]`
    pub recv_counts: Vec<usize>,
    /// How the exchange is cut.
    pub scheme: SplitScheme,
    /// The partitions, in schedule order.
    pub partitions: Vec<PartitionPlan>,
}

impl ExchangePlan {
    /// Builds the partitions of an exchange from its group counts.
    pub fn new(
        rank: usize,
        n_ranks: usize,
        n_local_experts: usize,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
        scheme: SplitScheme,
    ) -> Self {
        let n_parts = scheme.n_partitions(n_ranks);
        let mut partitions = Vec::with_capacity(n_parts);
        let mut offset = 0;
        for i in 0..n_parts {
            let send = partition_groups(&send_counts, scheme, n_ranks, n_local_experts, i, |p| {
                (rank + p) % n_ranks
            });
            let recv = partition_groups(&recv_counts, scheme, n_ranks, n_local_experts, i, |p| {
                (rank + n_ranks - p) % n_ranks
            });
            let part = PartitionPlan::new(offset, &send, &recv, n_ranks, n_local_experts);
            offset += part.send_rows();
            partitions.push(part);
        }
        Self {
            rank,
            n_ranks,
            n_local_experts,
            send_counts,
            recv_counts,
            scheme,
            partitions,
        }
    }

    /// Rows of `T_I` (and `T_O`).
    pub fn send_rows(&self) -> usize {
        self.send_counts.iter().sum()
    }

    /// Rows received over all partitions (`T_DI`).
    pub fn recv_rows(&self) -> usize {
        self.recv_counts.iter().sum()
    }

    /// Number of partitions.
    pub fn n_partitions(&self) -> usize {
        self.partitions.len()
    }
}

/// Partition `i`'s share of each (rank, expert) group. `peer(i)` is the only rank partition
/// `i` talks to under [`SplitScheme::Ranks`].
fn partition_groups(
    counts: &[usize],
    scheme: SplitScheme,
    n_ranks: usize,
    n_local: usize,
    i: usize,
    peer: impl Fn(usize) -> usize,
) -> Vec<usize> {
    match scheme {
        SplitScheme::Tokens(n) => counts.iter().map(|&c| chunk_len(c, n, i)).collect(),
        SplitScheme::Ranks => {
            let peer = peer(i);
            (0..n_ranks * n_local)
                .map(|g| if g / n_local == peer { counts[g] } else { 0 })
                .collect()
        }
    }
}
