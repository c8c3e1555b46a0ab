//! Tuning: Algorithm 1 with a fake timer, the cost model on synthetic profiles, the
//! simulator's trends on the paper's cluster. (The planner's JSON against Eq. 1–9 by hand is
//! in tools/tests/cli.rs, where the command-line tool lives.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{Distribution, Tensor};
use mpipemoe::memory::{Execution, ExpertRoute, LayerShape, Strategy, MODEL_HEADROOM};
use mpipemoe::sim::{simulate, sweep};
use mpipemoe::tuning::{search_best_gran, CostModel, GranularityTable, Lookup, Profile, TrialTimer};
use mpipemoe::{LocalGroup, MemoryReuse, MoeError, MoeLayerConfig, Partitions};

type B = Autodiff<NdArray>;

/// A GPU's default execution at one rank: the experts on the primitives, in issue order.
const GPUS: Execution = Execution {
    route: ExpertRoute::ExpertByExpert,
    threaded: false,
};

/// A timer that runs nothing: a trial of `n` partitions for `B` tokens "takes"
/// `B / n + cost_per_partition · n` (minimised at `n = sqrt(B / cost_per_partition)`, so the
/// best `n` grows with `B`), plus an optional per-call noise table. Counts its calls.
#[derive(Debug, Default)]
struct FakeTimer {
    cost_per_partition: f64,
    calls: AtomicUsize,
    /// `(tokens, n)` whose time is replaced, to inject non-monotone noise.
    overrides: Vec<((usize, usize), f64)>,
}

impl FakeTimer {
    fn new(cost_per_partition: f64) -> Self {
        Self {
            cost_per_partition,
            ..Self::default()
        }
    }
}

impl TrialTimer for FakeTimer {
    fn time(
        &self,
        tokens: usize,
        n: usize,
        _run: &mut dyn FnMut() -> mpipemoe::Result<()>,
    ) -> mpipemoe::Result<Duration> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let t = self
            .overrides
            .iter()
            .find(|(key, _)| *key == (tokens, n))
            .map(|(_, t)| *t)
            .unwrap_or(tokens as f64 / n as f64 + self.cost_per_partition * n as f64);
        Ok(Duration::from_secs_f64(t * 1e-6))
    }
}

const CANDIDATES: [usize; 5] = [1, 2, 4, 8, 16];

fn lookup(table: &mut GranularityTable, timer: &FakeTimer, tokens: usize) -> (usize, Lookup) {
    table
        .lookup(tokens, |b| {
            search_best_gran(b, &CANDIDATES, timer, &mut |_| Ok(()), &mut |_| Ok(())).map(|(n, _)| n)
        })
        .unwrap()
}

fn assert_disjoint_and_monotone(table: &GranularityTable) {
    for pair in table.ranges().windows(2) {
        let ((_, hi, n), (lo, _, m)) = (pair[0], pair[1]);
        assert!(hi < lo, "ranges overlap: {pair:?}");
        assert!(n < m, "n is not increasing in B: {pair:?}");
    }
}

#[test]
fn algorithm_1_keeps_ranges_disjoint_monotone_and_searches_once() {
    let timer = FakeTimer::new(400.0);
    let mut table = GranularityTable::new();
    // A scrambled order of batch sizes from 1k to 64k.
    let sizes: Vec<usize> = (0..40).map(|i| 1000 + (i * 17) % 40 * 1600).collect();
    for &b in &sizes {
        lookup(&mut table, &timer, b);
        assert_disjoint_and_monotone(&table);
    }
    // The best n really is argmin of the fake cost, and grows with B.
    for &b in &sizes {
        let (n, how) = lookup(&mut table, &timer, b);
        assert_eq!(how, Lookup::Cached);
        let best = *CANDIDATES
            .iter()
            .min_by(|&&x, &&y| {
                (b as f64 / x as f64 + 400.0 * x as f64).total_cmp(&(b as f64 / y as f64 + 400.0 * y as f64))
            })
            .unwrap();
        assert_eq!(n, best, "B={b}");
    }
    // Cache hits never search.
    let calls = timer.calls.load(Ordering::SeqCst);
    for &b in &sizes {
        lookup(&mut table, &timer, b);
    }
    assert_eq!(timer.calls.load(Ordering::SeqCst), calls);
    assert!(
        table.searches() < sizes.len(),
        "ranges should answer some lookups without a search"
    );
}

