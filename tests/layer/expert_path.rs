//! The device library hook of the experts' compute (`ExpertPath`): the plain-primitive twin
//! (`ComposedExperts`) behind a communicator's paths, so the plumbing a cuBLAS path relies on
//! (block layouts, `T_M` kept or recomputed, the weight gradients added into stacked running
//! sums over partitions, shadow slots folded onto their owners) is held to every reference case
//! where no GPU library runs, outputs and every gradient.
//!
//! `cargo test -p mpipemoe --features testkit --test layer expert_path`

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, NdArray};
use burn::tensor::ops::FloatTensor;
use mpipemoe::backend::{
    ComposedExperts, ExpertBackward, ExpertBackwardOut, ExpertForward, ExpertGroups, ExpertPath,
};
use mpipemoe::comm::{HostRows, RowExchange, RowPaths, WithRowPaths};
use mpipemoe::harness::{check_case, check_case_through, Case, CheckOptions, CheckReport};
use mpipemoe::memory::Strategy;
use mpipemoe::{
    Communicator, ExchangePath, GemmPrecision, LocalGroup, MoeError, Partitions, Result, Shadowing,
};

type B = Autodiff<NdArray>;

/// The twin, counting the partitions it computed forward and backward, the values it made in
/// the pass stores (`ExpertGroups::pass`) and in the step stores (`ExpertGroups::step`), as a
/// path that prepares something from the weights once per pass, or once per step, would, and
/// the products of each call of `matmuls` (one section each on CUDA).
#[derive(Debug, Default)]
struct Counted {
    forward: AtomicUsize,
    backward: AtomicUsize,
    made: AtomicUsize,
    made_for_step: AtomicUsize,
    batches: Mutex<Vec<usize>>,
    /// Single dense products (`matmul`: the router's forward).
    products: AtomicUsize,
    /// Leaves the dense products to the backend (`multiplies_dense` false).
    experts_only: bool,
}

/// What `Counted` keeps in a pass's store.
struct Prepared;

impl Counted {
    fn prepare(&self, experts: &ExpertGroups<NdArray>) -> Result<()> {
        experts.pass.get_or_make(|| {
            self.made.fetch_add(1, Ordering::Relaxed);
            Ok(Prepared)
        })?;
        experts.step.get_or_make(|| {
            self.made_for_step.fetch_add(1, Ordering::Relaxed);
            Ok(Prepared)
        })?;
        Ok(())
    }
}

impl ExpertPath<NdArray> for Counted {
    fn forward(
        &self,
        job: ExpertForward<'_, NdArray>,
    ) -> Result<(FloatTensor<NdArray>, FloatTensor<NdArray>)> {
        self.forward.fetch_add(1, Ordering::Relaxed);
        self.prepare(job.experts)?;
        ComposedExperts.forward(job)
    }

    fn backward(&self, job: ExpertBackward<'_, NdArray>) -> Result<ExpertBackwardOut<NdArray>> {
        self.backward.fetch_add(1, Ordering::Relaxed);
        self.prepare(job.experts)?;
        ComposedExperts.backward(job)
    }

    fn matmul(
        &self,
        lhs: FloatTensor<NdArray>,
        rhs: FloatTensor<NdArray>,
        _precision: GemmPrecision,
    ) -> Result<FloatTensor<NdArray>> {
        use burn::tensor::ops::FloatTensorOps;
        self.products.fetch_add(1, Ordering::Relaxed);
        Ok(<NdArray as FloatTensorOps<NdArray>>::float_matmul(lhs, rhs))
    }

    fn matmuls(
        &self,
        pairs: Vec<(FloatTensor<NdArray>, FloatTensor<NdArray>)>,
        _precision: GemmPrecision,
    ) -> Result<Vec<FloatTensor<NdArray>>> {
        self.batches.lock().unwrap().push(pairs.len());
        Ok(products(pairs))
    }

    fn multiplies_dense(&self) -> bool {
        !self.experts_only
    }
}

/// The fused path at `n_ranks` ranks, `n` partitions, `strategy` and `shadowing`.
fn options(n_ranks: usize, n: usize, strategy: Strategy, shadowing: Shadowing) -> CheckOptions {
    CheckOptions {
        path: ExchangePath::Fused,
        n_ranks,
        partitions: Partitions::Fixed(n),
        strategy,
        shadowing,
        ..CheckOptions::default()
    }
}

/// Each pair's product on NdArray, in order: a recording library's `matmuls`.
pub(super) fn products(
    pairs: Vec<(FloatTensor<NdArray>, FloatTensor<NdArray>)>,
) -> Vec<FloatTensor<NdArray>> {
    use burn::tensor::ops::FloatTensorOps;
    pairs
        .into_iter()
        .map(|(lhs, rhs)| <NdArray as FloatTensorOps<NdArray>>::float_matmul(lhs, rhs))
        .collect()
}

/// Every tensor of `a` bit for bit the same in `b`.
pub(super) fn assert_same_bits(a: &CheckReport, b: &CheckReport, what: &str) {
    for (name, values) in &a.tensors {
        let same = values
            .iter()
            .zip(&b.tensors[name])
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{what}: {name} differs");
    }
}

