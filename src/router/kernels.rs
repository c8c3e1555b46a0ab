//! The router's two element-wise stages on backend tensors, overridable per backend, and
//! their composed twins: the scores from the logits, and the combine weights picked from the
//! scores.

use burn::tensor::activation::{sigmoid, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};

use super::{RoutingRule, Scoring};

/// How the chosen scores become combine weights: each token's `top_k` chosen scores divided by
/// their sum plus `eps` when `normalize` is set, then multiplied by `scaling`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PickRule {
    /// Divide each token's chosen scores by their sum (plus `eps`).
    pub normalize: bool,
    /// Added to the sum before dividing: 0 for softmax scores, 1e-20 for sigmoid scores, which
    /// can all be tiny.
    pub eps: f64,
    /// Factor on every weight, after the division.
    pub scaling: f64,
}

/// A choice of experts made on the device and read to the host
/// ([`RouterKernels::router_choose`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceChoice {
    /// Each token's `top_k` experts, best first: `n_tokens · top_k` columns, each below
    /// `n_experts`, the host's choice exactly.
    Chosen(Vec<usize>),
    /// Some token had a value or a logit that is not finite; the caller chooses on the host,
    /// where NaNs have their own rule and the input's finite check lives.
    NotFinite,
}

/// A choice of experts launched on the device with its read to the host in flight
/// ([`RouterKernels::router_choose`]). What the caller issues before [`wait`](Self::wait)
/// queues behind the read, and the read does not wait for it: the device runs it while the
/// host waits (the layer issues its shared expert there under
/// [`shared_expert_overlap`](crate::MoeLayerConfig::shared_expert_overlap)). A backend that
/// holds issued work back (burn's fusion) hands it to the device in
/// [`launch_issued`](Self::launch_issued), which the caller calls after issuing it.
pub struct ChoiceRead {
    wait: Box<dyn FnOnce() -> Option<DeviceChoice> + Send>,
    launch: Option<Box<dyn FnOnce() + Send>>,
}

impl ChoiceRead {
    /// A read whose `wait` blocks until the choice is on the host and decodes it (`None`:
    /// what came back is not what the kernel writes, and the caller chooses on the host).
    pub fn new(wait: impl FnOnce() -> Option<DeviceChoice> + Send + 'static) -> Self {
        Self {
            wait: Box::new(wait),
            launch: None,
        }
    }

    /// This read, with `launch` as what [`launch_issued`](Self::launch_issued) does.
    pub fn with_launch(mut self, launch: impl FnOnce() + Send + 'static) -> Self {
        self.launch = Some(Box::new(launch));
        self
    }

    /// Hands what the caller issued since the read to the device, without waiting for it:
    /// nothing to do on a backend that launches each op as it is issued. Once; later calls
    /// do nothing.
    pub fn launch_issued(&mut self) {
        if let Some(launch) = self.launch.take() {
            launch();
        }
    }

    /// Waits for the read and returns the choice.
    pub fn wait(self) -> Option<DeviceChoice> {
        (self.wait)()
    }
}

impl std::fmt::Debug for ChoiceRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChoiceRead(..)")
    }
}

/// The router's scores and combine weights on the backend that runs them (the inner backend
/// of `Autodiff`, which records each as one node: `router/autodiff.rs`).
///
/// Composed from burn's ops, a softmax router's scores take five kernels forward and about a
/// dozen backward on a GPU backend, and the picked weights (a gather, the normalisation, the
/// scaling) four forward and several more backward, every step of every MoE layer. The
/// defaults are those composed forms ([`scores_composed`], [`scores_backward_composed`],
/// [`pick_composed`], [`pick_backward_composed`], [`z_loss_composed`],
/// [`z_loss_backward_composed`]); the CubeCL backends run one kernel for each (the z-loss's sum
/// a reduction besides: `router/cubecl_router.rs`, `router/cubecl_z_loss.rs`), and the tests
/// hold them to the composed forms.
pub trait RouterKernels: Backend {
    /// Each row's softmax over the experts, or a sigmoid per expert.
    ///
    /// # Shapes
    /// - logits: `[n_tokens, n_experts]` → `[n_tokens, n_experts]`
    fn router_scores(logits: FloatTensor<Self>, scoring: Scoring) -> FloatTensor<Self> {
        scores_composed::<Self>(logits, scoring)
    }

    /// The logits' gradient from the scores and theirs: `s ⊙ (g − Σ_e g ⊙ s)` per row for
    /// softmax, `g ⊙ s ⊙ (1 − s)` for sigmoid.
    ///
    /// # Shapes
    /// - scores, grad: `[n_tokens, n_experts]` → `[n_tokens, n_experts]`
    fn router_scores_backward(
        scores: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scoring: Scoring,
    ) -> FloatTensor<Self> {
        scores_backward_composed::<Self>(scores, grad, scoring)
    }

