//! The layer on burn's default GPU backend: `Fusion<CubeBackend<WgpuRuntime>>`, what
//! `burn::backend::Wgpu` is with burn's default features. Every reference case through it
//! (run from `every_case_on_wgpu`, beside the raw backend's run of the same configuration),
//! and a layer trained with burn's optimizer.

use burn::backend::wgpu::WgpuRuntime;
use burn::backend::Autodiff;
use burn::module::AutodiffModule;
use burn::nn::loss::MseLoss;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::{Distribution, Tensor};
use burn_cubecl::CubeBackend;
use burn_fusion::Fusion;
use mpipemoe::backend::RouterKernels;
use mpipemoe::harness::{agreement_error, check_case, expected, Case, CheckOptions, CheckReport};
use mpipemoe::memory::Strategy;
use mpipemoe::{ExchangePath, MoeBackend, MoeLayer, MoeLayerConfig, RoutingRule};

use super::{alone, shared};

/// burn's `Wgpu` with its default features.
pub(super) type FusedWgpu = Fusion<CubeBackend<WgpuRuntime, f32, i32, u32>>;
pub(super) type F = Autodiff<FusedWgpu>;

/// Whether `every_case_on_wgpu` also runs configuration `o` through fusion: the reference
/// path, and the fused exchange in the backend's own order under no reuse and S4 (the two
/// ends of the strategies: nothing released, and everything restored), at every n and rank
/// count it runs.
pub(super) fn covers(o: &CheckOptions) -> bool {
    o.executor.is_none()
        && (o.path == ExchangePath::Reference || matches!(o.strategy, Strategy::None | Strategy::S4))
}

/// Runs `case` under `o` on `Autodiff<Fusion<CubeBackend<WgpuRuntime>>>` and returns what is
/// wrong: more than 1e-4 from the case, or more than 1e-5 (relative to the case's tensor) from
/// `raw`, the raw WGPU backend's report for the same configuration. The second bound is the
/// stricter: a gradient scaled by 1.0001 passes the first and fails it.
pub(super) fn check_through_fusion(
    case: &Case,
    o: &CheckOptions,
    raw: &CheckReport,
    device: &burn::backend::wgpu::WgpuDevice,
) -> Vec<String> {
    let fused = match check_case::<F>(case, o, device) {
        Ok(fused) => fused,
        Err(e) => return vec![e.to_string()],
    };
    let mut failures = Vec::new();
    if !fused.passed(1e-4) {
        failures.push(format!("against the case {:?}", fused.worst()));
    }
    for (name, got) in &fused.tensors {
        let apart = agreement_error(got, &raw.tensors[name], &expected(case, name));
        if apart > 1e-5 {
            failures.push(format!("{name} {apart:.2e} from the raw backend"));
        }
    }
    failures
}

/// The backend's defaults pass through fusion unchanged: the executor the inner backend picks.
#[test]
fn fusion_runs_the_schedule_as_the_inner_backend_does() {
    let _device = shared();
    let device = Default::default();
    assert_eq!(
        <F as MoeBackend>::step_executor(&device),
        <CubeBackend<WgpuRuntime, f32, i32, u32> as MoeBackend>::step_executor(&device)
    );
}

/// A layer in a user's training loop on the fusion backend: burn's optimizer, a loss that mixes
/// the layer's output with fusable ops before and after it, ten steps; the loss falls and the
/// expert weights move, and the inner (inference) backend gives the same output.
#[test]
fn a_layer_trains_under_fusion_with_burns_optimizer() {
    let _device = shared();
    let device = Default::default();
    let config = MoeLayerConfig::new(16, 32, 4, 2);
    let mut layer = config.init::<F>(&device);
    let mut optim = AdamWConfig::new().init::<F, MoeLayer<F>>();
    let x = Tensor::<F, 2>::random([48, 16], Distribution::Normal(0.0, 1.0), &device);
    let target = (x.clone() * 0.5).tanh();
    let w_before = layer.experts.w_in.val().into_data();
    let mut losses = Vec::new();
    for _ in 0..10 {
        let out = layer.forward(x.clone() * 1.0 + 0.0);
        let loss = MseLoss::new().forward(out.output, target.clone(), burn::nn::loss::Reduction::Mean)
            + out.aux_loss;
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &layer);
        layer = optim.step(1e-2, layer, grads);
    }
    let w_after = layer.experts.w_in.val().into_data();
    assert!(
        losses[9] < 0.8 * losses[0],
        "the loss did not fall under fusion: {losses:?}"
    );
    assert_ne!(w_before, w_after, "the expert weights did not move");
    // Inference on the inner fusion backend (no autodiff) gives the training forward's output.
    let trained = layer.forward(x.clone()).output.into_data();
    let inferred = layer.valid().forward(x.inner()).output.into_data();
    trained.assert_approx_eq::<f32>(&inferred, burn::tensor::Tolerance::absolute(1e-5));
}