#[test]
fn a_batch_between_two_points_with_the_same_n_joins_their_range_and_needs_no_search() {
    let timer = FakeTimer::new(400.0);
    let mut table = GranularityTable::new();
    // n = 4 is best for B in about [4800, 9600] under this cost.
    assert_eq!(lookup(&mut table, &timer, 5000).0, 4);
    assert_eq!(lookup(&mut table, &timer, 9000).0, 4);
    assert_eq!(table.ranges(), vec![(5000, 9000, 4)]);
    let searches = table.searches();
    let (n, how) = lookup(&mut table, &timer, 7000);
    assert_eq!((n, how), (4, Lookup::Range));
    assert_eq!(table.searches(), searches);
    // A larger B with a larger n gets its own range above.
    assert_eq!(lookup(&mut table, &timer, 30000).0, 8);
    assert_eq!(table.ranges(), vec![(5000, 9000, 4), (30000, 30000, 8)]);
}

#[test]
fn a_non_monotone_search_is_cached_but_does_not_break_the_ranges() {
    let mut timer = FakeTimer::new(400.0);
    // At B = 20000 the timings claim n = 1 is fastest: impossible under the hypothesis.
    timer.overrides = vec![((20000, 1), 0.5)];
    let mut table = GranularityTable::new();
    lookup(&mut table, &timer, 5000);
    lookup(&mut table, &timer, 40000);
    let before = table.ranges();
    assert_eq!(lookup(&mut table, &timer, 20000).0, 1);
    assert_eq!(table.ranges(), before);
    assert_eq!(lookup(&mut table, &timer, 20000), (1, Lookup::Cached));
    assert_disjoint_and_monotone(&table);
}

#[test]
fn the_table_round_trips_through_json_and_rejects_overlaps() {
    let timer = FakeTimer::new(400.0);
    let mut table = GranularityTable::new();
    for b in [2000, 6000, 30000, 60000] {
        lookup(&mut table, &timer, b);
    }
    let restored = GranularityTable::from_json(&table.to_json()).unwrap();
    assert_eq!(restored, table);
    let bad = r#"{"cache":{},"ranges":{"100":[500,2],"400":[900,4]}}"#;
    let err = GranularityTable::from_json(bad).unwrap_err();
    assert!(err.to_string().contains("overlap"), "{err}");
}

#[test]
fn adaptive_partitions_in_the_layer_search_once_and_stay_exact() {
    let device = Default::default();
    let config = MoeLayerConfig::new(8, 16, 4, 2)
        .with_seed(5)
        .with_partitions(Partitions::Adaptive);
    let timer = Arc::new(FakeTimer::new(2.0));
    // Two ranks: both must pick the same n (their timings are summed before the choice).
    let results = LocalGroup::run(2, |ctx| {
        let layer = config.init_rank::<B>(&device, ctx.comm.clone())?;
        layer.context().set_trial_timer(timer.clone());
        let fixed = layer
            .clone()
            .with_config(config.clone().with_partitions(Partitions::Fixed(1)))?;
        let x = Tensor::<B, 2>::random([24, 8], Distribution::Default, &device);
        let first = layer.try_forward(x.clone())?;
        let second = layer.try_forward(x.clone())?;
        let reference = fixed.try_forward(x)?;
        let diff = (first.output.clone() - reference.output)
            .abs()
            .max()
            .into_scalar();
        Ok((
            first.stats.n_partitions,
            second.stats.n_partitions,
            diff,
            layer.context().granularity_table().searches(),
        ))
    })
    .unwrap();
    // 48 tokens over the group: the fake's best n among 1..16 for B = 48 and cost 2 per
    // partition is 4 (48/4 + 8 = 20 < 48/8 + 16 = 22 < 48/2 + 4 = 28).
    for (first, second, diff, searches) in results {
        assert_eq!((first, second), (4, 4));
        assert_eq!(searches, 1, "the second call with the same B must not search");
        assert!(diff < 1e-5, "adaptive n changed the output by {diff}");
    }
}