    /// The combine weights: `scores[t, indices[t · top_k + j]]` for each token `t` and choice
    /// `j`, normalised and scaled by `rule`.
    ///
    /// # Shapes
    /// - scores: `[n_tokens, n_experts]`, indices: `n_tokens · top_k` → `[n_tokens, top_k]`
    ///
    /// # Panics
    /// If an index is `n_experts` or more, or `indices` does not hold `n_tokens · top_k`
    /// entries (the contract of burn's `gather`).
    fn router_pick(
        scores: FloatTensor<Self>,
        indices: &[usize],
        top_k: usize,
        rule: PickRule,
    ) -> FloatTensor<Self> {
        pick_composed::<Self>(scores, indices, top_k, rule)
    }

    /// The scores' gradient from the weights': zero but at each token's chosen experts, where
    /// it is `scaling · (g_j / S − Σ_l g_l · c_l / S²)` with `c` the chosen scores and
    /// `S = Σ_l c_l + eps` under `normalize`, `scaling · g_j` without.
    ///
    /// # Shapes
    /// - scores: `[n_tokens, n_experts]`, indices: `n_tokens · top_k`, grad: `[n_tokens, top_k]`
    ///   → `[n_tokens, n_experts]`
    ///
    /// # Panics
    /// As [`router_pick`](Self::router_pick).
    fn router_pick_backward(
        scores: FloatTensor<Self>,
        indices: &[usize],
        top_k: usize,
        grad: FloatTensor<Self>,
        rule: PickRule,
    ) -> FloatTensor<Self> {
        pick_backward_composed::<Self>(scores, indices, top_k, grad, rule)
    }

    /// Each token's `rule.top_k` experts by `values` (its `n_group` / `topk_group` limit
    /// included), chosen on the device so that only the choice comes to the host; `logits`
    /// is checked for values that are not finite with `values` (the same tensor where a router
    /// chooses by its logits). The kernel and the read are issued at once and the read is
    /// waited for in [`ChoiceRead::wait`]. `None` where the backend chooses on the host (the
    /// default: the CPU backends, where the values are already in memory) or cannot read the
    /// tensors; the caller then reads `values` and chooses on the host. The CubeCL backends
    /// run one kernel and one read (`router/cubecl_choice.rs`).
    ///
    /// # Shapes
    /// - values, logits: `[n_tokens, n_experts]`
    fn router_choose(
        values: FloatTensor<Self>,
        logits: FloatTensor<Self>,
        rule: &RoutingRule,
    ) -> Option<ChoiceRead> {
        let _ = (values, logits, rule);
        None
    }

    /// The router z-loss (ST-MoE): `scale · Σ_t logsumexp(logits_t)²`, `scale` being the
    /// coefficient over the global batch's tokens.
    ///
    /// # Shapes
    /// - logits: `[n_tokens, n_experts]` → `[1]`
    fn router_z_loss(logits: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        z_loss_composed::<Self>(logits, scale)
    }

    /// The logits' gradient from the z-loss's: `grad · scale · 2 · lse_t · softmax(logits_t)`
    /// per row, `lse_t` the row's logsumexp.
    ///
    /// # Shapes
    /// - logits: `[n_tokens, n_experts]`, grad: `[1]` → `[n_tokens, n_experts]`
    fn router_z_loss_backward(
        logits: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        z_loss_backward_composed::<Self>(logits, grad, scale)
    }
}

/// A backend's float primitive as a tensor of `D` dimensions.
pub(super) fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

fn index_tensor<B: Backend>(indices: &[usize], top_k: usize, device: &B::Device) -> Tensor<B, 2, Int> {
    let n_tokens = indices.len().checked_div(top_k).unwrap_or(0);
    let data = TensorData::new(
        indices.iter().map(|&i| i as i64).collect::<Vec<_>>(),
        [n_tokens, top_k],
    );
    Tensor::from_data(data, device)
}

/// [`RouterKernels::router_scores`] from burn's ops: its `softmax` over dim 1, or `sigmoid`.
///
/// # Shapes
/// - logits: `[n_tokens, n_experts]` → `[n_tokens, n_experts]`
pub fn scores_composed<B: Backend>(logits: FloatTensor<B>, scoring: Scoring) -> FloatTensor<B> {
    let logits = float::<B, 2>(logits);
    match scoring {
        Scoring::Softmax => softmax(logits, 1),
        Scoring::Sigmoid => sigmoid(logits),
    }
    .into_primitive()
    .tensor()
}

