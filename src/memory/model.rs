//! The memory model: the paper's Eq. 1–9, and this implementation's counterparts of them.

use serde::Serialize;

use super::{ImplementationModel, Strategy, Term};
use crate::experts::Activation;

/// One MoE layer on one rank, in the paper's notation (Table II).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LayerShape {
    /// Tokens on this rank.
    pub tokens: usize,
    /// Experts per token. The paper sets `k = 1` and notes that a larger `k` is equivalent to
    /// a larger `B`; the model uses `B = tokens · top_k` rows.
    pub top_k: usize,
    /// `M`
    pub d_model: usize,
    /// `H`
    pub d_hidden: usize,
    /// The experts' activation (SwiGLU doubles the first GEMM's width).
    pub activation: Activation,
    /// Hidden width of the shared expert, if the layer has one (it runs on every token, beside
    /// the exchange).
    pub shared_expert: Option<usize>,
    /// Whether a sigmoid gate scales the shared expert's output
    /// ([`MoeLayerConfig::shared_expert_gate`](crate::MoeLayerConfig::shared_expert_gate), as
    /// in Qwen2-MoE): autodiff then keeps the output before the gate and the gate's scores
    /// (`n_tokens · (d_model + 1)` values) for the gate's gradient. DeepSeek's is ungated.
    pub shared_expert_gate: bool,
    /// Whether the shared expert runs before the exchange, while the routing read is in flight
    /// ([`MoeLayerConfig::shared_expert_overlap`](crate::MoeLayerConfig::shared_expert_overlap)):
    /// what autodiff keeps of it is then live through the exchange's forward.
    pub shared_expert_overlap: bool,
    /// Whether the combine weights multiply the experts' input rows (Llama 4,
    /// [`MoeLayerConfig::weights_on_input`](crate::MoeLayerConfig::weights_on_input)): autodiff
    /// then keeps the unweighted rows besides the weighted ones.
    pub weights_on_input: bool,
    /// `E`, over all ranks.
    pub n_experts: usize,
    /// `N`
    pub n_ranks: usize,
    /// `n`
    pub n_partitions: usize,
}

impl LayerShape {
    /// The paper's setting: top-1 routing, one expert per rank (`E = N`), a GELU FFN.
    pub fn paper(
        tokens: usize,
        d_model: usize,
        d_hidden: usize,
        n_ranks: usize,
        n_partitions: usize,
    ) -> Self {
        Self {
            tokens,
            top_k: 1,
            d_model,
            d_hidden,
            activation: Activation::Gelu,
            shared_expert: None,
            shared_expert_gate: false,
            shared_expert_overlap: false,
            weights_on_input: false,
            n_experts: n_ranks,
            n_ranks,
            n_partitions,
        }
    }

    /// `B`: rows this rank dispatches (and, with balanced routing, receives).
    pub fn rows(&self) -> f64 {
        (self.tokens * self.top_k) as f64
    }

    /// Width of the first GEMM's output: `H`, or `2H` for SwiGLU.
    pub fn d_inner(&self) -> usize {
        self.activation.d_inner(self.d_hidden)
    }

    /// Experts on this rank.
    pub fn local_experts(&self) -> usize {
        self.n_experts / self.n_ranks.max(1)
    }
}

/// Eq. 1–9 of the paper, in elements (multiply by the dtype's size for bytes).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PaperTerms {
    /// Eq. 1: model states (parameters, gradients, Adam's two moments).
    pub m_ms: f64,
    /// Eq. 2: activations `T_I, T_DI, T_DO, T_O` (B·M each) and `T_M` (B·H).
    pub m_act: f64,
    /// Eq. 3: peak temporary gradient buffers, executed in sequence.
    pub m_buf: f64,
    /// Eq. 7: activations with pipelining (no reuse).
    pub m_act_pipe: f64,
    /// Eq. 7: temporary buffers with pipelining.
    pub m_buf_pipe: f64,
    /// Eq. 8: activations saved by partition-buffer reuse.
    pub delta_m_act: f64,
    /// Eq. 8: temporary buffers saved by reuse.
    pub delta_m_buf: f64,
    /// Eq. 9: the saving ratio.
    pub phi: f64,
}

impl PaperTerms {
    /// Evaluates Eq. 1–9 as printed. Eq. 1 counts the gate and this rank's `E/N` experts
    /// (`4·(E·M + 2·H·M·E/N)`), which is the paper's `4·(E·M + 2·H·M)` when `E = N`.
    pub fn new(shape: &LayerShape) -> Self {
        let b = shape.rows();
        let m = shape.d_model as f64;
        let h = shape.d_hidden as f64;
        let n = shape.n_partitions as f64;
        let e = shape.n_experts as f64;
        let local = shape.local_experts() as f64;
        let m_ms = 4.0 * (e * m + 2.0 * h * m * local);
        let m_act = 4.0 * b * m + b * h;
        let m_buf = b * m + b * h;
        let m_act_pipe = 4.0 * b * m + b * h;
        let m_buf_pipe = m_act_pipe;
        let delta = b * (2.0 * m * (n - 2.0) / n + h * (n - 1.0) / n);
        let phi = (delta + delta) / (m_ms + m_act_pipe + m_buf_pipe);
        Self {
            m_ms,
            m_act,
            m_buf,
            m_act_pipe,
            m_buf_pipe,
            delta_m_act: delta,
            delta_m_buf: delta,
            phi,
        }
    }

    /// `ΔM_act + ΔM_buf`: the saving the paper bounds, relative to pipelining without reuse.
    pub fn delta_total(&self) -> f64 {
        self.delta_m_act + self.delta_m_buf
    }

    /// Activations and buffers of FastMoE (`n = 1`, no pipelining), Eq. 2 + 3.
    pub fn fastmoe_footprint(&self) -> f64 {
        self.m_act + self.m_buf
    }