/// A profile with unit speeds, so each stream term is just its work.
fn synthetic(w_comp: f64, w_comm: f64, w_mem: f64) -> Profile {
    Profile {
        name: "synthetic".into(),
        w_comp,
        gemm_half_rows: 0.0,
        comp_latency: 0.0,
        w_comm,
        comm_latency: 0.0,
        w_mem,
        mem_latency: 0.0,
        sigma: 1.0,
        mu_comp: 1.0,
        mu_all: 1.0,
        eta_all: 1.0,
        sources: Default::default(),
    }
}

fn shape(tokens: usize, m: usize, h: usize, n_ranks: usize, n: usize) -> LayerShape {
    LayerShape::paper(tokens, m, h, n_ranks, n)
}

#[test]
fn table_iii_q_vectors_for_the_papers_shapes() {
    // H = 4M (all Table I models): Table III exactly.
    let q = |s| CostModel::q(s, 1024, 4096);
    assert_eq!(q(Strategy::None), ([2.0, 2.0, 0.0], [4.0, 2.0, 0.0]));
    assert_eq!(q(Strategy::S1), ([2.0, 2.0, 5.0], [4.0, 2.0, 5.0]));
    assert_eq!(q(Strategy::S2), ([2.0, 2.0, 4.0], [4.0, 3.0, 4.0]));
    assert_eq!(q(Strategy::S3), ([2.0, 2.0, 1.0], [5.0, 2.0, 1.0]));
    assert_eq!(q(Strategy::S4), ([2.0, 2.0, 0.0], [5.0, 3.0, 0.0]));
}

#[test]
fn compute_bound_makes_recomputation_lose_and_comm_bound_makes_recommunication_lose() {
    let s = shape(4096, 1024, 4096, 8, 4);
    let cost = |profile: Profile, strategy| CostModel::new(profile).cost(strategy, &s, 4, GPUS).cost;
    // Compute-bound: GEMMs are slow, links and copies are fast.
    let compute_bound = synthetic(1e9, 1e15, 1e15);
    for recompute in [Strategy::S3, Strategy::S4] {
        for offload in [Strategy::S1, Strategy::S2] {
            assert!(cost(compute_bound.clone(), recompute) > cost(compute_bound.clone(), offload));
        }
    }
    // Comm-bound: the all-to-all is slow.
    let comm_bound = synthetic(1e18, 1e6, 1e15);
    for recomm in [Strategy::S2, Strategy::S4] {
        for keep in [Strategy::S1, Strategy::S3] {
            assert!(cost(comm_bound.clone(), recomm) > cost(comm_bound.clone(), keep));
        }
    }
}

#[test]
fn the_choice_changes_exactly_where_the_max_terms_cross() {
    // Among S1 (5 copy units each way) and S4 (one more GEMM and one more all-to-all in
    // backward, no copies), with all-to-alls free: S4 costs 2 + 5 GEMM units, S1 costs
    // max(2, 5β) + max(4, 5β), which is 5β + 4 for 0.4 <= β <= 0.8. They cross at β = 0.6:
    // S1 wins below, S4 above.
    let (m, h) = (1024usize, 4096usize);
    let s = shape(4096, m, h, 8, 4);
    let gemm_unit = 2.0 * (m * h) as f64 / 1e12; // seconds per row at 1 TFLOP/s
    let copy_rate_for = |beta: f64| (m * 4) as f64 / (beta * gemm_unit);
    let pick = |beta: f64| {
        let model = CostModel::new(synthetic(1e12, 1e18, copy_rate_for(beta)));
        let s1 = model.cost(Strategy::S1, &s, 4, GPUS).cost;
        let s4 = model.cost(Strategy::S4, &s, 4, GPUS).cost;
        if s1 < s4 {
            Strategy::S1
        } else {
            Strategy::S4
        }
    };
    assert_eq!(pick(0.3), Strategy::S1);
    assert_eq!(pick(0.59), Strategy::S1);
    assert_eq!(pick(0.61), Strategy::S4);
    assert_eq!(pick(2.0), Strategy::S4);
}

