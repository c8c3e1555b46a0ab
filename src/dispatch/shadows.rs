//! The counts of a step with hot experts shadowed: the same rows, routed to slots that every
//! rank has.
//!
//! With `s` shadowed experts every rank runs `n_local + s` expert slots: its own experts, then
//! a copy of each shadowed expert (in the order given). A row routed to a shadowed expert goes
//! to its own rank's copy (it never crosses the all-to-all); every other row goes to its
//! expert's owner as before, and the owner's own slot of a shadowed expert receives nothing.
//! The exchange then runs unchanged on these counts: the plans, the memory model and the
//! cost model all see the slots, while the routing statistics and the load-balancing
//! fractions stay those of the real experts.

use super::RoutingCounts;

impl RoutingCounts {
    /// Kept assignments of every rank to every expert slot: `[n_ranks][n_ranks * n_local]`,
    /// where `n_local` is [`n_local_slots`](Self::n_local_slots).
    pub fn kept_by_rank(&self) -> &[Vec<usize>] {
        &self.kept_by_rank
    }

    /// Expert slots per rank: the local experts, plus the shadowed ones after
    /// [`with_shadows`](Self::with_shadows).
    pub fn n_local_slots(&self) -> usize {
        self.n_local
    }

    /// The counts of this step with the experts in `shadows` (global indices, distinct)
    /// replicated on every rank (see the module docs). Pure: every rank computes the same
    /// answer for every rank from what [`gather`](Self::gather) told it.
    ///
    /// # Panics
    /// If an expert in `shadows` is out of range or listed twice (a contract of the caller,
    /// which chooses them from these counts).
    pub fn with_shadows(self, shadows: &[usize]) -> RoutingCounts {
        // Without shadows (every step of a layer that does not shadow) the counts go on as
        // they are: no copy of the per-expert row lists on the forward's path.
        if shadows.is_empty() {
            return self;
        }
        let (rank, n_ranks, n_local) = (self.rank, self.n_ranks, self.n_local);
        let n_experts = n_ranks * n_local;
        let slots = n_local + shadows.len();
        let mut shadow_slot = vec![None; n_experts];
        for (p, &e) in shadows.iter().enumerate() {
            assert!(e < n_experts, "shadowed expert {e} of {n_experts}");
            assert!(shadow_slot[e].is_none(), "expert {e} shadowed twice");
            shadow_slot[e] = Some(n_local + p);
        }
        // The slot (over the group) that rank `src`'s rows for expert `e` go to.
        let target = |src: usize, e: usize| match shadow_slot[e] {
            Some(slot) => src * slots + slot,
            None => (e / n_local) * slots + e % n_local,
        };
        let remap = |src: usize, counts: &[usize]| {
            let mut out = vec![0usize; n_ranks * slots];
            for (e, &c) in counts.iter().enumerate() {
                out[target(src, e)] += c;
            }
            out
        };
        let expert_rows = self.expert_rows.regrouped(n_ranks * slots, |e| target(rank, e));
        // What this rank receives per (source rank, slot): its own experts' rows from every
        // source except those of shadowed experts, and its own rows of each shadowed expert.
        let mut recv_counts = vec![0usize; n_ranks * slots];
        for src in 0..n_ranks {
            for v in 0..n_local {
                if shadow_slot[rank * n_local + v].is_none() {
                    recv_counts[src * slots + v] = self.recv_counts[src * n_local + v];
                }
            }
        }
        for (p, &e) in shadows.iter().enumerate() {
            recv_counts[rank * slots + n_local + p] = self.send_counts[e];
        }
        RoutingCounts {
            n_local: slots,
            expert_rows,
            kept_by_rank: (0..n_ranks)
                .map(|src| remap(src, &self.kept_by_rank[src]))
                .collect(),
            send_counts: remap(rank, &self.send_counts),
            recv_counts,
            ..self.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{ExpertRows, RoutingStats, SplitScheme};
    use super::*;

    /// Rank `rank` of two with two experts each, its counts as `gather` would leave them
    /// when `kept[src][e]` rows of rank `src` go to expert `e` (one slot per row, in order).
    fn counts(rank: usize, kept: &[Vec<usize>]) -> RoutingCounts {
        let (n_ranks, n_local) = (2, 2);
        let indices: Vec<usize> = (0..4)
            .flat_map(|e| std::iter::repeat_n(e, kept[rank][e]))
            .collect();
        let next = indices.len();
        let recv_counts = (0..n_ranks)
            .flat_map(|src| (0..n_local).map(move |v| (src, v)))
            .map(|(src, v)| kept[src][rank * n_local + v])
            .collect();
        RoutingCounts {
            rank,
            n_ranks,
            n_local,
            n_tokens: next,
            top_k: 1,
            expert_rows: ExpertRows::new(&indices, 1, &kept[rank]),
            kept_by_rank: kept.to_vec(),
            tokens_by_rank: kept.iter().map(|k| k.iter().sum()).collect(),
            send_counts: kept[rank].clone(),
            recv_counts,
            expert_fraction: vec![0.25; 4],
            stats: RoutingStats::default(),
        }
    }

    #[test]
    fn shadowed_rows_stay_on_their_rank_and_the_rest_go_to_the_owner() {
        // Expert 2 (rank 1's first) is hot; shadow it.
        let kept = vec![vec![1, 0, 5, 2], vec![0, 3, 4, 1]];
        let rank0 = counts(0, &kept).with_shadows(&[2]);
        assert_eq!(rank0.n_local_slots(), 3);
        // Slots: rank 0 = [e0, e1, copy of e2], rank 1 = [e2 (empty), e3, copy of e2].
        assert_eq!(rank0.send_counts, vec![1, 0, 5, 0, 2, 0]);
        // Rank 0 receives e0/e1 rows from both ranks and its own 5 rows of e2.
        assert_eq!(rank0.recv_counts, vec![1, 0, 5, 0, 3, 0]);
        assert_eq!(
            rank0.kept_by_rank,
            vec![vec![1, 0, 5, 0, 2, 0], vec![0, 3, 0, 0, 1, 4]]
        );
        // The five rows of e2 keep their slots and move to the copy.
        assert_eq!(rank0.expert_rows.slots_of(2), (1..6).collect::<Vec<_>>());
        assert!(rank0.expert_rows.slots_of(3).is_empty());

        let rank1 = counts(1, &kept).with_shadows(&[2]);
        // Rank 1 receives e3 from both ranks, nothing for its own slot of e2, and its own 4
        // rows of e2 in its copy.
        assert_eq!(rank1.recv_counts, vec![0, 2, 0, 0, 1, 4]);
        // Every rank's received rows over the partitions equal what the others send it.
        for scheme in [SplitScheme::Tokens(1), SplitScheme::Tokens(3), SplitScheme::Ranks] {
            let (p0, p1) = (rank0.exchange_plan(scheme), rank1.exchange_plan(scheme));
            for (a, b) in p0.partitions.iter().zip(&p1.partitions) {
                assert_eq!(a.send_per_rank[1], b.recv_per_rank[0], "{scheme:?}");
                assert_eq!(b.send_per_rank[0], a.recv_per_rank[1], "{scheme:?}");
            }
        }
    }

    #[test]
    fn no_shadows_change_nothing_and_the_totals_are_kept() {
        let kept = vec![vec![2, 1, 0, 3], vec![1, 1, 1, 1]];
        let c = counts(1, &kept);
        assert_eq!(c.clone().with_shadows(&[]), c);
        let s = c.clone().with_shadows(&[3, 0]);
        assert_eq!(s.send_rows(), c.send_rows());
        let total = |k: &[Vec<usize>]| k.iter().flatten().sum::<usize>();
        assert_eq!(total(s.kept_by_rank()), total(c.kept_by_rank()));
        // The statistics stay the real experts'.
        assert_eq!(s.expert_fraction, c.expert_fraction);
        // Two copies: slots [e2, e3, copy e3, copy e0] on rank 1.
        assert_eq!(s.n_local_slots(), 4);
        assert_eq!(s.send_counts, vec![0, 1, 0, 0, 1, 0, 1, 1]);
    }
}
