//! The counts collective: what every rank routed where, gathered once per forward, and the
//! plans for any split as pure functions of it.

use super::{chunk_len, chunk_range, DispatchPlan, ExchangePlan, ExpertRows, RoutingStats, SplitScheme};
use crate::comm::Communicator;
use crate::error::{MoeError, Result};
use crate::memory::RankRows;

/// The routing decision of one rank with everything the other ranks told it: capacity
/// decisions, row counts per (rank, expert) in both directions, and global totals. Built by
/// one collective step; plans for any split are then pure functions of it.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingCounts {
    pub(super) rank: usize,
    pub(super) n_ranks: usize,
    pub(super) n_local: usize,
    pub(super) n_tokens: usize,
    pub(super) top_k: usize,
    /// Kept assignments (slots `t * top_k + j` and their tokens) per global expert, in token
    /// order.
    pub(super) expert_rows: ExpertRows,
    /// Kept assignments of every rank to every expert: `[n_ranks][n_experts]`. Every rank
    /// knows them after the counts exchange, so every rank can model every rank's memory.
    pub(super) kept_by_rank: Vec<Vec<usize>>,
    /// Tokens on every rank.
    pub(super) tokens_by_rank: Vec<usize>,
    pub(super) send_counts: Vec<usize>,
    pub(super) recv_counts: Vec<usize>,
    pub(super) expert_fraction: Vec<f64>,
    pub(super) stats: RoutingStats,
}

/// Every expert's routed rows over the group, from the gathered counts (`[n_tokens,
/// per-expert counts...]` per rank).
fn expert_totals(per_rank: &[&[usize]], n_experts: usize) -> Vec<usize> {
    let mut global = vec![0usize; n_experts];
    for counts in per_rank {
        global.iter_mut().zip(&counts[1..]).for_each(|(g, c)| *g += c);
    }
    global
}

/// Every rank's kept rows per expert. Capacity is first come, first served in rank order, so
/// every rank's kept counts follow from the gathered counts alone.
fn kept_by_rank(per_rank: &[&[usize]], n_experts: usize, capacity: Option<usize>) -> Vec<Vec<usize>> {
    let mut taken = vec![0usize; n_experts];
    per_rank
        .iter()
        .map(|counts| {
            (0..n_experts)
                .map(|e| {
                    let want = counts[e + 1];
                    let kept = capacity.map_or(want, |c| want.min(c.saturating_sub(taken[e])));
                    taken[e] += want;
                    kept
                })
                .collect()
        })
        .collect()
}

/// The group's token count and per-expert loads summed over its data-parallel replicas.
fn over_replicas(
    replicas: &dyn Communicator,
    n_tokens: usize,
    routed: &[usize],
) -> Result<(usize, Vec<usize>)> {
    if replicas.n_ranks() == 1 {
        return Ok((n_tokens, routed.to_vec()));
    }
    let mine: Vec<usize> = std::iter::once(n_tokens).chain(routed.iter().copied()).collect();
    let all = replicas.all_gather_counts(&mine)?;
    let mut sum = vec![0usize; mine.len()];
    for replica in all.chunks_exact(mine.len()) {
        sum.iter_mut().zip(replica).for_each(|(acc, v)| *acc += v);
    }
    Ok((sum[0], sum[1..].to_vec()))
}