#[test]
fn auto_picks_the_cheapest_strategy_that_fits_the_budget() {
    let s = shape(4096, 1024, 4096, 8, 4);
    let model = CostModel::new(Profile::a100_cluster(64));
    // No budget: no reuse is cheapest.
    assert_eq!(model.choose(&s, 4, None, GPUS).unwrap().best, Strategy::None);
    // A budget below no-reuse's peak forces a reuse strategy whose peak fits.
    let none_peak = model.cost(Strategy::None, &s, 4, GPUS).peak_bytes;
    let budget = none_peak * 0.9;
    let choice = model.choose(&s, 4, Some(budget), GPUS).unwrap();
    assert_ne!(choice.best, Strategy::None);
    let chosen = choice
        .candidates
        .iter()
        .find(|c| c.strategy == choice.best)
        .unwrap();
    assert!(chosen.peak_bytes * MODEL_HEADROOM <= budget);
    assert!(choice
        .candidates
        .iter()
        .filter(|c| c.fits)
        .all(|c| c.cost >= chosen.cost));
    assert!(choice.explain().contains("chosen:"));
    // A budget the peak fits but not with the model's headroom: as the layer's budget
    // decides, no reuse does not fit.
    let bare = model.choose(&s, 4, Some(none_peak * 1.05), GPUS).unwrap();
    assert!(!bare.candidates[0].fits);
    assert_ne!(bare.best, Strategy::None);
    assert!(
        model
            .choose(&s, 4, Some(none_peak * MODEL_HEADROOM), GPUS)
            .unwrap()
            .candidates[0]
            .fits
    );
    // Nothing fits a tiny budget: a memory error that says what would.
    match model.choose(&s, 4, Some(1.0), GPUS) {
        Err(MoeError::Memory(msg)) => assert!(msg.contains("smallest modelled peak"), "{msg}"),
        other => panic!("expected a memory error, got {other:?}"),
    }
}