/// The gradient all-reduce under fusion: the bucket is handed to the inner backend and the sum
/// comes back as a fusion tensor that later fused operations read, on every rank.
#[test]
fn buckets_are_summed_over_ranks_under_fusion() {
    let sums = mpipemoe::LocalGroup::run(2, |ctx| {
        let device = Default::default();
        let values: Vec<f32> = (0..5).map(|i| (i * 10 + ctx.rank) as f32).collect();
        let x = Tensor::<FusedWgpu, 1>::from_floats(values.as_slice(), &device);
        // A pending fused operation on the input, so the resolve must run it first.
        let x = x * 2.0;
        let sum = FusedWgpu::all_reduce_sum(x.into_primitive().tensor(), ctx.comm.as_ref())?;
        let sum = Tensor::<FusedWgpu, 1>::from_primitive(burn::tensor::TensorPrimitive::Float(sum)) + 1.0;
        Ok(sum.into_data().to_vec::<f32>().unwrap())
    })
    .unwrap();
    let want: Vec<f32> = (0..5).map(|i| 2.0 * (2 * i * 10 + 1) as f32 + 1.0).collect();
    assert_eq!(sums, vec![want.clone(), want]);
}

/// The routing read under fusion hands fusion's queue to the device before the host waits
/// (`ChoiceRead::launch_issued`, which the layer calls after issuing its shared expert): an
/// element-wise chain registered after `router_choose` (fusion holds it open for more
/// operations to fuse) has its output allocated on the device by the time `wait` returns,
/// where before the wait it had none. That is what lets `shared_expert_overlap` overlap under
/// fusion: without the drain the shared expert's open tail ran only at the next resolve,
/// after the wait. Alone on the device: the measure is the device's bytes in use.
#[test]
fn the_choice_read_launches_what_fusion_holds_before_it_waits() {
    let _device = alone();
    let device = burn::backend::wgpu::WgpuDevice::default();
    let client = <WgpuRuntime as burn_cubecl::cubecl::Runtime>::client(&device);
    let in_use = || client.memory_usage().expect("memory usage").bytes_in_use;
    let logits = Tensor::<FusedWgpu, 2>::random([256, 8], Distribution::Normal(0.0, 1.0), &device);
    let x = Tensor::<FusedWgpu, 2>::random([1024, 1024], Distribution::Default, &device);
    // The choice resolves the logits, which drains the stream: `x` is on the device from here.
    let logits = logits.into_primitive().tensor();
    let mut read = FusedWgpu::router_choose(logits.clone(), logits, &RoutingRule::top_k(2, true))
        .expect("WGPU chooses on the device");
    let before = in_use();
    let y = x.clone() * 2.0 + 1.0;
    let held = in_use();
    assert_eq!(
        held, before,
        "fusion ran the chain at once: this test cannot tell a drain from none"
    );
    // As the layer does after issuing its shared expert under the overlap.
    read.launch_issued();
    assert!(matches!(
        read.wait(),
        Some(mpipemoe::backend::DeviceChoice::Chosen(_))
    ));
    let after = in_use();
    let output = (1024 * 1024 * 4) as u64;
    assert!(
        after >= before + output,
        "{before} bytes in use before the wait and {after} after: the chain's {output}-byte output was not allocated"
    );
    let want = x.into_data().to_vec::<f32>().unwrap();
    let got = y.into_data().to_vec::<f32>().unwrap();
    assert!(want
        .iter()
        .zip(&got)
        .all(|(a, b)| (a * 2.0 + 1.0 - b).abs() <= 1e-6));
}