impl RoutingCounts {
    /// The collective step: one all-gather of per-expert counts (for the global capacity
    /// order, the load-balancing fractions and the global token count) and one all-to-all of
    /// per-(rank, expert) row counts.
    ///
    /// `indices` are this rank's choices, `[n_tokens * top_k]`, best first within a token.
    /// With data-parallel `replicas` of the group (more than one rank), a third collective sums
    /// the group's token and per-expert totals over them, for the load-balancing fractions, the
    /// losses' token count and the reported load.
    pub fn gather(
        indices: &[usize],
        n_tokens: usize,
        top_k: usize,
        n_experts: usize,
        capacity_factor: Option<f64>,
        comm: &dyn Communicator,
        replicas: &dyn Communicator,
    ) -> Result<Self> {
        let (rank, n_ranks) = (comm.rank(), comm.n_ranks());
        if !n_experts.is_multiple_of(n_ranks) {
            return Err(MoeError::config(
                "n_experts",
                format!("{n_experts} experts cannot be split evenly over {n_ranks} ranks"),
            ));
        }
        debug_assert_eq!(indices.len(), n_tokens * top_k);
        let n_local = n_experts / n_ranks;

        let mut local = vec![0usize; n_experts + 1];
        local[0] = n_tokens;
        for &e in indices {
            local[e + 1] += 1;
        }
        let gathered = comm.all_gather_counts(&local)?;
        let per_rank: Vec<&[usize]> = gathered.chunks_exact(n_experts + 1).collect();
        // This rank's kept rows are read back from the gathered counts below: a communicator
        // that gathered anything else is refused here, not trusted with the plan.
        if per_rank.len() != n_ranks || per_rank[rank] != local.as_slice() {
            return Err(MoeError::comm(
                "all_gather_counts",
                rank,
                format!(
                    "gathered {} values where {n_ranks} ranks of {} counts, this rank's own among them, were expected",
                    gathered.len(),
                    n_experts + 1
                ),
            ));
        }
        let n_tokens_global: usize = per_rank.iter().map(|c| c[0]).sum();
        let global = expert_totals(&per_rank, n_experts);

        let capacity = capacity_factor.map(|f| super::capacity_for(f, n_tokens_global, top_k, n_experts));
        let kept_by_rank = kept_by_rank(&per_rank, n_experts, capacity);
        let tokens_by_rank = per_rank.iter().map(|c| c[0]).collect();
        let tokens_per_expert: Vec<usize> =
            global.iter().map(|&g| capacity.map_or(g, |c| g.min(c))).collect();
        let dropped = global.iter().sum::<usize>() - tokens_per_expert.iter().sum::<usize>();
        let (n_tokens_world, routed) = over_replicas(replicas, n_tokens_global, &global)?;
        let assignments = (n_tokens_world * top_k).max(1) as f64;
        let expert_fraction: Vec<f64> = routed.iter().map(|&g| g as f64 / assignments).collect();

        // This rank's kept counts are its share of the first come, first served order in
        // `kept_by_rank`; each expert keeps its first assignments in token order.
        let send_counts = kept_by_rank[rank].clone();
        let local_dropped = indices.len() - send_counts.iter().sum::<usize>();
        let recv_counts = comm.all_to_all_counts(&send_counts, n_local)?;
        let expert_rows = ExpertRows::new(indices, top_k, &send_counts);
        Ok(Self {
            rank,
            n_ranks,
            n_local,
            n_tokens,
            top_k,
            expert_rows,
            kept_by_rank,
            tokens_by_rank,
            send_counts,
            recv_counts,
            expert_fraction,
            stats: RoutingStats {
                tokens_per_expert,
                routed_per_expert: routed,
                dropped,
                local_dropped,
                capacity,
                n_tokens_global,
                n_tokens_world,
            },
        })
    }

    /// Tokens over all ranks.
    pub fn n_tokens_global(&self) -> usize {
        self.stats.n_tokens_global
    }

    /// Rows this rank sends (kept assignments).
    pub fn send_rows(&self) -> usize {
        self.send_counts.iter().sum()
    }

    /// Ranks in the group.
    pub fn n_ranks(&self) -> usize {
        self.n_ranks
    }

    /// Rows rank `rank` receives over all partitions (its experts' kept assignments).
    pub fn recv_rows_of(&self, rank: usize) -> usize {
        let experts = rank * self.n_local..(rank + 1) * self.n_local;
        self.kept_by_rank
            .iter()
            .map(|k| k[experts.clone()].iter().sum::<usize>())
            .sum()
    }

    /// The rows any rank of the group sends and receives in each partition under `scheme`:
    /// what the memory model needs to bound that rank's peak. Every rank computes the same
    /// answer for every rank.
    pub fn rank_rows(&self, rank: usize, scheme: SplitScheme) -> RankRows {
        let (n_ranks, n_local) = (self.n_ranks, self.n_local);
        let n = scheme.n_partitions(n_ranks);
        let share = |count: usize, i: usize, peer: usize, talks_to: usize| match scheme {
            SplitScheme::Tokens(n) => chunk_len(count, n, i),
            SplitScheme::Ranks => {
                if peer == talks_to {
                    count
                } else {
                    0
                }
            }
        };
        let send = (0..n)
            .map(|i| {
                (0..n_ranks * n_local)
                    .map(|g| share(self.kept_by_rank[rank][g], i, g / n_local, (rank + i) % n_ranks))
                    .sum()
            })
            .collect();
        let recv = (0..n)
            .map(|i| {
                (0..n_local)
                    .map(|e| {
                        (0..n_ranks)
                            .map(|src| {
                                share(
                                    self.kept_by_rank[src][rank * n_local + e],
                                    i,
                                    src,
                                    (rank + n_ranks - i % n_ranks) % n_ranks,
                                )
                            })
                            .sum()
                    })
                    .collect()
            })
            .collect();
        RankRows {
            tokens: self.tokens_by_rank[rank],
            send,
            recv,
        }
    }