/// The project's reference cases, sorted by file name.
pub(super) fn cases() -> Vec<Case> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/cases");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    files.iter().map(|f| Case::load(f).unwrap()).collect()
}

/// Every case through the hook at ranks 1 to 3, n 1 to 3 and every way `T_M` comes back (kept,
/// offloaded, recomputed, with `T_DI` re-communicated), with and without a shadowed expert:
/// within 1e-4 of the case, the hook taken for every partition of both passes, the router's
/// two backward products in one call, and every tensor bit for bit the layer's own primitive
/// path (the twin multiplies as the backend does, and its
/// running sums add the partitions in the same order). A layout that puts an expert's rows in
/// another's block, a gradient added to the wrong slot, a partition's sum dropped or a shadow's
/// gradient left on its copy fails it.
#[test]
fn every_case_through_the_expert_hook_equals_the_primitive_path() {
    let device = Default::default();
    for case in cases() {
        for (n_ranks, n, strategy, shadowing) in [
            (1, 1, Strategy::None, Shadowing::Off),
            (1, 3, Strategy::S3, Shadowing::Off),
            (2, 2, Strategy::S1, Shadowing::Off),
            (2, 3, Strategy::S4, Shadowing::Fixed(1)),
            (3, 2, Strategy::S2, Shadowing::Fixed(2)),
        ] {
            if !case.config.n_experts.is_multiple_of(n_ranks) {
                continue;
            }
            let options = options(n_ranks, n, strategy, shadowing);
            let counted = Arc::new(Counted::default());
            let paths = RowPaths::new().with_experts::<NdArray>(counted.clone());
            let wrap = |comm: Arc<dyn Communicator>| -> Arc<dyn Communicator> {
                Arc::new(WithRowPaths::adding(comm, paths.clone()))
            };
            let what = format!("{} ranks {n_ranks} n {n} {strategy:?} {shadowing:?}", case.name);
            let through = check_case_through::<B>(&case, &options, &device, &wrap).unwrap();
            let plain = check_case::<B>(&case, &options, &device).unwrap();
            assert!(through.passed(1e-4), "{what}: {:?}", through.worst());
            // At least one partition per rank computes rows, forward and backward.
            assert!(
                counted.forward.load(Ordering::Relaxed) >= n_ranks,
                "{what}: forward hook not taken"
            );
            assert!(
                counted.backward.load(Ordering::Relaxed) >= n_ranks,
                "{what}: backward hook not taken"
            );
            assert_same_bits(&plain, &through, &format!("{what}, against the primitive path"));
            // The router's product needs both its operands' gradients (the input's and the
            // weight's): one library call in each backward, with both products.
            let batches = counted.batches.lock().unwrap().clone();
            assert!(
                !batches.is_empty() && batches.iter().all(|&n| n == 2),
                "{what}: the dense backward's library calls took {batches:?} products"
            );
            // One store per pass: made once per rank and pass, whatever the partitions, and
            // never carried from the forward into the backward.
            let made = counted.made.load(Ordering::Relaxed);
            let calls = counted.forward.load(Ordering::Relaxed) + counted.backward.load(Ordering::Relaxed);
            assert!(
                made <= 2 * n_ranks,
                "{what}: {made} values made for {n_ranks} ranks' two passes"
            );
            if n_ranks == 1 {
                assert_eq!(
                    made, 2,
                    "{what}: the forward and the backward each make their own"
                );
            }
            if n > 1 && n_ranks == 1 {
                assert!(calls > made, "{what}: {calls} partition calls made {made} values");
            }
            // One step store per rank and step: the forward's, found again by its backward.
            let for_step = counted.made_for_step.load(Ordering::Relaxed);
            assert!(
                (1..=n_ranks).contains(&for_step),
                "{what}: {for_step} step values made for {n_ranks} ranks' one step"
            );
        }
    }
}

/// A path that leaves the dense products to the backend (`multiplies_dense` false, as a
/// benchmark sets the CUDA path to time the router on cubecl's kernels) still takes every
/// partition's experts, forward and backward, while the router's products, forward and
/// backward, never reach it; every tensor stays the primitive path's, bit for bit. With the
/// flag ignored the router's product and its backward's call reach the path and it fails.
#[test]
fn a_path_for_the_experts_alone_leaves_the_router_to_the_backend() {
    let device = Default::default();
    let case = &cases()[0];
    let options = options(1, 2, Strategy::S4, Shadowing::Off);
    let counted = Arc::new(Counted {
        experts_only: true,
        ..Counted::default()
    });
    let paths = RowPaths::new().with_experts::<NdArray>(counted.clone());
    let wrap = |comm: Arc<dyn Communicator>| -> Arc<dyn Communicator> {
        Arc::new(WithRowPaths::adding(comm, paths.clone()))
    };
    let through = check_case_through::<B>(case, &options, &device, &wrap).unwrap();
    let plain = check_case::<B>(case, &options, &device).unwrap();
    assert!(
        counted.forward.load(Ordering::Relaxed) >= 1,
        "forward hook not taken"
    );
    assert!(
        counted.backward.load(Ordering::Relaxed) >= 1,
        "backward hook not taken"
    );
    assert_eq!(
        counted.products.load(Ordering::Relaxed),
        0,
        "a dense product reached the path"
    );
    assert!(
        counted.batches.lock().unwrap().is_empty(),
        "the dense backward reached the path"
    );
    assert_same_bits(
        &plain,
        &through,
        &format!("{}, against the primitive path", case.name),
    );
}

