//! `shared_expert_overlap`: the shared expert issued while the routing read is in flight,
//! before the plan and the exchange. The same bits as without it, and the order it promises.
//!
//! `cargo test -p mpipemoe --features testkit --test layer shared_overlap`

use std::sync::{Arc, Mutex};

use burn::backend::{Autodiff, Flex, NdArray};
use burn::tensor::ops::FloatTensor;
use mpipemoe::backend::{ComposedExperts, ExpertBackward, ExpertBackwardOut, ExpertForward, ExpertPath};
use mpipemoe::comm::{RowPaths, WithRowPaths};
use mpipemoe::harness::{check_case, check_case_through, Case, CheckOptions};
use mpipemoe::memory::Strategy;
use mpipemoe::{Communicator, GemmPrecision, MoeLayerConfig, Partitions, Result};

use super::expert_path::assert_same_bits;

/// The project's copies of the Hugging Face layers with a shared expert: DeepSeek-V3's
/// (ungated) and Qwen2-MoE's (gated).
fn shared_cases() -> Vec<Case> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf");
    let cases: Vec<Case> = ["deepseek-v3-tiny.layer1", "qwen2-moe-tiny.layer0"]
        .iter()
        .map(|name| Case::load(dir.join(format!("{name}.safetensors"))).unwrap())
        .collect();
    for case in &cases {
        assert!(
            case.config.shared_expert.is_some(),
            "{}: no shared expert",
            case.name
        );
    }
    assert_ne!(
        cases[0].config.shared_expert_gate, cases[1].config.shared_expert_gate,
        "one gated shared expert and one ungated"
    );
    cases
}

fn overlapped(case: &Case) -> Case {
    let mut case = case.clone();
    case.config.shared_expert_overlap = true;
    case
}

/// With the overlap the output and every gradient are the same bits as without it, and within
/// the cases' tolerance: the shared expert's ops are the same ops on the same values, and
/// burn's autodiff runs the backward by depth, which the order of issue does not change. At
/// one and two ranks, one and three partitions, on NdArray and Flex.
#[test]
fn the_overlap_changes_no_bit() {
    fn on<B: mpipemoe::MoeBackend + burn::tensor::backend::AutodiffBackend>(device: &B::Device) {
        for case in shared_cases() {
            for (n_ranks, n) in [(1, 1), (1, 3), (2, 1), (2, 3)] {
                let options = CheckOptions {
                    n_ranks,
                    partitions: Partitions::Fixed(n),
                    strategy: Strategy::S1,
                    ..CheckOptions::default()
                };
                let plain = check_case::<B>(&case, &options, device).unwrap();
                let overlap = check_case::<B>(&overlapped(&case), &options, device).unwrap();
                let what = format!("{} ranks={n_ranks} n={n}", case.name);
                assert_same_bits(&plain, &overlap, &what);
                assert!(overlap.passed(1e-4), "{what}: {:?}", overlap.errors);
            }
        }
    }
    on::<Autodiff<NdArray>>(&Default::default());
    on::<Autodiff<Flex>>(&Default::default());
}

/// A device library that records the order of the layer's calls: `dense` for a dense product
/// (the router's, the shared expert's), `experts` for the experts' forward, and the
/// backwards' calls, which end the forward's list.
#[derive(Debug, Default)]
struct Recorder {
    calls: Mutex<Vec<&'static str>>,
}

impl ExpertPath<NdArray> for Recorder {
    fn forward(
        &self,
        job: ExpertForward<'_, NdArray>,
    ) -> Result<(FloatTensor<NdArray>, FloatTensor<NdArray>)> {
        self.calls.lock().unwrap().push("experts");
        ComposedExperts.forward(job)
    }

    fn backward(&self, job: ExpertBackward<'_, NdArray>) -> Result<ExpertBackwardOut<NdArray>> {
        self.calls.lock().unwrap().push("experts backward");
        ComposedExperts.backward(job)
    }

    fn matmul(
        &self,
        lhs: FloatTensor<NdArray>,
        rhs: FloatTensor<NdArray>,
        _precision: GemmPrecision,
    ) -> Result<FloatTensor<NdArray>> {
        use burn::tensor::ops::FloatTensorOps;
        self.calls.lock().unwrap().push("dense");
        Ok(<NdArray as FloatTensorOps<NdArray>>::float_matmul(lhs, rhs))
    }

    /// The dense products' backwards (both gradients in one call).
    fn matmuls(
        &self,
        pairs: Vec<(FloatTensor<NdArray>, FloatTensor<NdArray>)>,
        _precision: GemmPrecision,
    ) -> Result<Vec<FloatTensor<NdArray>>> {
        self.calls.lock().unwrap().push("dense backward");
        Ok(super::expert_path::products(pairs))
    }
}

/// The forward's calls in order, through the recorder, with and without the overlap.
fn forward_calls(case: &Case) -> Vec<&'static str> {
    let recorder = Arc::new(Recorder::default());
    let paths = RowPaths::new().with_experts::<NdArray>(recorder.clone());
    let wrap = move |comm: Arc<dyn Communicator>| -> Arc<dyn Communicator> {
        Arc::new(WithRowPaths::adding(comm, paths.clone()))
    };
    let report =
        check_case_through::<Autodiff<NdArray>>(case, &CheckOptions::default(), &Default::default(), &wrap)
            .unwrap();
    assert!(report.passed(1e-4), "{}: {:?}", case.name, report.errors);
    let calls = recorder.calls.lock().unwrap().clone();
    let end = calls
        .iter()
        .position(|c| c.ends_with("backward"))
        .expect("a backward");
    calls[..end].to_vec()
}

/// The order the overlap promises: the router's product, then the shared expert's products
/// (two, three with Qwen2-MoE's gate), then the experts, which wait for the plan and so for
/// the routing read; without it the shared expert's products come after the experts.
#[test]
fn the_overlap_issues_the_shared_expert_before_the_experts() {
    for case in shared_cases() {
        let shared = 2 + usize::from(case.config.shared_expert_gate);
        let dense = |n| std::iter::repeat_n("dense", n);
        let plain: Vec<_> = dense(1).chain(["experts"]).chain(dense(shared)).collect();
        let overlap: Vec<_> = dense(1 + shared).chain(["experts"]).collect();
        assert_eq!(forward_calls(&case), plain, "{} without the overlap", case.name);
        assert_eq!(
            forward_calls(&overlapped(&case)),
            overlap,
            "{} with the overlap",
            case.name
        );
    }
}

#[test]
fn the_overlap_needs_a_shared_expert() {
    let config = MoeLayerConfig::new(8, 16, 4, 2).with_shared_expert_overlap(true);
    match config.validate() {
        Err(mpipemoe::MoeError::Config { field, .. }) => assert_eq!(field, "shared_expert_overlap"),
        other => panic!("expected a config error, got {other:?}"),
    }
    assert!(config.with_shared_expert(Some(16)).validate().is_ok());
}
