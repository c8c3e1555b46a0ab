//! The stacked expert weights of one rank.

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::init::stacked;
use super::Activation;
use super::{ExpertShard, ExpertTensors, ExpertWeights, ShardCheck};
use crate::error::Result;

/// The experts one rank owns: `n_local_experts` FFNs stacked along the first dimension.
///
/// Expert `e` computes `act(v · w_in[e] + b_in[e]) · w_out[e] + b_out[e]`. A part of
/// [`MoeLayer`](crate::MoeLayer) (its `experts` field), built by
/// [`MoeLayerConfig::init`](crate::MoeLayerConfig::init) for this rank's share of the
/// experts; it is public so that its parameters can be read, loaded and given to an optimizer.
///
/// # Shapes
/// - w_in: `[n_local_experts, d_model, d_inner]` (`d_inner` = d_hidden, or 2·d_hidden for SwiGLU,
///   gate half first)
/// - b_in: `[n_local_experts, d_inner]`
/// - w_out: `[n_local_experts, d_hidden, d_model]`
/// - b_out: `[n_local_experts, d_model]`
#[derive(Module, Debug)]
pub struct Experts<B: Backend> {
    /// First GEMM's weights.
    pub w_in: Param<Tensor<B, 3>>,
    /// First GEMM's bias, if the experts have biases.
    pub b_in: Option<Param<Tensor<B, 2>>>,
    /// Second GEMM's weights.
    pub w_out: Param<Tensor<B, 3>>,
    /// Second GEMM's bias, if the experts have biases.
    pub b_out: Option<Param<Tensor<B, 2>>>,
    /// The activation between the two GEMMs.
    #[module(skip)]
    pub activation: Activation,
    /// Which experts these are (saved with the record, checked before every forward).
    pub shard: ShardCheck<B>,
}

/// Shape and placement of a rank's experts, for [`Experts::init`].
#[derive(Debug, Clone)]
pub(crate) struct ExpertsSpec {
    pub experts: std::ops::Range<usize>,
    pub n_experts: usize,
    pub rank: usize,
    pub n_ranks: usize,
    pub d_model: usize,
    pub d_hidden: usize,
    pub activation: Activation,
    pub bias: bool,
    pub seed: u64,
}

impl<B: Backend> Experts<B> {
    /// Initialises the experts in `spec.experts` (global indices), uniform in
    /// ±1/sqrt(fan_in) like `nn::Linear`, drawn per expert so that the weights do not depend
    /// on which rank owns them.
    pub(crate) fn init(spec: &ExpertsSpec, device: &B::Device) -> Self {
        let (m, h) = (spec.d_model, spec.d_hidden);
        let f = spec.activation.d_inner(h);
        let range = spec.experts.clone();
        let seed = spec.seed;
        let w_in = stacked::<B, 2, 3>(seed, "experts.w_in", range.clone(), [m, f], m, device);
        let w_out = stacked::<B, 2, 3>(seed, "experts.w_out", range.clone(), [h, m], h, device);
        let (b_in, b_out) = if spec.bias {
            (
                Some(Param::from_tensor(stacked::<B, 1, 2>(
                    seed,
                    "experts.b_in",
                    range.clone(),
                    [f],
                    m,
                    device,
                ))),
                Some(Param::from_tensor(stacked::<B, 1, 2>(
                    seed,
                    "experts.b_out",
                    range.clone(),
                    [m],
                    h,
                    device,
                ))),
            )
        } else {
            (None, None)
        };
        Self {
            w_in: Param::from_tensor(w_in),
            b_in,
            w_out: Param::from_tensor(w_out),
            b_out,
            activation: spec.activation,
            shard: ShardCheck::new(ExpertShard {
                first_expert: range.start,
                n_local: range.len(),
                n_experts: spec.n_experts,
                rank: spec.rank,
                n_ranks: spec.n_ranks,
            }),
        }
    }

    /// Global index of this rank's first expert.
    pub fn first_expert(&self) -> usize {
        self.shard.shard().first_expert
    }

    /// An error naming both ranges if a record saved from other experts (another rank, or
    /// another rank count) was loaded into these; the layer checks it before every forward.
    ///
    /// # Errors
    /// [`MoeError::Input`](crate::MoeError::Input) naming the record's experts and this
    /// layer's.
    pub fn check_shard(&self) -> Result<()> {
        self.shard.check()
    }

    /// Number of experts on this rank.
    pub fn n_local_experts(&self) -> usize {
        self.w_in.dims()[0]
    }

    /// The weights as primitives (cheap: shares the buffers).
    pub fn tensors(&self) -> ExpertTensors<B> {
        self.weights().tensors()
    }

    /// The weights as tensors autodiff tracks back to the parameters (cheap: shares the
    /// buffers): what one exchange runs, before any shadowed experts are appended.
    pub fn weights(&self) -> ExpertWeights<B> {
        ExpertWeights {
            w_in: self.w_in.val(),
            b_in: self.b_in.as_ref().map(|b| b.val()),
            w_out: self.w_out.val(),
            b_out: self.b_out.as_ref().map(|b| b.val()),
            activation: self.activation,
        }
    }

    /// Expert `e` (local index) applied to `rows` with ordinary tensor ops: the reference
    /// twin of the fused op's compute step.
    ///
    /// # Shapes
    /// - rows: `[n_rows, d_model]` → `[n_rows, d_model]`
    pub fn forward_expert(&self, e: usize, rows: Tensor<B, 2>) -> Tensor<B, 2> {
        self.weights().forward_expert(e, rows)
    }
}