/// `MoeLayer::strategy_choice` under a budget answers what the layer's budget decides for a
/// batch with balanced routing: the same strategy, each candidate's peak the decision's on
/// the layer's own route and executor (Flex runs its experts as tasks, which hold otherwise
/// than the primitives' expert by expert), and `fits` with the model's headroom.
#[test]
fn the_layers_strategy_choice_is_what_its_budget_decides() {
    use burn::backend::Flex;
    use burn::tensor::TensorData;
    use mpipemoe::memory::rank_peak_bytes;
    type F = Autodiff<Flex>;

    const M: usize = 16;
    const TOKENS: usize = 64;
    let device = Default::default();
    let config = MoeLayerConfig::new(M, 64, 4, 1)
        .with_seed(4)
        .with_partitions(Partitions::Fixed(4))
        .with_memory_reuse(MemoryReuse::Auto);
    // Token t goes to expert t mod 4: its router logit there is 10, elsewhere 0 (the router
    // reads the first four columns only), so every expert gets a quarter of every partition,
    // as the balanced model assumes.
    let mut weights = config
        .init::<NdArray>(&Default::default())
        .gather_tensor_map()
        .unwrap()
        .unwrap();
    let router: Vec<f32> = (0..4 * M).map(|i| f32::from(i / M == i % M)).collect();
    weights.insert("router.weight".into(), TensorData::new(router, [4, M]));
    let x: Vec<f32> = (0..TOKENS * M)
        .map(|i| match (i / M, i % M) {
            (t, c) if c == t % 4 => 10.0,
            (_, c) if c < 4 => 0.0,
            (t, c) => ((t * 7 + c * 3) % 11) as f32 / 11.0 - 0.5,
        })
        .collect();
    let x = Tensor::<F, 2>::from_data(TensorData::new(x, [TOKENS, M]), &device);
    let layer = |budget: Option<usize>| {
        let layer = mpipemoe::MoeLayer::<F>::from_tensor_map(
            &config.clone().with_memory_budget(budget),
            &weights,
            std::path::Path::new("test"),
            &device,
            Arc::new(mpipemoe::comm::SingleRank),
        )
        .unwrap();
        layer.context().set_profile(Profile::a100_cluster(1));
        layer
    };
    let none = layer(None).strategy_choice(TOKENS, 4).unwrap();
    let none_peak = none.candidates[0].peak_bytes;
    // On the tasks' route, which the primitives' peak does not describe.
    let shape = LayerShape {
        tokens: TOKENS,
        top_k: 1,
        d_model: M,
        d_hidden: 64,
        activation: mpipemoe::Activation::Gelu,
        shared_expert: None,
        shared_expert_gate: false,
        shared_expert_overlap: false,
        weights_on_input: false,
        n_experts: 4,
        n_ranks: 1,
        n_partitions: 4,
    };
    let primitives = rank_peak_bytes(
        &shape,
        &mpipemoe::memory::RankRows::balanced(&shape),
        Strategy::None,
        GPUS,
        4,
    );
    assert!(
        (none_peak - primitives).abs() > 0.01 * primitives,
        "the layer's route: {none_peak} against the primitives' {primitives}"
    );
    // Each candidate's peak with 5% to spare, which the headroom refuses, and with the
    // headroom, which it takes: a refusal where nothing fits, the same choice elsewhere.
    let budgets = none
        .candidates
        .iter()
        .flat_map(|c| [c.peak_bytes * 1.05, c.peak_bytes * MODEL_HEADROOM + 1.0]);
    let mut chosen_by_memory = std::collections::BTreeSet::new();
    for budget in budgets {
        let budget = budget as usize;
        let layer = layer(Some(budget));
        let (choice, out) = (layer.strategy_choice(TOKENS, 4), layer.try_forward(x.clone()));
        let (choice, out) = match (choice, out) {
            (Err(MoeError::Memory(_)), Err(MoeError::Memory(_))) => continue,
            (Ok(choice), Ok(out)) => (choice, out),
            (choice, out) => panic!(
                "budget {budget}: the choice {choice:?}, the layer {:?}",
                out.map(|o| o.stats)
            ),
        };
        let decision = out.stats.memory.expect("a budget reports its decision");
        assert_eq!(decision.n_partitions, 4);
        assert_eq!(
            choice.best,
            decision.strategy,
            "budget {budget}: {}",
            choice.explain()
        );
        assert_eq!(choice.execution.route, decision.route);
        let chosen = choice
            .candidates
            .iter()
            .find(|c| c.strategy == choice.best)
            .unwrap();
        assert_eq!(chosen.peak_bytes, decision.peak_bytes[0], "budget {budget}");
        assert!(chosen.fits);
        chosen_by_memory.insert(choice.best.name());
    }
    // The budgets reached more than one choice (else they tested little).
    assert!(chosen_by_memory.len() >= 2, "{chosen_by_memory:?}");
}

#[test]
fn auto_in_the_layer_uses_the_profile_and_stays_exact() {
    let device = Default::default();
    let base = MoeLayerConfig::new(8, 32, 2, 1)
        .with_seed(2)
        .with_partitions(Partitions::Fixed(4));
    let layer = base
        .clone()
        .with_memory_reuse(MemoryReuse::Auto)
        .init::<B>(&device);
    layer.context().set_profile(Profile::a100_cluster(8));
    let x = Tensor::<B, 2>::random([32, 8], Distribution::Default, &device);
    let none = layer.forward(x.clone());
    assert_eq!(none.stats.strategy, Strategy::None);
    // With a budget just below no reuse's modelled peak, the layer must reuse memory.
    let choice = layer.strategy_choice(32, 4).unwrap();
    let none_peak = choice.candidates[0].peak_bytes;
    let tight = layer
        .clone()
        .with_config(
            base.clone()
                .with_memory_reuse(MemoryReuse::Auto)
                .with_memory_budget(Some(none_peak as usize - 1)),
        )
        .unwrap();
    let out = tight.forward(x.clone());
    assert_ne!(out.stats.strategy, Strategy::None);
    let diff = (out.output - none.output).abs().max().into_scalar();
    assert!(diff < 1e-6);
}

