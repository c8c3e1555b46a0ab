//! Which hot experts to replicate ("shadow") on every rank for one step, from the per-expert
//! row counts the layer gathers and the hardware profile (FasterMoE's dynamic shadowing,
//! PPoPP'22, with a rule that looks at the hottest rank; issue 45).
//!
//! This is the decision alone, a pure function of the counts; the derivation is in
//! `docs/design-notes.md`, "Shadowing hot experts: the decision rule". A shadowed expert's
//! weights go to every rank before the forward, each rank computes its own rows of it, and its
//! gradients are reduced to the owner after the backward, so the step's result does not depend
//! on which experts are shadowed, only its time does.
//!
//! # Shapes
//! - `counts`: `[n_ranks][n_experts]`, the rows rank `r` routes to expert `e` this step;
//! - `owner`: `[n_experts]`, the rank that holds expert `e`'s weights.

use serde::{Deserialize, Serialize};

use super::Profile;

/// Whether the layer replicates hot experts on every rank of its expert-parallel group for a
/// step ([`MoeLayerConfig::shadowing`](crate::MoeLayerConfig::shadowing)).
///
/// Shadowing changes where rows are computed, never the result: a shadowed expert's weights
/// are sent from its owner to every rank before the exchange, each rank computes the rows it
/// routed to it, and the copies' gradients are summed back onto the owner's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum Shadowing {
    /// Every row goes to its expert's owner.
    #[default]
    Off,
    /// Per step, the experts [`choose_shadows`] picks from the gathered counts and the
    /// layer's hardware profile (measured on first use, as for `MemoryReuse::Auto`), at most
    /// one expert fewer than the layer has.
    Auto,
    /// The `k` experts with the most rows each step (fewer if the layer has fewer).
    Fixed(usize),
}

