//! The memory model: the paper's Eq. 1–9, and what this implementation holds, term by term.

use serde::Serialize;

use super::{Restore, Strategy};

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
    /// Width of the first GEMM's output: `H`, or `2H` for SwiGLU.
    pub d_inner: usize,
    /// `E`, over all ranks.
    pub n_experts: usize,
    /// `N`
    pub n_ranks: usize,
    /// `n`
    pub n_partitions: usize,
}

impl LayerShape {
    /// The paper's setting: top-1 routing, one expert per rank (`E = N`), a plain FFN
    /// (`d_inner = H`).
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
            d_inner: d_hidden,
            n_experts: n_ranks,
            n_ranks,
            n_partitions,
        }
    }

    /// `B`: rows this rank dispatches (and, with balanced routing, receives).
    pub fn rows(&self) -> f64 {
        (self.tokens * self.top_k) as f64
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

/// One named term of the implementation model, in elements.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Term {
    /// What the tensor is (`T_DI (kept)`, `dT_DO x2 partitions`, ...).
    pub name: String,
    /// Elements.
    pub elements: f64,
}

fn term(name: impl Into<String>, elements: f64) -> Term {
    Term {
        name: name.into(),
        elements,
    }
}

/// What this implementation holds for one forward + backward of the exchange, term by term
/// (elements, per rank), following the fused op's schedule (DESIGN §3–4).
///
/// `p = B/n` rows per partition (balanced routing: every rank sends and receives `B` rows).
/// The forward's peak is the last partition's compute: the strategy's saved tensors, the next
/// dispatched partition, the activation output and the output block. The backward's peak is
/// a partition's activation backward: the full-size `dT_O` and `dT_I`, the expert weight
/// gradients, the restored gradient and `T_DI` of this partition and the next, `T_M` where it
/// is offloaded or recomputed, and `dA`. `dT_M` overwrites `T_M` in place (Flex, the
/// examples' backend, does so for uniquely owned tensors; NdArray's composed GELU backward
/// allocates more). The layer around the exchange adds the output's gradient and the
/// unpermute's gradient during backward. With one rank the all-to-alls move nothing and re-communicated `T_DI` is
/// a view of `T_I`, so a one-rank measurement can be lower than the model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ImplementationModel {
    /// Kept on the device from forward to backward.
    pub saved: Vec<Term>,
    /// Kept on the host (offloads).
    pub host: Vec<Term>,
    /// Live at the forward's peak besides `saved`.
    pub forward: Vec<Term>,
    /// Live at the backward's peak besides `saved`.
    pub backward: Vec<Term>,
}

impl ImplementationModel {
    /// The model for `shape` under `strategy`.
    pub fn new(shape: &LayerShape, strategy: Strategy) -> Self {
        let b = shape.rows();
        let m = shape.d_model as f64;
        let h = shape.d_hidden as f64;
        let f = shape.d_inner as f64;
        let n = shape.n_partitions.max(1) as f64;
        let p = b / n;
        let local = shape.local_experts() as f64;
        let mut saved = Vec::new();
        let mut host = Vec::new();
        let dispatched = strategy.dispatched();
        let hidden = strategy.hidden();
        match dispatched {
            Restore::Keep => saved.push(term("T_DI, all partitions", b * m)),
            Restore::Offload => host.push(term("T_DI, all partitions", b * m)),
            _ => saved.push(term("T_I, kept to re-communicate T_DI", b * m)),
        }
        match hidden {
            Restore::Keep => saved.push(term("T_M, all partitions", b * f)),
            Restore::Offload => host.push(term("T_M, all partitions", b * f)),
            _ => {}
        }
        let pipelined = n > 1.0;
        let assembled = if pipelined { b * m } else { 0.0 };
        let mut forward = Vec::new();
        if dispatched != Restore::Recommunicate {
            forward.push(term("T_I (input)", b * m));
        }
        if pipelined {
            forward.push(term("next T_DI buffer", p * m));
        }
        if hidden != Restore::Keep {
            forward.push(term("T_M buffer", p * f));
        }
        forward.push(term("activation output", p * h));
        forward.push(term("T_DO buffer", p * m));
        forward.push(term("T_O (preallocated, n > 1)", assembled));

        let restored = if pipelined { 2.0 } else { 1.0 };
        let tokens = shape.tokens as f64;
        let mut backward = vec![
            term("dy (gradient of the layer output)", tokens * m),
            term("gradient of the weighted rows (unpermute backward)", b * m),
            term("dT_O (incoming gradient)", b * m),
            term("dT_I (preallocated, n > 1)", assembled),
            term("expert weight gradients", local * (m * f + h * m)),
            term(format!("dT_DO, {restored} partitions"), restored * p * m),
        ];
        if dispatched != Restore::Keep {
            backward.push(term(
                format!("T_DI restored, {restored} partitions"),
                restored * p * m,
            ));
        }
        match hidden {
            Restore::Keep => {}
            Restore::Offload => backward.push(term(
                format!("T_M prefetched, {restored} partitions"),
                restored * p * f,
            )),
            _ => backward.push(term("T_M recomputed", p * f)),
        }
        backward.push(term("dA", p * h));
        Self {
            saved,
            host,
            forward,
            backward,
        }
    }

    fn sum(terms: &[Term]) -> f64 {
        terms.iter().map(|t| t.elements).sum()
    }

    /// Device elements at the peak: saved activations plus the larger of the two phases.
    pub fn peak_device(&self) -> f64 {
        Self::sum(&self.saved) + Self::sum(&self.forward).max(Self::sum(&self.backward))
    }

    /// Host elements.
    pub fn host(&self) -> f64 {
        Self::sum(&self.host)
    }
}

/// This implementation's counterparts of Eq. 1–9, under the same names (elements).
///
/// - `m_ms`: 4 × (router and this rank's expert parameters, biases and SwiGLU's `2H`
///   included) — parameters, gradients, Adam's two moments.
/// - `m_act`: what is kept from forward to backward at `n = 1` without reuse: `T_DI`, `T_M`,
///   and `T_O` (held by the combine's backward).
/// - `m_buf`: the backward's working set at its peak at `n = 1`.
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
        let (m, h, f) = (shape.d_model as f64, shape.d_hidden as f64, shape.d_inner as f64);
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
        let m_act = sum(&one.saved) + t_o;
        let m_buf = sum(&one.backward);
        let m_act_pipe = sum(&pipe.saved) + t_o;
        let delta_m_act = m_act_pipe - (sum(&reuse.saved) + t_o);
        let delta_m_buf = m_buf - sum(&reuse.backward);
        let phi = (delta_m_act + delta_m_buf) / (m_ms + m_act_pipe + sum(&pipe.backward));
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