#[test]
fn the_simulator_replays_a_serial_schedule_exactly_at_n_1() {
    // n = 1 without reuse has no overlap: S, C, R, then S', C', R' one after another.
    let profile = Profile {
        comm_latency: 1e-5,
        comp_latency: 2e-5,
        ..synthetic(1e12, 1e10, 1e10)
    };
    let s = shape(1000, 256, 1024, 4, 1);
    let r = simulate(&s, Strategy::None, &profile, 4);
    let comm = 1e-5 + 1000.0 * 256.0 * 4.0 / 1e10;
    let gemm = |count: f64| 2e-5 + count * 2.0 * 1000.0 * 256.0 * 1024.0 / 1e12;
    let want = 4.0 * comm + gemm(2.0) + gemm(4.0);
    assert!((r.time - want).abs() < 1e-12, "{} vs {want}", r.time);
}

#[test]
fn on_the_papers_cluster_the_best_n_rises_with_b() {
    // GPT3-XL on 64 A100s (8 DGX nodes), the paper's Fig. 11 setting.
    let profile = Profile::a100_cluster(64);
    let best_n = |b: usize| {
        let s = shape(b, 2048, 8192, 64, 1);
        sweep(&s, &[1, 2, 4, 8, 16], &[Strategy::None], &profile, 4)[0].n_partitions
    };
    let mut last = 0;
    let mut report = Vec::new();
    for b in [1024, 2048, 4096, 8192, 12288, 16384, 22528, 32768, 49152, 65536] {
        let best = best_n(b);
        report.push(format!("B={b}: n={best}"));
        assert!(best >= last, "best n fell from {last} to {best} at B={b}");
        last = best;
    }
    eprintln!(
        "simulated best n (GPT3-XL, a100-cluster-64): {}",
        report.join(", ")
    );
    // The paper's Fig. 11, where it is clear: n = 2 at 4k tokens, 4 at 16k, 8 at 64k. A
    // constant answer, or one that does not grow with B, fails here.
    assert_eq!(best_n(4096), 2, "{report:?}");
    assert_eq!(best_n(16384), 4, "{report:?}");
    assert_eq!(best_n(65536), 8, "{report:?}");
}

#[test]
fn strategy_ranking_at_8_and_64_gpus_is_reported() {
    // The paper observes S1/S2 ahead at N = 8 and S4 ahead at N = 32 or 64. The model is
    // reported here, not forced: see BENCHMARKS.md for why it disagrees at N = 8.
    for n_gpus in [8, 32, 64] {
        let profile = Profile::a100_cluster(n_gpus);
        let s = shape(16384, 2048, 8192, n_gpus, 4);
        let mut ranked: Vec<(String, f64)> = [Strategy::S1, Strategy::S2, Strategy::S3, Strategy::S4]
            .into_iter()
            .map(|st| (st.name().to_string(), simulate(&s, st, &profile, 4).time * 1e3))
            .collect();
        ranked.sort_by(|a, b| a.1.total_cmp(&b.1));
        eprintln!("N={n_gpus}: {ranked:?}");
        if n_gpus == 64 {
            // The paper: at 64 GPUs (8 nodes) S4 is best, and recomputation beats offloading
            // because host copies contend with the inter-node all-to-all.
            let names: Vec<&str> = ranked.iter().map(|r| r.0.as_str()).collect();
            assert_eq!(
                names[0], "s4",
                "at N = 64 S4 should be first, as in the paper: {ranked:?}"
            );
            assert!(
                names[..2].contains(&"s3") && names[2..].contains(&"s1") && names[2..].contains(&"s2"),
                "at N = 64 the recomputing strategies should lead the offloading ones: {ranked:?}"
            );
        }
        if n_gpus >= 32 {
            assert_eq!(
                ranked[0].0, "s4",
                "at N = {n_gpus} the simulator should put S4 first, as the paper does"
            );
        }
    }
}