    /// The exchange plan for `scheme` (pure).
    pub fn exchange_plan(&self, scheme: SplitScheme) -> ExchangePlan {
        ExchangePlan::new(
            self.rank,
            self.n_ranks,
            self.n_local,
            self.send_counts.clone(),
            self.recv_counts.clone(),
            scheme,
        )
    }

    /// Both plans for `scheme`: `T_I`'s rows ordered partition-major, then by expert, then by
    /// token (pure).
    pub fn plans(&self, scheme: SplitScheme) -> (DispatchPlan, ExchangePlan) {
        let exchange = self.exchange_plan(scheme);
        let rows = &self.expert_rows;
        let mut row_slot = Vec::with_capacity(exchange.send_rows());
        let mut row_token = Vec::with_capacity(exchange.send_rows());
        for i in 0..exchange.n_partitions() {
            for e in 0..rows.n_experts() {
                let n_rows = rows.slots_of(e).len();
                let range = match scheme {
                    SplitScheme::Tokens(n) => chunk_range(n_rows, n, i),
                    SplitScheme::Ranks if e / self.n_local == (self.rank + i) % self.n_ranks => 0..n_rows,
                    SplitScheme::Ranks => 0..0,
                };
                row_slot.extend_from_slice(&rows.slots_of(e)[range.clone()]);
                row_token.extend_from_slice(&rows.tokens_of(e)[range]);
            }
        }
        debug_assert_eq!(row_slot.len(), exchange.send_rows());
        (self.dispatch_of(row_slot, row_token), exchange)
    }

    /// `T_I`'s rows in one block, by expert, then by token (the order [`plans`](Self::plans)
    /// gives a single partition), without an exchange plan: the decode path's plan, where one
    /// rank's few tokens go straight to its experts. Expert `e`'s rows are
    /// [`kept_per_expert`](Self::kept_per_expert)`()[e]` (pure).
    pub fn dispatch_plan(&self) -> DispatchPlan {
        let rows = &self.expert_rows;
        self.dispatch_of(rows.slots().to_vec(), rows.tokens().to_vec())
    }

    /// This rank's kept assignments to each expert of the group, after capacity. `[n_experts]`
    pub fn kept_per_expert(&self) -> &[usize] {
        &self.send_counts
    }

