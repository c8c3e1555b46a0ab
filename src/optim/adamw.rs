//! AdamW with decoupled weight decay, its update in one backend kernel per parameter.

use burn::config::Config;
use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{AdamWState, AdaptiveMomentumState, LearningRate, SimpleOptimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::Device;
use burn::tensor::Tensor;

use super::kernels::{AdamWCoefficients, AdamWTensors, OptimizerKernels};

/// [`AdamW`]'s configuration: burn's `AdamWConfig` without gradient clipping, AMSGrad or
/// cautious decay, with burn's defaults (β₁ 0.9, β₂ 0.999, ε 1e-5, weight decay 1e-4), so that
/// it replaces burn's optimizer without changing a run. PyTorch's and transformers' defaults
/// are ε 1e-8 and weight decay 0.01.
#[derive(Config, Debug)]
pub struct AdamWConfig {
    /// β₁, the first moment's decay.
    #[config(default = 0.9)]
    pub beta_1: f32,
    /// β₂, the second moment's decay.
    #[config(default = 0.999)]
    pub beta_2: f32,
    /// ε, added to `sqrt(v̂)`.
    #[config(default = 1e-5)]
    pub epsilon: f32,
    /// The decoupled weight decay (multiplied by the learning rate).
    #[config(default = 1e-4)]
    pub weight_decay: f32,
}

/// AdamW (Loshchilov & Hutter) as burn computes it, each parameter's update one call of the
/// backend's [`OptimizerKernels::adamw_update`]. Its state is burn's `AdamWState`, so a record
/// saved by either optimizer loads into the other.
#[derive(Debug, Clone)]
pub struct AdamW {
    config: AdamWConfig,
}

impl AdamWConfig {
    /// The optimizer, without burn's adaptor.
    pub fn build(&self) -> AdamW {
        AdamW { config: self.clone() }
    }

    /// The optimizer for module `M` on autodiff backend `B`, as burn's `AdamWConfig::init`.
    pub fn init<B, M>(&self) -> OptimizerAdaptor<AdamW, M, B>
    where
        B: AutodiffBackend,
        B::InnerBackend: OptimizerKernels,
        M: AutodiffModule<B>,
    {
        OptimizerAdaptor::from(self.build())
    }
}

impl<B: OptimizerKernels> SimpleOptimizer<B> for AdamW {
    type State<const D: usize> = AdamWState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        param: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let c = &self.config;
        // Before the first step the moments are zeros: `β·0 + (1 − β)·g` is burn's first
        // moment `(1 − β)·g` exactly, so one kernel serves every step.
        let (time, moment_1, moment_2) = match state {
            Some(state) => {
                let momentum = state.momentum;
                (momentum.time + 1, momentum.moment_1, momentum.moment_2)
            }
            None => (1, grad.zeros_like(), grad.zeros_like()),
        };
        let coefficients = AdamWCoefficients::new(c.beta_1, c.beta_2, c.epsilon, c.weight_decay, lr, time);
        let updated = B::adamw_update(
            AdamWTensors {
                param,
                moment_1,
                moment_2,
            },
            grad,
            &coefficients,
        );
        let momentum = AdaptiveMomentumState::new(time, updated.moment_1, updated.moment_2);
        (updated.param, Some(AdamWState::new(momentum)))
    }

    fn to_device<const D: usize>(mut state: Self::State<D>, device: &Device<B>) -> Self::State<D> {
        state.momentum = state.momentum.to_device(device);
        state
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex, NdArray};
    use burn::nn::{Linear, LinearConfig};
    use burn::optim::{GradientsParams, Optimizer};
    use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
    use burn::tensor::backend::{AutodiffBackend, Backend};
    use burn::tensor::{Tensor, TensorData};

    use super::AdamWConfig;
    use crate::optim::{adamw_update_composed, AdamWCoefficients, AdamWTensors, OptimizerKernels};

    /// 300 × 70 weights: more elements than one of Flex's chunks, so the pass runs in parallel.
    fn model<B: AutodiffBackend>(device: &B::Device) -> Linear<B> {
        let linear = LinearConfig::new(300, 70).init::<B>(device);
        let n = 300 * 70;
        let values: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 500.0).collect();
        let weight = Tensor::from_data(TensorData::new(values, [300, 70]), device);
        let bias = Tensor::from_data(
            TensorData::new((0..70).map(|i| i as f32 / 70.0).collect::<Vec<_>>(), [70]),
            device,
        );
        Linear {
            weight: linear.weight.map(|_| weight.require_grad()),
            bias: linear.bias.map(|b| b.map(|_| bias.require_grad())),
        }
    }

    fn grads<B: AutodiffBackend>(model: &Linear<B>, step: usize, device: &B::Device) -> GradientsParams {
        let values: Vec<f32> = (0..4 * 300)
            .map(|i| (((i + 7 * step) * 13 % 29) as f32 - 14.0) / 14.0)
            .collect();
        let x = Tensor::<B, 2>::from_data(TensorData::new(values, [4, 300]), device);
        let y = model.forward(x);
        GradientsParams::from_grads((y.clone() * y).sum().backward(), model)
    }

    fn values<B: AutodiffBackend>(model: &Linear<B>) -> Vec<f32> {
        let mut out = model.weight.val().into_data().to_vec::<f32>().unwrap();
        out.extend(
            model
                .bias
                .as_ref()
                .unwrap()
                .val()
                .into_data()
                .to_vec::<f32>()
                .unwrap(),
        );
        out
    }

    fn max_relative(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
            .fold(0.0, f32::max)
    }

    /// The three tensors of `got` within `1e-6` (relative) of `want`'s, named by `label`.
    fn assert_same<B: Backend>(label: &str, got: AdamWTensors<B, 2>, want: AdamWTensors<B, 2>) {
        for (what, a, b) in [
            ("param", got.param, want.param),
            ("moment_1", got.moment_1, want.moment_1),
            ("moment_2", got.moment_2, want.moment_2),
        ] {
            let (a, b) = (
                a.into_data().to_vec::<f32>().unwrap(),
                b.into_data().to_vec::<f32>().unwrap(),
            );
            let diff = max_relative(&a, &b);
            assert!(diff <= 1e-6, "{label}: {what} differs by {diff:e}");
        }
    }

    /// Three steps of ours against three of burn's AdamW, with weight decay and PyTorch's ε;
    /// returns the largest relative difference of the parameters, and how far the parameters
    /// moved (so that a kernel that does nothing cannot pass).
    fn against_burn<B: AutodiffBackend>() -> (f32, f32)
    where
        B::InnerBackend: OptimizerKernels,
    {
        let device = Default::default();
        let (wd, eps, lr) = (0.05, 1e-8, 1e-2);
        let mut ours_opt = AdamWConfig::new()
            .with_weight_decay(wd)
            .with_epsilon(eps)
            .init::<B, Linear<B>>();
        let mut burns_opt = burn::optim::AdamWConfig::new()
            .with_weight_decay(wd)
            .with_epsilon(eps)
            .init::<B, Linear<B>>();
        let (mut ours, mut burns) = (model::<B>(&device), model::<B>(&device));
        let start = values(&ours);
        for step in 0..3 {
            let g = grads(&ours, step, &device);
            ours = ours_opt.step(lr, ours, g);
            let g = grads(&burns, step, &device);
            burns = burns_opt.step(lr, burns, g);
        }
        let moved = max_relative(&values(&ours), &start);
        (max_relative(&values(&ours), &values(&burns)), moved)
    }

    #[test]
    fn three_steps_equal_burns_adamw_on_flex_and_ndarray() {
        for (name, (diff, moved)) in [
            ("flex", against_burn::<Autodiff<Flex>>()),
            ("ndarray", against_burn::<Autodiff<NdArray>>()),
        ] {
            assert!(
                diff <= 1e-6,
                "{name}: parameters differ from burn's AdamW by {diff:e}"
            );
            assert!(moved > 1e-2, "{name}: the parameters moved only {moved:e}");
        }
    }

    /// Flex's in-place kernel on a parameter it may not write (a clone is held) and on a
    /// transposed view: the result equals the composed twin, and the held clone is untouched.
    #[test]
    fn flex_kernel_equals_its_composed_twin_and_writes_no_shared_buffer() {
        let device = Default::default();
        let n = 130 * 170;
        let data =
            |k: usize| -> Vec<f32> { (0..n).map(|i| (((i * k) % 997) as f32 - 498.0) / 997.0).collect() };
        let make = |k: usize| Tensor::<Flex, 2>::from_data(TensorData::new(data(k), [130, 170]), &device);
        let c = AdamWCoefficients::new(0.9, 0.999, 1e-8, 0.1, 3e-3, 4);
        for transposed in [false, true] {
            let shaped = |t: Tensor<Flex, 2>| if transposed { t.transpose() } else { t };
            let param = shaped(make(3));
            let held = param.clone();
            let before = held.to_data();
            let tensors = AdamWTensors {
                param,
                moment_1: shaped(make(5)),
                moment_2: shaped(make(7).abs()),
            };
            let grad = shaped(make(11));
            let twin = adamw_update_composed(tensors.clone(), grad.clone(), &c);
            let fused = <Flex as OptimizerKernels>::adamw_update(tensors, grad, &c);
            assert_same(&format!("transposed {transposed}"), fused, twin);
            assert_eq!(
                held.to_data(),
                before,
                "transposed {transposed}: a shared parameter was written"
            );
        }
    }

    /// The CubeCL kernel (`cubecl_adamw.rs`) on WGPU: three steps through burn's optimizer
    /// adaptor equal burn's AdamW; on tensors it owns, the kernel runs (it takes them) and
    /// equals the composed twin, from a strided gradient too; on a parameter with a clone held
    /// it hands them back, and the composed update leaves the clone as it was.
    #[cfg(feature = "wgpu")]
    #[test]
    fn wgpu_kernel_equals_burns_adamw_and_its_composed_twin() {
        use burn::backend::Wgpu;
        let (diff, moved) = against_burn::<Autodiff<Wgpu>>();
        assert!(
            diff <= 1e-6,
            "wgpu: parameters differ from burn's AdamW by {diff:e}"
        );
        assert!(moved > 1e-2, "wgpu: the parameters moved only {moved:e}");
        let device = Default::default();
        let n = 130 * 170;
        let data =
            |k: usize| -> Vec<f32> { (0..n).map(|i| (((i * k) % 997) as f32 - 498.0) / 997.0).collect() };
        let make = |k: usize| Tensor::<Wgpu, 2>::from_data(TensorData::new(data(k), [130, 170]), &device);
        // Each call gets tensors of its own: a clone would share the handle and make the
        // kernel hand them back.
        let tensors = || AdamWTensors {
            param: make(3),
            moment_1: make(5),
            moment_2: make(7).abs(),
        };
        let c = AdamWCoefficients::new(0.9, 0.999, 1e-8, 0.1, 3e-3, 4);
        let twin = adamw_update_composed(tensors(), make(11), &c);
        let Ok(kernel) = crate::optim::cubecl_adamw::adamw_update(tensors(), make(11), &c) else {
            panic!("the kernel refused tensors it owns");
        };
        assert_same("the kernel against the composed twin", kernel, twin);
        // A gradient that arrives as a transposed view (a weight applied as `x · wᵀ`, as the
        // router's is): the kernel copies it contiguous and takes it.
        let transposed = make(11).transpose().into_data();
        let strided = Tensor::<Wgpu, 2>::from_data(transposed, &device).transpose();
        assert!(
            !strided.clone().into_primitive().tensor().is_contiguous(),
            "the gradient under test is a strided view"
        );
        let Ok(from_view) = crate::optim::cubecl_adamw::adamw_update(tensors(), strided, &c) else {
            panic!("the kernel refused a strided gradient");
        };
        let want = adamw_update_composed(tensors(), make(11), &c);
        assert_same("strided gradient", from_view, want);
        let mut shared = tensors();
        let held = shared.param.clone();
        let before = held.to_data();
        let Err((back, grad)) = crate::optim::cubecl_adamw::adamw_update(shared, make(11), &c) else {
            panic!("the kernel took a parameter whose clone is held");
        };
        shared = adamw_update_composed(back, grad, &c);
        assert_eq!(held.to_data(), before, "a shared parameter was written");
        assert_ne!(shared.param.to_data(), before, "the composed update did nothing");
    }

    /// A record saved by burn's AdamW loads into ours, and the next step equals burn's.
    #[test]
    fn burns_record_loads_and_continues() {
        type B = Autodiff<Flex>;
        let device = Default::default();
        let mut burns_opt = burn::optim::AdamWConfig::new().init::<B, Linear<B>>();
        let mut burns = model::<B>(&device);
        let g = grads(&burns, 0, &device);
        burns = burns_opt.step(1e-2, burns, g);
        let recorder = BinBytesRecorder::<FullPrecisionSettings>::default();
        let bytes = recorder.record(burns_opt.to_record(), ()).unwrap();
        let after_first = burns.clone();
        let mut ours_opt = AdamWConfig::new().init::<B, Linear<B>>();
        ours_opt = ours_opt.load_record(recorder.load(bytes, &device).unwrap());
        let g = grads(&after_first, 1, &device);
        let ours = ours_opt.step(1e-2, after_first.clone(), g);
        let g = grads(&after_first, 1, &device);
        let fresh = AdamWConfig::new()
            .init::<B, Linear<B>>()
            .step(1e-2, after_first.clone(), g);
        let g = grads(&burns, 1, &device);
        burns = burns_opt.step(1e-2, burns, g);
        let diff = max_relative(&values(&ours), &values(&burns));
        assert!(diff <= 1e-6, "the continued step differs by {diff:e}");
        // Without the loaded moments the second step is a first step: far from burn's.
        let diff = max_relative(&values(&fresh), &values(&burns));
        assert!(
            diff > 1e-4,
            "a fresh optimizer's step is burn's second step ({diff:e}): the test cannot tell"
        );
    }
}