/// A communicator that counts the collectives it carries, by name.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn mpipemoe::Communicator>,
    calls: std::sync::Mutex<std::collections::BTreeMap<&'static str, usize>>,
}

impl mpipemoe::Communicator for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn n_ranks(&self) -> usize {
        self.inner.n_ranks()
    }

    fn exchange(
        &self,
        op: &'static str,
        outgoing: Vec<mpipemoe::comm::Payload>,
    ) -> mpipemoe::Result<Vec<mpipemoe::comm::Payload>> {
        *self.calls.lock().unwrap().entry(op).or_default() += 1;
        self.inner.exchange(op, outgoing)
    }
}

/// Algorithm 1 through the layer's own exchange, timed on the wall clock, on 2 ranks: every
/// trial really runs the exchange forward and backward (counted all-to-alls), both ranks pick
/// the same `n`, the second batch of the same size does not search, and the output is the
/// unpartitioned one.
#[test]
fn adaptive_partitions_time_real_trials_through_the_exchange() {
    let device = Default::default();
    let config = MoeLayerConfig::new(16, 32, 4, 2)
        .with_seed(8)
        .with_partitions(Partitions::Adaptive)
        .with_adaptive_candidates(vec![1, 2, 4]);
    let results = LocalGroup::run(2, |ctx| {
        let counting = Arc::new(Counting {
            inner: ctx.comm.clone(),
            calls: Default::default(),
        });
        let layer = config.init_rank::<B>(&device, counting.clone())?;
        let fixed = layer
            .clone()
            .with_config(config.clone().with_partitions(Partitions::Fixed(1)))?;
        let x = Tensor::<B, 2>::random([40, 16], Distribution::Default, &device);
        let a2a = || {
            counting
                .calls
                .lock()
                .unwrap()
                .get("all_to_all_v")
                .copied()
                .unwrap_or(0)
        };
        let reduces = || {
            counting
                .calls
                .lock()
                .unwrap()
                .get("all_reduce_sum")
                .copied()
                .unwrap_or(0)
        };
        let first = layer.try_forward(x.clone())?;
        let after_first = (a2a(), reduces());
        let second = layer.try_forward(x.clone())?;
        let after_second = a2a();
        let reference = fixed.try_forward(x)?;
        let diff = (first.output.clone() - reference.output)
            .abs()
            .max()
            .into_scalar();
        Ok((
            first.stats.n_partitions,
            second.stats.n_partitions,
            after_first,
            after_second,
            diff,
        ))
    })
    .unwrap();
    // The default wall clock runs each candidate once untimed and three times timed; a trial
    // of n partitions makes 2n all-to-alls forward and 2n backward. Then the batch itself
    // dispatches and combines its n partitions.
    let trials: usize = [1, 2, 4].iter().map(|&c| 4 * 4 * c).sum();
    for (rank, (first, second, (a2a, reduces), after_second, diff)) in results.iter().enumerate() {
        assert_eq!(first, &results[0].0, "rank {rank} chose another n");
        assert_eq!(second, first);
        assert_eq!(
            *a2a,
            trials + 2 * first,
            "rank {rank}: all-to-alls of the trials and the batch"
        );
        assert_eq!(*reduces, 1, "the trial times are summed over ranks once");
        assert_eq!(
            after_second - a2a,
            2 * first,
            "the second batch must not search again"
        );
        assert!(*diff < 1e-5, "adaptive n changed the output by {diff}");
    }
}
