//! Low-rank adapters (LoRA) on the experts' stacked weights: one adapter per expert, held by
//! the rank that holds the expert.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::init::HostInit;
use super::weights::primitive;
use super::{ExpertTensors, ExpertWeights, LowRankTensors};

/// How an adapter's product is scaled: PEFT's `lora_alpha / r`, or rsLoRA's
/// `lora_alpha / sqrt(r)` (`use_rslora=True`).
///
/// ```
/// use mpipemoe::LoraScaling;
/// assert_eq!(LoraScaling::Standard.scale(16.0, 8), 2.0);
/// assert_eq!(LoraScaling::RsLora.scale(16.0, 4), 8.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoraScaling {
    /// `alpha / r` (PEFT's default).
    #[default]
    Standard,
    /// `alpha / sqrt(r)` (rsLoRA).
    RsLora,
}

impl LoraScaling {
    /// The factor on an adapter of rank `rank` with `alpha`.
    pub fn scale(self, alpha: f64, rank: usize) -> f64 {
        match self {
            LoraScaling::Standard => alpha / rank as f64,
            LoraScaling::RsLora => alpha / (rank as f64).sqrt(),
        }
    }
}

/// One adapter per expert on a stacked weight `w [n_local_experts, rows, cols]`: the weight the
/// experts run is `w[e] + scale · a[e] · b[e]`.
///
/// # Shapes
/// - a: `[n_local_experts, rows, rank]`
/// - b: `[n_local_experts, rank, cols]`
#[derive(Module, Debug)]
pub struct ExpertLora<B: Backend> {
    /// The input side's factor.
    pub a: Param<Tensor<B, 3>>,
    /// The output side's factor.
    pub b: Param<Tensor<B, 3>>,
    /// `alpha / r` or `alpha / sqrt(r)`.
    #[module(skip)]
    pub scale: f64,
}

impl<B: Backend> ExpertLora<B> {
    /// An adapter from its factors.
    ///
    /// # Panics
    /// If the factors' expert counts or ranks differ (a contract violation: callers reading
    /// adapters from files check the shapes first and return an error).
    pub fn new(a: Tensor<B, 3>, b: Tensor<B, 3>, scale: f64) -> Self {
        let ([ea, _, ra], [eb, rb, _]) = (a.dims(), b.dims());
        assert!(
            ea == eb && ra == rb,
            "an expert adapter's factors disagree: a {:?}, b {:?}",
            a.dims(),
            b.dims()
        );
        Self {
            a: Param::from_tensor(a),
            b: Param::from_tensor(b),
            scale,
        }
    }

    /// A fresh adapter as PEFT initialises one, so that it starts as no change: `a` uniform in
    /// `±1/sqrt(rows)` (PEFT's Kaiming-uniform bound on `lora_A`, drawn per expert from the
    /// host stream keyed by `seed`, `name` and the global expert index, so that it does not
    /// depend on the rank count), `b` zeros.
    #[allow(clippy::too_many_arguments)]
    pub fn init(
        experts: std::ops::Range<usize>,
        rows: usize,
        cols: usize,
        rank: usize,
        scale: f64,
        seed: u64,
        name: &str,
        device: &B::Device,
    ) -> Self {
        let n = experts.len();
        let bound = 1.0 / (rows.max(1) as f64).sqrt();
        let mut values = Vec::with_capacity(n * rows * rank);
        for e in experts {
            values.extend(HostInit::new(seed, name, e).uniform(rows * rank, bound));
        }
        let a = Tensor::from_data(
            TensorData::new(values, [n, rows, rank]).convert::<B::FloatElem>(),
            device,
        );
        Self::new(a, Tensor::zeros([n, rank, cols], device), scale)
    }

    /// The adapter's rank.
    pub fn rank(&self) -> usize {
        self.a.dims()[2]
    }

    /// The factors as the exchange op takes them: its experts run the adapter's term beside the
    /// weight's product, and its backward gives the factors' gradients (tracked by autodiff
    /// back to these parameters) without the weight's.
    pub fn tensors(&self) -> LowRankTensors<B> {
        LowRankTensors {
            a: primitive(self.a.val()),
            b: primitive(self.b.val()),
            scale: self.scale,
        }
    }

    /// `scale · a[e] · b[e]` for every expert: what the adapter adds to the weight.
    ///
    /// # Shapes
    /// - returns `[n_local_experts, rows, cols]`
    pub fn delta(&self) -> Tensor<B, 3> {
        self.a.val().matmul(self.b.val()).mul_scalar(self.scale)
    }
}

/// The adapters of a rank's experts: on the first GEMM's weights (`gate_up_proj`), the
/// second's (`down_proj`), or both.
///
/// The fused exchange takes the factors beside the weights ([`attach`](Self::attach)): each
/// expert runs `x · w + scale · (x · a) · b` in its C step and, in C', computes the factors'
/// gradients from products that all have the rank as a dimension, and no `dW` for a frozen
/// weight; what S3/S4 recompute includes the adapter's term. `w + scale · a · b` is never
/// built there. The reference twin runs the adapted weights instead ([`apply`](Self::apply),
/// tensors that autodiff tracks to the factors, as PEFT's parametrization of
/// `target_parameters` does), and the tests hold the two equal. With the base weights frozen
/// (`no_grad`), they receive no gradient and no optimizer state.
#[derive(Module, Debug)]
pub struct ExpertAdapters<B: Backend> {
    /// The adapter on `w_in` (`[n_local_experts, d_model, d_inner]`).
    pub w_in: Option<ExpertLora<B>>,
    /// The adapter on `w_out` (`[n_local_experts, d_hidden, d_model]`).
    pub w_out: Option<ExpertLora<B>>,
}

impl<B: Backend> ExpertAdapters<B> {
    /// `experts` (this rank's own, as the fused op takes them) with the adapters' factors
    /// beside them.
    pub fn attach(&self, mut experts: ExpertTensors<B>) -> ExpertTensors<B> {
        experts.lora_in = self.w_in.as_ref().map(ExpertLora::tensors);
        experts.lora_out = self.w_out.as_ref().map(ExpertLora::tensors);
        experts
    }

    /// `weights` with the adapters' deltas added (their own experts only: call it before any
    /// shadowed expert is appended, as the layer does).
    pub fn apply(&self, mut weights: ExpertWeights<B>) -> ExpertWeights<B> {
        if let Some(lora) = &self.w_in {
            weights.w_in = weights.w_in + lora.delta();
        }
        if let Some(lora) = &self.w_out {
            weights.w_out = weights.w_out + lora.delta();
        }
        weights
    }
}