/// [`RouterKernels::router_scores_backward`] from burn's ops.
///
/// # Shapes
/// - scores, grad: `[n_tokens, n_experts]` → `[n_tokens, n_experts]`
pub fn scores_backward_composed<B: Backend>(
    scores: FloatTensor<B>,
    grad: FloatTensor<B>,
    scoring: Scoring,
) -> FloatTensor<B> {
    let (s, g) = (float::<B, 2>(scores), float::<B, 2>(grad));
    match scoring {
        Scoring::Softmax => {
            let dot = (g.clone() * s.clone()).sum_dim(1);
            s * (g - dot)
        }
        Scoring::Sigmoid => g * s.clone() * (s.neg() + 1.0),
    }
    .into_primitive()
    .tensor()
}

/// [`RouterKernels::router_pick`] from burn's ops: a gather, then the division by the row's
/// sum (plus `eps` where it is not 0) and the scaling where it is not 1.
///
/// # Shapes
/// - scores: `[n_tokens, n_experts]`, indices: `n_tokens · top_k` → `[n_tokens, top_k]`
pub fn pick_composed<B: Backend>(
    scores: FloatTensor<B>,
    indices: &[usize],
    top_k: usize,
    rule: PickRule,
) -> FloatTensor<B> {
    let scores = float::<B, 2>(scores);
    let index = index_tensor::<B>(indices, top_k, &scores.device());
    let mut chosen = scores.gather(1, index);
    if rule.normalize {
        let sum = chosen.clone().sum_dim(1);
        // Softmax scores divide by the bare sum, as every reference computes it.
        chosen = if rule.eps == 0.0 {
            chosen / sum
        } else {
            chosen / sum.add_scalar(rule.eps)
        };
    }
    if rule.scaling != 1.0 {
        chosen = chosen * rule.scaling;
    }
    chosen.into_primitive().tensor()
}

/// [`RouterKernels::router_pick_backward`] from burn's ops: the chosen scores' gradient,
/// scattered (added) into zeros at the chosen experts.
///
/// # Shapes
/// - scores: `[n_tokens, n_experts]`, indices: `n_tokens · top_k`, grad: `[n_tokens, top_k]`
///   → `[n_tokens, n_experts]`
pub fn pick_backward_composed<B: Backend>(
    scores: FloatTensor<B>,
    indices: &[usize],
    top_k: usize,
    grad: FloatTensor<B>,
    rule: PickRule,
) -> FloatTensor<B> {
    let scores = float::<B, 2>(scores);
    let device = scores.device();
    let index = index_tensor::<B>(indices, top_k, &device);
    let mut g = float::<B, 2>(grad);
    if rule.scaling != 1.0 {
        g = g * rule.scaling;
    }
    if rule.normalize {
        let chosen = scores.clone().gather(1, index.clone());
        let sum = chosen.clone().sum_dim(1).add_scalar(rule.eps);
        let dot = (g.clone() * chosen).sum_dim(1);
        g = (g - dot / sum.clone()) / sum;
    }
    scores
        .zeros_like()
        .scatter(1, index, g, burn::tensor::IndexingUpdateOp::Add)
        .into_primitive()
        .tensor()
}

/// Each row's logsumexp, shifted by the row's maximum so that `exp` cannot overflow (the shift
/// cancels exactly).
///
/// # Shapes
/// - logits: `[n_tokens, n_experts]` → `[n_tokens, 1]`
fn logsumexp<B: Backend>(logits: Tensor<B, 2>) -> Tensor<B, 2> {
    let shift = logits.clone().max_dim(1);
    (logits - shift.clone()).exp().sum_dim(1).log() + shift
}

/// [`RouterKernels::router_z_loss`] from burn's ops.
///
/// # Shapes
/// - logits: `[n_tokens, n_experts]` → `[1]`
pub fn z_loss_composed<B: Backend>(logits: FloatTensor<B>, scale: f64) -> FloatTensor<B> {
    let lse = logsumexp(float::<B, 2>(logits));
    (lse.powi_scalar(2).sum() * scale).into_primitive().tensor()
}

/// [`RouterKernels::router_z_loss_backward`] from burn's ops: `softmax = exp(logits − lse)`.
///
/// # Shapes
/// - logits: `[n_tokens, n_experts]`, grad: `[1]` → `[n_tokens, n_experts]`
pub fn z_loss_backward_composed<B: Backend>(
    logits: FloatTensor<B>,
    grad: FloatTensor<B>,
    scale: f64,
) -> FloatTensor<B> {
    let logits = float::<B, 2>(logits);
    let lse = logsumexp(logits.clone());
    let softmax = (logits - lse.clone()).exp();
    let grad = float::<B, 1>(grad).reshape([1, 1]);
    (softmax * (lse * (2.0 * scale)) * grad).into_primitive().tensor()
}