/// The experts in decreasing total load over the ranks, ties to the lower index (so every
/// rank computes the same order from the same counts), the first `k` of them.
pub fn hottest_experts(counts: &[Vec<usize>], n_experts: usize, k: usize) -> Vec<usize> {
    let load: Vec<usize> = (0..n_experts)
        .map(|e| counts.iter().map(|row| row[e]).sum())
        .collect();
    let mut order: Vec<usize> = (0..n_experts).collect();
    order.sort_by(|&a, &b| load[b].cmp(&load[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// The rates the decision needs, in seconds and bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShadowCosts {
    /// Seconds for one row through one expert, forward and backward.
    pub row_seconds: f64,
    /// Bytes of one row (`d_model` elements).
    pub row_bytes: f64,
    /// Bytes of one expert's weights (as many again for its gradient).
    pub weight_bytes: f64,
    /// All-to-all rate, bytes a rank sends (or receives) per second.
    pub exchange_rate: f64,
    /// Broadcast and reduce rate, bytes per second per rank.
    pub broadcast_rate: f64,
    /// Whether a rank's compute and exchange overlap (the pipeline's streams run at once, as
    /// the threaded executor runs them on a GPU), so that a rank costs the slower of the two;
    /// otherwise (one stream: the in-order executor) it costs their sum.
    pub overlapped: bool,
}

impl ShadowCosts {
    /// The costs of an expert with `gemms` GEMMs of `d_model × d_hidden` (2 for GELU and ReLU,
    /// 3 for SwiGLU) in `elem_bytes`-byte elements, on `profile`'s rates. The backward costs
    /// two GEMMs per forward GEMM, so a row costs `3 · gemms · 2 · d_model · d_hidden` FLOPs;
    /// broadcasts and reduces run at the all-to-all rate (NCCL's ring moves about the same
    /// bytes per rank for both).
    pub fn from_profile(
        profile: &Profile,
        d_model: usize,
        d_hidden: usize,
        gemms: usize,
        elem_bytes: usize,
    ) -> Self {
        let per_gemm = (d_model * d_hidden) as f64;
        Self {
            row_seconds: 3.0 * gemms as f64 * 2.0 * per_gemm / profile.w_comp,
            row_bytes: (d_model * elem_bytes) as f64,
            weight_bytes: gemms as f64 * per_gemm * elem_bytes as f64,
            exchange_rate: profile.w_comm,
            broadcast_rate: profile.w_comm,
            overlapped: true,
        }
    }

    /// The same costs on an executor that runs the pipeline's steps one after another (the
    /// in-order executor, every CPU backend's): a rank's compute and exchange add up, so a
    /// shadow also pays for the traffic it saves once the ranks' compute is balanced.
    pub fn serial(self) -> Self {
        Self {
            overlapped: false,
            ..self
        }
    }
}

impl ShadowCosts {
    /// The same costs with the shadows sent by the broadcast's host path
    /// ([`Communicator::broadcast_f32`](crate::Communicator::broadcast_f32)): the owner sends
    /// each other rank a copy, `(n_ranks - 1)` times an expert's bytes per shadow, where NCCL's
    /// ring broadcast moves about one per rank; the broadcast rate falls by that factor (the
    /// gradients' all-reduce moves about twice an expert's bytes per rank, within it).
    pub fn with_host_broadcast(self, n_ranks: usize) -> Self {
        Self {
            broadcast_rate: self.exchange_rate / n_ranks.saturating_sub(1).max(1) as f64,
            ..self
        }
    }
}

/// Checks the contract shared by [`shadowed_step_time`] and [`choose_shadows`].
fn check_shapes(counts: &[Vec<usize>], owner: &[usize], shadowed: Option<&[bool]>) {
    let n_ranks = counts.len();
    assert!(n_ranks > 0, "shadowing: counts has no rank");
    for (rank, row) in counts.iter().enumerate() {
        assert_eq!(
            row.len(),
            owner.len(),
            "shadowing: rank {rank} counts {} experts, owner lists {}",
            row.len(),
            owner.len()
        );
    }
    if let Some(&bad) = owner.iter().find(|&&r| r >= n_ranks) {
        panic!("shadowing: an expert's owner is rank {bad}, with {n_ranks} ranks");
    }
    if let Some(shadowed) = shadowed {
        assert_eq!(shadowed.len(), owner.len(), "shadowing: one flag per expert");
    }
}

/// The modelled step time with the experts flagged in `shadowed` replicated: the slowest
/// rank's compute and exchange (the slower of the two where the pipeline overlaps them, their
/// sum where it does not: [`ShadowCosts::overlapped`]), plus the shadows' weight broadcast and
/// gradient reduce, counted in full.
///
/// # Panics
/// If `counts` is empty, its rows and `owner` differ in length, an owner is not a rank, or
/// `shadowed` has not one flag per expert.
pub fn shadowed_step_time(
    counts: &[Vec<usize>],
    owner: &[usize],
    shadowed: &[bool],
    costs: &ShadowCosts,
) -> f64 {
    check_shapes(counts, owner, Some(shadowed));
    RankLoads::new(counts, owner, shadowed).step_time(costs)
}

/// The experts to shadow this step (`Auto`), at most `limit` of them: the `k` most loaded
/// ([`hottest_experts`], what `Fixed(k)` takes) for the `k` in `0..=limit` with the lowest
/// [`shadowed_step_time`], the fewest on a tie. Every `k` is tried, not only while each added
/// expert pays: an expert can pay only together with the next (two hot experts on different
/// ranks, whose rows cross both ways until both are shadowed). Every rank computes the same
/// answer from the same gathered counts. Returned in decreasing load.
///
/// Each `k` adds one expert to the ranks' loads of `k - 1` (`RankLoads::shadow`, one pass
/// over the ranks), so the search costs `n_ranks · (n_experts + limit)`, not the
/// `n_ranks · n_experts · limit` of recounting every `k` (4,096 experts over 4,096 ranks: 4.5
/// minutes recounted).
///
/// # Panics
/// As [`shadowed_step_time`].
pub fn choose_shadows(
    counts: &[Vec<usize>],
    owner: &[usize],
    costs: &ShadowCosts,
    limit: usize,
) -> Vec<usize> {
    check_shapes(counts, owner, None);
    let n_experts = owner.len();
    let order = hottest_experts(counts, n_experts, limit);
    let mut loads = RankLoads::new(counts, owner, &vec![false; n_experts]);
    let mut best = (loads.step_time(costs), 0);
    for (k, &expert) in order.iter().enumerate() {
        loads.shadow(counts, owner, expert);
        let time = loads.step_time(costs);
        if time < best.0 {
            best = (time, k + 1);
        }
    }
    order[..best.1].to_vec()
}

/// Each rank's rows computed, sent and received with some experts shadowed: what the step
/// model reads, kept so that one more shadow updates it rather than recounting it.
struct RankLoads {
    computed: Vec<usize>,
    sent: Vec<usize>,
    received: Vec<usize>,
    n_shadows: usize,
}

impl RankLoads {
    /// The loads with the experts flagged in `shadowed` replicated.
    fn new(counts: &[Vec<usize>], owner: &[usize], shadowed: &[bool]) -> Self {
        let n_ranks = counts.len();
        let mut loads = Self {
            computed: vec![0; n_ranks],
            sent: vec![0; n_ranks],
            received: vec![0; n_ranks],
            n_shadows: shadowed.iter().filter(|&&s| s).count(),
        };
        for (rank, row) in counts.iter().enumerate() {
            for (expert, &rows) in row.iter().enumerate() {
                let home = owner[expert];
                if shadowed[expert] {
                    // Computed where it was routed: no row crosses.
                    loads.computed[rank] += rows;
                } else {
                    loads.computed[home] += rows;
                    if home != rank {
                        loads.sent[rank] += rows;
                        loads.received[home] += rows;
                    }
                }
            }
        }
        loads
    }

    /// Replicates `expert`, not shadowed yet: each rank's rows of it are computed where they
    /// were routed instead of on its owner, and no longer cross.
    fn shadow(&mut self, counts: &[Vec<usize>], owner: &[usize], expert: usize) {
        let home = owner[expert];
        for (rank, row) in counts.iter().enumerate() {
            let rows = row[expert];
            self.computed[home] -= rows;
            self.computed[rank] += rows;
            if home != rank {
                self.sent[rank] -= rows;
                self.received[home] -= rows;
            }
        }
        self.n_shadows += 1;
    }

    /// The slowest rank's compute and exchange (the slower of the two where the pipeline
    /// overlaps them, their sum where it does not), plus the shadows' traffic.
    fn step_time(&self, costs: &ShadowCosts) -> f64 {
        let slowest = (0..self.computed.len())
            .map(|r| {
                let compute = self.computed[r] as f64 * costs.row_seconds;
                // Dispatch and combine, forward and backward: four all-to-alls.
                let crossing = self.sent[r].max(self.received[r]) as f64;
                let exchange = 4.0 * crossing * costs.row_bytes / costs.exchange_rate;
                if costs.overlapped {
                    compute.max(exchange)
                } else {
                    compute + exchange
                }
            })
            .fold(0.0, f64::max);
        slowest + 2.0 * self.n_shadows as f64 * costs.weight_bytes / costs.broadcast_rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One row costs 1 s to compute and 1 s per all-to-all (so 4 s to exchange); a shadow
    /// costs `2 · weight_bytes` seconds.
    fn unit_costs(weight_bytes: f64) -> ShadowCosts {
        ShadowCosts {
            row_seconds: 1.0,
            row_bytes: 1.0,
            weight_bytes,
            exchange_rate: 1.0,
            broadcast_rate: 1.0,
            overlapped: true,
        }
    }

    #[test]
    fn shadowed_step_time_is_the_slowest_rank_plus_the_shadow_traffic() {
        // Two ranks, expert 0 on rank 0, expert 1 on rank 1. Rank 0 routes 3 rows to expert 0
        // and 1 to expert 1; rank 1 routes 5 to expert 0 and 2 to expert 1.
        let counts = vec![vec![3, 1], vec![5, 2]];
        let owner = [0, 1];
        let costs = unit_costs(10.0);
        // Unshadowed: rank 0 computes 3 + 5 = 8 rows and receives 5 (exchange 20); rank 1
        // computes 1 + 2 = 3 and sends 5 (exchange 20). Slowest: 20.
        assert_eq!(shadowed_step_time(&counts, &owner, &[false, false], &costs), 20.0);
        // Expert 0 shadowed: rank 0 computes its own 3 rows of it; rank 1 its own 5 of it and
        // expert 1's 1 + 2; only rank 0's row to expert 1 crosses (exchange 4). Slowest 8,
        // plus 2 · 10 for the shadow's weights and gradient: 28.
        assert_eq!(shadowed_step_time(&counts, &owner, &[true, false], &costs), 28.0);
    }

    #[test]
    fn on_a_serial_executor_a_shadow_also_pays_for_the_traffic_it_saves() {
        // Two ranks, experts 0 and 1 on rank 0, 2 and 3 on rank 1. Expert 0 is hot on both
        // ranks; rank 0's other rows go to expert 2, rank 1's to expert 1.
        let counts = vec![vec![10, 0, 4, 0], vec![10, 4, 0, 0]];
        let owner = [0, 0, 1, 1];
        let costs = unit_costs(1.0);
        let serial = costs.serial();
        let time = |flags: [bool; 4], c: &ShadowCosts| shadowed_step_time(&counts, &owner, &flags, c);
        // Expert 0 shadowed: each rank computes 14 rows and exchanges 4 each way (16), plus
        // 2 for the shadow: 18 overlapped, 14 + 16 + 2 = 32 serial.
        assert_eq!(time([true, false, false, false], &costs), 18.0);
        assert_eq!(time([true, false, false, false], &serial), 32.0);
        // Experts 0 and 1: rank 1 computes 18 rows, rank 0's 4 rows to expert 2 still cross:
        // 18 + 4 = 22 overlapped, 18 + 16 + 4 = 38 serial. A search that stopped at the
        // first shadow that does not pay would stop here.
        assert_eq!(time([true, true, false, false], &costs), 22.0);
        assert_eq!(time([true, true, false, false], &serial), 38.0);
        // Experts 0, 1 and 2: nothing crosses, each rank computes its own 14 rows, plus 6.
        assert_eq!(time([true, true, true, false], &costs), 20.0);
        assert_eq!(time([true, true, true, false], &serial), 20.0);
        // So the overlapped pipeline shadows expert 0 alone (the exchange hides behind
        // compute), the serial one the three hot experts.
        assert_eq!(choose_shadows(&counts, &owner, &costs, 3), vec![0]);
        assert_eq!(choose_shadows(&counts, &owner, &serial, 3), vec![0, 1, 2]);
    }

    #[test]
    fn balanced_routing_shadows_nothing() {
        // Four ranks, one expert each, every rank sends one row to every expert: no rank is
        // hotter than another, so while one expert stays unshadowed (the layer's limit,
        // `n_experts - 1`) its owner still receives every rank's rows of it, and any shadow
        // only adds its traffic, on either executor.
        let counts = vec![vec![1; 4]; 4];
        let owner = [0, 1, 2, 3];
        let costs = unit_costs(0.01);
        assert!(choose_shadows(&counts, &owner, &costs, 3).is_empty());
        assert!(choose_shadows(&counts, &owner, &costs.serial(), 3).is_empty());
        // With every expert allowed and weights this light, all four replicated is the
        // data-parallel layer: nothing crosses (4 + 8 · 0.01 against an exchange of 12).
        assert_eq!(choose_shadows(&counts, &owner, &costs, 4).len(), 4);
    }

    #[test]
    fn all_rows_to_one_expert_shadow_it_when_its_weights_are_light() {
        // Every rank sends 100 rows to expert 2 (on rank 2) and nothing else.
        let counts = vec![vec![0, 0, 100, 0]; 4];
        let owner = [0, 1, 2, 3];
        // Unshadowed: rank 2 receives 300 rows (exchange 1,200) and computes 400. Shadowed:
        // each rank computes its own 100, nothing crosses, plus 2 · 1 for the weights.
        assert_eq!(choose_shadows(&counts, &owner, &unit_costs(1.0), 4), vec![2]);
        // The same rows with weights heavier than what shadowing saves (2 · 600 > 1,200 - 100).
        assert!(choose_shadows(&counts, &owner, &unit_costs(600.0), 4).is_empty());
    }

    #[test]
    fn the_limit_caps_the_shadows_and_the_order_follows_the_load() {
        // Two hot experts on rank 0 (experts 0 and 1), the hotter first; rank 1 owns expert 2.
        let counts = vec![vec![50, 40, 0], vec![50, 40, 0]];
        let owner = [0, 0, 1];
        let costs = unit_costs(1.0);
        assert_eq!(choose_shadows(&counts, &owner, &costs, 3), vec![0, 1]);
        assert_eq!(choose_shadows(&counts, &owner, &costs, 1), vec![0]);
        assert!(choose_shadows(&counts, &owner, &costs, 0).is_empty());
    }

    #[test]
    fn costs_from_a_profile_count_three_passes_of_each_gemm() {
        let profile = Profile::h100_node(2);
        let costs = ShadowCosts::from_profile(&profile, 1024, 4096, 2, 4);
        let flops = 3.0 * 2.0 * 2.0 * 1024.0 * 4096.0;
        assert!((costs.row_seconds - flops / profile.w_comp).abs() <= 1e-12 * costs.row_seconds.abs());
        assert_eq!(costs.row_bytes, 4096.0);
        assert_eq!(costs.weight_bytes, 2.0 * 1024.0 * 4096.0 * 4.0);
    }

    proptest::proptest! {
        /// The incremental search against its twin, every `k` recounted with
        /// [`shadowed_step_time`]: the same experts for any counts, owners in blocks, costs and
        /// executor. A load update that moved a row wrongly (or forgot the rows a rank routes
        /// to its own expert) picks other experts on some input.
        #[test]
        fn the_incremental_search_picks_what_recounting_every_k_picks(
            n_ranks in 1usize..6,
            per_rank in 1usize..4,
            seed in proptest::collection::vec(0usize..60, 120),
            weight in 0.01f64..50.0,
            overlapped in proptest::bool::ANY,
            limit_cut in 0usize..3,
        ) {
            let n_experts = n_ranks * per_rank;
            let counts: Vec<Vec<usize>> = (0..n_ranks)
                .map(|r| (0..n_experts).map(|e| seed[(r * n_experts + e) % seed.len()]).collect())
                .collect();
            let owner: Vec<usize> = (0..n_experts).map(|e| e / per_rank).collect();
            let costs = ShadowCosts { overlapped, ..unit_costs(weight) };
            let limit = n_experts.saturating_sub(limit_cut);
            let order = hottest_experts(&counts, n_experts, limit);
            let mut twin = (f64::INFINITY, 0);
            for k in 0..=order.len() {
                let mut flags = vec![false; n_experts];
                order[..k].iter().for_each(|&e| flags[e] = true);
                let time = shadowed_step_time(&counts, &owner, &flags, &costs);
                if time < twin.0 {
                    twin = (time, k);
                }
            }
            proptest::prop_assert_eq!(choose_shadows(&counts, &owner, &costs, limit), order[..twin.1].to_vec());
        }
    }

    #[test]
    #[should_panic(expected = "owner is rank 2, with 2 ranks")]
    fn an_owner_outside_the_ranks_is_a_contract_violation() {
        let _ = choose_shadows(&[vec![1, 1], vec![1, 1]], &[0, 2], &unit_costs(1.0), 2);
    }
}