/// Flex's own path (its experts side by side over the pool, their weight gradients written
/// into the stacked sums) against the twin put behind the hook on Flex: every case at ranks 1
/// and 2, n 1 and 3, `T_M` kept and recomputed, with a shadowed expert, within 1e-4 of the
/// case and every tensor bit for bit the twin's.
#[test]
fn every_case_on_flexs_own_expert_path_equals_the_twin() {
    type F = Autodiff<burn::backend::Flex>;
    let device = Default::default();
    for case in cases() {
        for (n_ranks, n, strategy, shadowing) in [
            (1, 1, Strategy::None, Shadowing::Off),
            (1, 3, Strategy::S4, Shadowing::Off),
            (2, 3, Strategy::S1, Shadowing::Fixed(1)),
        ] {
            if !case.config.n_experts.is_multiple_of(n_ranks) {
                continue;
            }
            let options = options(n_ranks, n, strategy, shadowing);
            let paths = RowPaths::new().with_experts::<burn::backend::Flex>(Arc::new(ComposedExperts));
            let wrap = |comm: Arc<dyn Communicator>| -> Arc<dyn Communicator> {
                Arc::new(WithRowPaths::adding(comm, paths.clone()))
            };
            let what = format!("{} ranks {n_ranks} n {n} {strategy:?} {shadowing:?}", case.name);
            let twin = check_case_through::<F>(&case, &options, &device, &wrap).unwrap();
            let own = check_case::<F>(&case, &options, &device).unwrap();
            assert!(own.passed(1e-4), "{what}: {:?}", own.worst());
            assert_same_bits(&twin, &own, &format!("{what}, against the twin"));
        }
    }
}

/// A path that fails makes the layer's forward return its error, on every rank, not panic.
#[test]
fn a_failing_path_is_the_layers_error() {
    #[derive(Debug)]
    struct Failing;
    impl ExpertPath<NdArray> for Failing {
        fn forward(
            &self,
            _: ExpertForward<'_, NdArray>,
        ) -> Result<(FloatTensor<NdArray>, FloatTensor<NdArray>)> {
            Err(MoeError::Backend("the library is out of order".into()))
        }
        fn backward(&self, _: ExpertBackward<'_, NdArray>) -> Result<ExpertBackwardOut<NdArray>> {
            Err(MoeError::Backend("the library is out of order".into()))
        }
    }
    let case = cases().remove(0);
    let paths = RowPaths::new().with_experts::<NdArray>(Arc::new(Failing));
    let wrap = |comm: Arc<dyn Communicator>| -> Arc<dyn Communicator> {
        Arc::new(WithRowPaths::adding(comm, paths.clone()))
    };
    let err =
        check_case_through::<B>(&case, &CheckOptions::default(), &Default::default(), &wrap).unwrap_err();
    assert!(err.to_string().contains("out of order"), "{err}");
}

/// `WithRowPaths::adding` keeps what the inner communicator offers (a row path here) beside the
/// added expert path, replaces an inner entry of the same kind and backend, and a sub-group
/// gets the added path on top of its own.
#[test]
fn added_paths_keep_the_inner_ones_and_reach_sub_groups() {
    let results = LocalGroup::run(2, |ctx| {
        let inner: Arc<dyn Communicator> = Arc::new(WithRowPaths::new(
            ctx.comm.clone(),
            RowPaths::new().with::<NdArray>(Arc::new(HostRows) as Arc<dyn RowExchange<NdArray>>),
        ));
        let added: Arc<dyn Communicator> = Arc::new(WithRowPaths::adding(
            inner,
            RowPaths::new().with_experts::<NdArray>(Arc::new(ComposedExperts)),
        ));
        let paths = added.row_paths().expect("paths");
        let both = paths.get::<NdArray>().is_some() && paths.experts::<NdArray>().is_some();
        let other_backend = paths.experts::<burn::backend::Flex>().is_none();
        let sub = added.split(ctx.rank)?;
        let sub_paths = sub.row_paths().expect("sub-group paths");
        Ok((
            both,
            other_backend,
            sub_paths.experts::<NdArray>().is_some(),
            sub_paths.get::<NdArray>().is_some(),
        ))
    })
    .unwrap();
    for r in results {
        assert_eq!(r, (true, true, true, true));
    }
}

/// The precision's spellings round-trip and the default is IEEE f32.
#[test]
fn gemm_precision_names() {
    for p in GemmPrecision::ALL {
        assert_eq!(GemmPrecision::parse(p.name()), Some(p));
        assert_eq!(GemmPrecision::parse(&p.name().to_uppercase()), Some(p));
    }
    assert_eq!(GemmPrecision::parse("fp8"), None);
    assert_eq!(GemmPrecision::default(), GemmPrecision::F32);
}