    fn dispatch_of(&self, row_slot: Vec<usize>, row_token: Vec<usize>) -> DispatchPlan {
        DispatchPlan {
            n_tokens: self.n_tokens,
            top_k: self.top_k,
            row_token,
            row_slot,
            expert_fraction: self.expert_fraction.clone(),
            stats: self.stats.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::SingleRank;
    use crate::dispatch::CapacityDecision;

    /// The decode path's plan is the one-partition plan without its exchange plan: the same
    /// rows in the same order, the same counts, with and without capacity drops; and each
    /// expert's kept rows are `kept_per_expert`'s count, in expert order.
    #[test]
    fn the_dispatch_plan_is_the_one_partition_plan() {
        // Six tokens, top-2, four experts; expert 1 is chosen five times.
        let indices = [1, 0, 1, 2, 3, 1, 1, 0, 2, 1, 3, 0];
        for capacity in [None, Some(1.0)] {
            let counts =
                RoutingCounts::gather(&indices, 6, 2, 4, capacity, &SingleRank, &SingleRank).unwrap();
            let (plan, _) = counts.plans(SplitScheme::Tokens(1));
            let direct = counts.dispatch_plan();
            assert_eq!(direct, plan, "capacity {capacity:?}");
            let kept = counts.kept_per_expert();
            assert_eq!(kept.iter().sum::<usize>(), direct.n_rows());
            let experts: Vec<usize> = direct.row_slot.iter().map(|&s| indices[s]).collect();
            let want: Vec<usize> = (0..4).flat_map(|e| std::iter::repeat_n(e, kept[e])).collect();
            assert_eq!(experts, want, "rows by expert, capacity {capacity:?}");
        }
        // A capacity of 1.0 × 6 × 2 / 4 = 3 rows an expert drops two of expert 1's five.
        let capped = RoutingCounts::gather(&indices, 6, 2, 4, Some(1.0), &SingleRank, &SingleRank).unwrap();
        assert_eq!(capped.kept_per_expert(), &[3, 3, 2, 2]);
    }

    /// A peer that echoes this rank's own counts changed: the gathered counts no longer say
    /// what this rank routed, and the plan that reads its kept rows from them is refused.
    #[test]
    fn a_gather_that_changes_this_ranks_counts_is_a_comm_error() {
        use crate::comm::{Communicator, Payload};
        #[derive(Debug)]
        struct Garbling;
        impl Communicator for Garbling {
            fn rank(&self) -> usize {
                0
            }
            fn n_ranks(&self) -> usize {
                2
            }
            fn exchange(&self, _: &'static str, mut outgoing: Vec<Payload>) -> crate::Result<Vec<Payload>> {
                if let Payload::Counts(own) = &mut outgoing[0] {
                    own[1] += 1;
                }
                Ok(outgoing)
            }
            fn split(&self, _: usize) -> crate::Result<std::sync::Arc<dyn Communicator>> {
                unreachable!("the counts step splits nothing")
            }
        }
        let err = RoutingCounts::gather(&[0, 1, 1, 0], 4, 1, 2, None, &Garbling, &SingleRank).unwrap_err();
        assert!(
            matches!(&err, MoeError::Comm { op, .. } if op == "all_gather_counts"),
            "{err}"
        );
    }

    /// `T_I`'s rows by their definition: partition by partition, expert by expert, the slots
    /// of that expert the capacity keeps, ascending, cut into `n` near-equal chunks; the
    /// capacity decided slot by slot from zero (one rank, `CapacityDecision`).
    fn rows_by_definition(
        indices: &[usize],
        n_experts: usize,
        capacity: Option<usize>,
        n: usize,
    ) -> Vec<usize> {
        let kept = CapacityDecision::decide(indices, n_experts, capacity, &vec![0; n_experts]).kept;
        let mut rows = Vec::new();
        for i in 0..n {
            for e in 0..n_experts {
                let slots: Vec<usize> = (0..indices.len())
                    .filter(|&s| indices[s] == e && kept[s])
                    .collect();
                rows.extend_from_slice(&slots[chunk_range(slots.len(), n, i)]);
            }
        }
        rows
    }

    proptest::proptest! {
        /// The plans' rows, their tokens and the decode path's block follow the definition,
        /// with and without capacity, at any number of partitions.
        #[test]
        fn the_plans_rows_are_the_definitions(
            n_experts in 1usize..7,
            top_k in 1usize..4,
            picks in proptest::collection::vec(0usize..64, 0..90),
            factor in proptest::option::of(0.25f64..1.5),
            n in 1usize..5,
        ) {
            let n_tokens = picks.len() / top_k;
            let indices: Vec<usize> = picks[..n_tokens * top_k].iter().map(|p| p % n_experts).collect();
            let counts =
                RoutingCounts::gather(&indices, n_tokens, top_k, n_experts, factor, &SingleRank, &SingleRank)
                    .unwrap();
            let capacity = factor.map(|f| super::super::capacity_for(f, n_tokens, top_k, n_experts));
            let want = rows_by_definition(&indices, n_experts, capacity, n);
            let (plan, exchange) = counts.plans(SplitScheme::Tokens(n));
            proptest::prop_assert_eq!(&plan.row_slot, &want);
            let tokens: Vec<usize> = want.iter().map(|s| s / top_k).collect();
            proptest::prop_assert_eq!(&plan.row_token, &tokens);
            proptest::prop_assert_eq!(exchange.send_rows(), want.len());
            // At one rank every drop is this rank's.
            proptest::prop_assert_eq!(plan.stats.local_dropped, indices.len() - want.len());
            proptest::prop_assert_eq!(plan.stats.dropped, indices.len() - want.len());
            let block = rows_by_definition(&indices, n_experts, capacity, 1);
            proptest::prop_assert_eq!(counts.dispatch_plan().row_slot, block);
        }
    }
}