    /// Activations and buffers with pipelining (Eq. 7), less the reuse saving (Eq. 8) when
    /// `reuse` is on.
    pub fn pipelined_footprint(&self, reuse: bool) -> f64 {
        let pipe = self.m_act_pipe + self.m_buf_pipe;
        if reuse {
            pipe - self.delta_total()
        } else {
            pipe
        }
    }

    /// The saving the paper's equations predict against the FastMoE baseline (`n = 1`, no
    /// reuse): `(M_act + M_buf) − (M_act^pipe + M_buf^pipe − [ΔM_act + ΔM_buf])`.
    pub fn saving_vs_fastmoe(&self, reuse: bool) -> f64 {
        self.fastmoe_footprint() - self.pipelined_footprint(reuse)
    }

    /// The same terms in bytes for elements of `dtype_bytes` bytes.
    pub fn to_bytes(&self, dtype_bytes: usize) -> Self {
        let s = dtype_bytes as f64;
        Self {
            m_ms: self.m_ms * s,
            m_act: self.m_act * s,
            m_buf: self.m_buf * s,
            m_act_pipe: self.m_act_pipe * s,
            m_buf_pipe: self.m_buf_pipe * s,
            delta_m_act: self.delta_m_act * s,
            delta_m_buf: self.delta_m_buf * s,
            phi: self.phi,
        }
    }
}

/// This implementation's counterparts of Eq. 1–9, under the same names (elements).
///
/// - `m_ms`: 4 × (router and this rank's expert parameters, biases and SwiGLU's `2H`
///   included) — parameters, gradients, Adam's two moments.
/// - `m_act`: what is kept from forward to backward at `n = 1` without reuse: `T_DI`, `T_M`,
///   and `T_O` (held by the unpermute's backward).
/// - `m_buf`: the backward's working set at its peak at `n = 1` (the peak less what was kept).
/// - `m_act_pipe`: kept at `n` partitions without reuse (the same tensors as `m_act`).
/// - `delta_m_act`: `m_act_pipe` minus what is kept at `n` with reuse (S4 keeps `T_I`, `T_O`).
/// - `delta_m_buf`: `m_buf` minus the backward's working set at `n` with reuse (S4).
/// - `phi`: `(delta_m_act + delta_m_buf) / (m_ms + m_act_pipe + pipelined working set)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ImplementationTerms {
    /// Model states.
    pub m_ms: f64,
    /// Activations kept at `n = 1`.
    pub m_act: f64,
    /// Backward working set at `n = 1`.
    pub m_buf: f64,
    /// Activations kept at `n` without reuse.
    pub m_act_pipe: f64,
    /// Activations saved by reuse at `n`.
    pub delta_m_act: f64,
    /// Working set saved by partitioned reuse at `n`.
    pub delta_m_buf: f64,
    /// The saving ratio.
    pub phi: f64,
}

impl ImplementationTerms {
    /// The terms for `shape` (biases counted when `bias` is set).
    pub fn new(shape: &LayerShape, bias: bool) -> Self {
        let b = shape.rows();
        let (m, h, f) = (
            shape.d_model as f64,
            shape.d_hidden as f64,
            shape.d_inner() as f64,
        );
        let (e, local) = (shape.n_experts as f64, shape.local_experts() as f64);
        let biases = if bias { e + local * (f + m) } else { 0.0 };
        let m_ms = 4.0 * (e * m + local * (m * f + h * m) + biases);
        let sum = |terms: &[Term]| terms.iter().map(|t| t.elements).sum::<f64>();
        let at = |n: usize, strategy: Strategy| {
            ImplementationModel::new(
                &LayerShape {
                    n_partitions: n,
                    ..*shape
                },
                strategy,
            )
        };
        let t_o = b * m;
        let one = at(1, Strategy::None);
        let pipe = at(shape.n_partitions, Strategy::None);
        let reuse = at(shape.n_partitions, Strategy::S4);
        let working = |model: &ImplementationModel| model.backward.elements - sum(&model.saved);
        let m_act = sum(&one.saved) + t_o;
        let m_buf = working(&one);
        let m_act_pipe = sum(&pipe.saved) + t_o;
        let delta_m_act = m_act_pipe - (sum(&reuse.saved) + t_o);
        let delta_m_buf = m_buf - working(&reuse);
        let phi = (delta_m_act + delta_m_buf) / (m_ms + m_act_pipe + working(&pipe));
        Self {
            m_ms,
            m_act,
            m_buf,
            m_act_pipe,
            delta_m_act,
            delta_m_buf,
            phi,
        }
    }
}

/// The planner's answer (`mpipemoe plan`): Eq. 1–9 as the paper prints them next to this
/// implementation's model, in elements, with the element size to turn them into bytes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryPlan {
    /// The shape planned for.
    pub shape: LayerShape,
    /// Bytes per element of the dtype.
    pub dtype_bytes: usize,
    /// Eq. 1–9.
    pub paper: PaperTerms,
    /// This implementation's counterparts.
    pub implementation: ImplementationTerms,
    /// This implementation's peak device elements per strategy at `n`, term by term.
    pub strategies: Vec<(Strategy, ImplementationModel)>,
}

impl MemoryPlan {
    /// Plans `shape` for elements of `dtype_bytes` bytes.
    pub fn new(shape: &LayerShape, dtype_bytes: usize, bias: bool) -> Self {
        Self {
            shape: *shape,
            dtype_bytes,
            paper: PaperTerms::new(shape),
            implementation: ImplementationTerms::new(shape, bias),
            strategies: Strategy::ALL
                .into_iter()
                .map(|s| (s, ImplementationModel::new(shape, s)))
                .collect(),
        }
    }
}
