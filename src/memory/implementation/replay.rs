//! The replay itself: one forward + backward of the layer on one rank, the layer's own steps
//! around the exchange (permute, unpermute, shared expert, loss and their backward).

use super::ledger::Ledger;
use super::{ImplementationModel, Term};
use crate::experts::Activation;
use crate::memory::{Execution, ExpertRoute, GemmOperands, LayerShape, RankRows, Restore, Strategy};

/// A replay in progress: the shape's widths, this rank's rows, and the ledger.
pub(super) struct Replay<'a> {
    pub(super) rows: &'a RankRows,
    pub(super) strategy: Strategy,
    /// Who computes the experts (`experts.rs` and `library.rs` replay each route's steps).
    pub(super) route: ExpertRoute,
    /// The threaded executor ([`Execution::threaded`](crate::memory::Execution)): the
    /// assembled rows from the start (`steps.rs`, `assembles`), a step's reads held to its
    /// end (`experts.rs`), the gradients handed back as copies (`stack_weight_gradients`,
    /// `library_finish`).
    pub(super) threaded: bool,
    pub(super) m: f64,
    pub(super) h: f64,
    pub(super) f: f64,
    pub(super) activation: Activation,
    shared: Option<f64>,
    /// The shared expert's output is gated (Qwen2-MoE): autodiff keeps it before the gate, and
    /// the gate's scores.
    shared_gate: bool,
    /// The shared expert runs before the exchange (`shared_expert_overlap`).
    shared_overlap: bool,
    /// The combine weights multiply `T_I` (Llama 4).
    weights_on_input: bool,
    /// One rank: all-to-alls return their input, dispatched rows are views of `T_I`.
    pub(super) identity: bool,
    /// Received rows are regrouped expert-major (several ranks and several local experts).
    pub(super) permuted: bool,
    /// Whether each expert slot's weight gradients exist yet.
    pub(super) grads_seen: Vec<bool>,
    /// The backward's first `C'` step has run (a whole-partition route's job is then no
    /// longer `fresh`: it adds its products to the running sums).
    pub(super) backward_started: bool,
    /// Shadowed experts: slots beyond the local experts (see `dispatch::RoutingCounts::
    /// with_shadows`), whose copies arrive before the exchange.
    pub(super) shadows: f64,
    /// One expert's parameters, elements.
    pub(super) params: f64,
    n_ranks: f64,
    n_local: f64,
    pub(super) ledger: Ledger,
    pub(super) host: Vec<Term>,
}

impl<'a> Replay<'a> {
    pub(super) fn new(
        shape: &LayerShape,
        rows: &'a RankRows,
        strategy: Strategy,
        execution: Execution,
    ) -> Self {
        let identity = shape.n_ranks <= 1;
        // The rows say how many expert slots the rank runs: its local experts, and a copy of
        // each shadowed expert beyond them.
        let slots = rows.recv.first().map_or(shape.local_experts(), Vec::len);
        let (m, h, f) = (
            shape.d_model as f64,
            shape.d_hidden as f64,
            shape.d_inner() as f64,
        );
        Self {
            rows,
            strategy,
            route: execution.route,
            threaded: execution.threaded,
            m: shape.d_model as f64,
            h: shape.d_hidden as f64,
            f: shape.d_inner() as f64,
            activation: shape.activation,
            shared: shape.shared_expert.map(|h| h as f64),
            shared_gate: shape.shared_expert_gate,
            shared_overlap: shape.shared_expert_overlap && shape.shared_expert.is_some(),
            weights_on_input: shape.weights_on_input,
            identity,
            permuted: !identity && slots > 1,
            grads_seen: vec![false; slots],
            backward_started: false,
            shadows: slots.saturating_sub(shape.local_experts()) as f64,
            params: m * f + h * m,
            n_ranks: shape.n_ranks as f64,
            n_local: shape.local_experts() as f64,
            ledger: Ledger::default(),
            host: Vec::new(),
        }
    }

    pub(super) fn recv(&self, i: usize) -> f64 {
        self.rows.partition_recv(i) as f64
    }

    pub(super) fn send(&self, i: usize) -> f64 {
        self.rows.send[i] as f64
    }

    /// Replays forward and backward and reports each pass's peak.
    pub(super) fn run(mut self) -> ImplementationModel {
        let n = self.rows.n_partitions();
        let saved = self.layer_forward(n);
        let forward = self.ledger.take_peak();
        self.layer_backward(n);
        let backward = self.ledger.take_peak();
        ImplementationModel {
            saved,
            host: self.host,
            forward,
            backward,
        }
    }

    /// The layer's forward around the exchange, up to the caller's loss; returns what
    /// autodiff keeps for backward.
    fn layer_forward(&mut self, n: usize) -> Vec<Term> {
        let (t, s, m) = (self.rows.tokens as f64, self.rows.send_rows() as f64, self.m);
        let l = &mut self.ledger;
        // Layer forward: the finite check (a float and a bool temporary), the router's
        // scores (small, kept by autodiff), the permuted rows T_I.
        l.at("input check", &[("is_finite temporaries", t * m * 1.25)]);
        // Under the overlap the shared expert runs here, while the routing read is in flight,
        // and its output waits for the combine: all of it is live through the exchange.
        if self.shared_overlap {
            self.shared_forward(true);
        }
        let l = &mut self.ledger;
        l.alloc("permute", "T_I", s * m);
        if self.weights_on_input {
            // T_I · weights is what the exchange takes; autodiff keeps the unweighted T_I
            // for the weights' gradient until the backward reaches the permute.
            l.rename("T_I", "saved: T_I before its weights");
            l.alloc("permute", "T_I", s * m);
        }
        self.shadow_broadcast();
        self.exchange_forward(n);
        let l = &mut self.ledger;
        // T_I outlives the exchange where it is re-dispatched in backward, or (one rank) where
        // the kept T_DI are views of it.
        let keeps_input =
            self.strategy.keeps_input() || (self.identity && self.strategy.dispatched() == Restore::Keep);
        if !keeps_input {
            l.free("T_I");
        } else {
            l.rename("T_I", "T_I, kept for backward");
        }
        // Unpermute: rows · weights, a zero output, the scatter-add's result.
        l.at(
            "unpermute",
            &[("T_O · weights", s * m), ("zeros", t * m), ("y", t * m)],
        );
        l.alloc("unpermute", "y", t * m);
        if self.shared_overlap {
            self.ledger.free("shared expert output");
        } else {
            self.shared_forward(false);
        }
        let l = &mut self.ledger;
        // The caller's loss reads y; autodiff keeps T_O (and the weights) for backward.
        l.at("loss", &[("y · probe", t * m)]);
        l.free("y");
        l.live
            .iter()
            .filter(|x| x.name.starts_with("saved") || x.name.starts_with("T_I, kept"))
            .cloned()
            .collect()
    }

    /// The shared SwiGLU expert on every token, and what autodiff keeps for its backward: the
    /// first GEMM's output [T, 2Hs] (the SwiGLU node's state) and the hidden product [T, Hs]
    /// (the second GEMM's input); where the expert is gated (Qwen2-MoE), also the output
    /// before the gate [T, M] and the gate's scores [T, 1], which the product with the gate
    /// keeps for its gradients; an ungated one (DeepSeek) keeps neither. (Where the SwiGLU is
    /// recorded composed, on NdArray, autodiff also keeps the gate's sigmoid and silu, 2·Hs
    /// more.) On a bf16 library each product converts its operands into bf16 copies for its
    /// section: x and w_in, then the hidden rows and w_out. Its output [T, M] is added to `y`
    /// at once, or under the overlap (`held`) kept until the combine.
    fn shared_forward(&mut self, held: bool) {
        let Some(hs) = self.shared else {
            return;
        };
        let (t, m) = (self.rows.tokens as f64, self.m);
        let gate_kept = if self.shared_gate { t * (m + 1.0) } else { 0.0 };
        let half = self.library_half();
        let l = &mut self.ledger;
        l.alloc("shared expert", "shared expert SwiGLU input", t * 2.0 * hs);
        copies(l, "shared expert", half * (t * m + 2.0 * m * hs));
        l.alloc("shared expert", "shared expert products", t * hs + gate_kept);
        copies(l, "shared expert", half * (t * hs + hs * m));
        match held {
            true => l.alloc("shared expert", "shared expert output", t * m),
            false => l.at("shared expert", &[("output", t * m)]),
        }
    }

    /// Half an element per operand element where a product through the library multiplies
    /// bf16 copies, 0 otherwise: the layer's dense products (the shared expert's) go through
    /// the experts' library at the layer's precision (`MoeBackend::dense_matmul`), so a bf16
    /// route on a library (partition scratch, or the primitives' products) says they do; on
    /// the second, so do the primitives' own products (`experts.rs`). Each product converts
    /// its operands in its own section (`mpipemoe-cuda`'s `gemm/dense.rs`) and lets the copies
    /// go at its end.
    pub(super) fn library_half(&self) -> f64 {
        match self.route.operands() {
            GemmOperands::Bf16 { .. } => 0.5,
            GemmOperands::F32 => 0.0,
        }
    }

    /// The shadows' parameters, broadcast by their owners inside the exchange before its
    /// first dispatch (`exchange/shadows.rs`), one parameter at a time: on the host path the
    /// root's values read to the host (a buffer to receive into on the other ranks), the
    /// owner's copy for each other rank (counted for every rank: any rank may own every
    /// shadow), the copy written back, which the exchange keeps until its backward ends.
    fn shadow_broadcast(&mut self) {
        if self.shadows == 0.0 {
            return;
        }
        for per_expert in [self.m * self.f, self.h * self.m] {
            let elements = self.shadows * per_expert;
            self.ledger.at(
                "shadow broadcast",
                &[
                    ("host values", elements),
                    ("payloads", (self.n_ranks - 1.0) * elements),
                    ("copy", elements),
                ],
            );
            self.ledger
                .grow("shadow broadcast", "saved: shadow copies", elements);
        }
    }

    /// The end of the exchange's backward, before the stacking: each copy's gradient summed
    /// over the ranks onto its owner's (`ffn/grad_acc.rs`, `ExpertGradAcc::fold_shadows`), one
    /// parameter of one copy at a time (the host path: the gradient's values, a chunk per rank
    /// each way of the reduce-scatter and the all-gather, the sum). The copies' running
    /// gradients go with it, so the stacking sees the own experts' alone.
    pub(super) fn fold_shadow_gradients(&mut self) {
        if self.shadows == 0.0 {
            return;
        }
        let n_local = self.n_local as usize;
        // A copy that computed no rows on this rank has no running gradient: zeros stand in.
        let unseen = self.grads_seen[n_local..].iter().filter(|&&seen| !seen).count() as f64;
        if unseen > 0.0 {
            self.ledger.grow(
                "fold shadow gradients",
                "expert weight gradients",
                unseen * self.params,
            );
        }
        for per_expert in [self.m * self.f, self.h * self.m] {
            self.ledger.at(
                "fold shadow gradients",
                &[
                    ("host values", per_expert),
                    ("payloads", 2.0 * per_expert),
                    ("sum", per_expert),
                ],
            );
        }
        self.ledger.grow(
            "fold shadow gradients",
            "expert weight gradients",
            -self.shadows * self.params,
        );
        self.grads_seen.truncate(n_local);
    }

    /// The layer's backward from the loss, through the exchange, to the gradient of `x`.
    fn layer_backward(&mut self, n: usize) {
        let (t, s, m) = (self.rows.tokens as f64, self.rows.send_rows() as f64, self.m);
        let half = self.library_half();
        let l = &mut self.ledger;
        if let Some(hs) = self.shared {
            // On a bf16 library the second product's backward (both its products in one
            // section) holds its gradients, of the hidden rows and of w_out, beside the bf16
            // copies of the distinct operands it reads: dy, w_out and the hidden rows.
            if half > 0.0 {
                l.at(
                    "shared expert backward",
                    &[
                        ("dy", t * m),
                        ("second product's gradients", t * hs + hs * m),
                        ("bf16 operand copies", half * (t * m + hs * m + t * hs)),
                    ],
                );
            }
            // The shared branch was recorded last, so autodiff runs its backward first. The
            // gate's and the second GEMM's backwards free the products; the SwiGLU's then
            // holds dy, its input's gradient [T, Hs] and the one it makes [T, 2Hs] on top of
            // its state, which it then frees, leaving the branch's weight gradients and its
            // gradients of x (three [T, M] until the end). Gated, one of those comes through
            // the gate and the sum replaces two; ungated, the gradient of the output before the
            // gate is `dy` itself. The measured peaks differ by less than 1% of `T · M` between
            // the two at a backward peak (`tests/memory.rs`), so the count is the same for both.
            l.free("shared expert products");
            l.at(
                "shared expert backward",
                &[("dy", t * m), ("SwiGLU gradients", t * 3.0 * hs)],
            );
            l.free("shared expert SwiGLU input");
            let gate_weight = if self.shared_gate { m } else { 0.0 };
            l.alloc(
                "shared expert backward",
                "shared expert gradients (dx parts, weights)",
                3.0 * t * m + 3.0 * hs * m + gate_weight,
            );
            // And the first's, with the SwiGLU's gradient [T, 2Hs] it reads, beside the copies
            // of that gradient, w_in and x.
            if half > 0.0 {
                l.at(
                    "shared expert backward",
                    &[
                        ("SwiGLU input gradient", t * 2.0 * hs),
                        (
                            "bf16 operand copies",
                            half * (2.0 * t * hs + 2.0 * m * hs + t * m),
                        ),
                    ],
                );
            }
        }
        // Backward into the exchange: dy, the gradient of the weighted rows, then dT_O.
        l.at(
            "unpermute backward",
            &[("dy", t * m), ("d(T_O · weights)", s * m)],
        );
        l.free("T_O");
        l.alloc("unpermute backward", "dT_O", s * m);
        self.exchange_backward(n);
        let l = &mut self.ledger;
        l.free("dT_O");
        // The exchange's state, the shadows' copies among it, goes when its backward returns.
        l.free("saved: shadow copies");
        l.free("T_I, kept for backward");
        if self.weights_on_input {
            l.free("saved: T_I before its weights");
        }
        l.free("shared expert gradients (dx parts, weights)");
        // The permute's backward scatters dT_I onto a zero [T, M] gradient in place, the
        // router's GEMM makes its own gradient of x, and autodiff sums the two, all while dT_I
        // is still held. Measured with the counting allocator: with nearly every row dropped
        // (capacity 0.02) the tail is 3·T·M plus the weight gradients; with none dropped,
        // dT_I on top (GPT3-S, 16k tokens, S3 at n = 8: 4.38·T·M, the model 4.375).
        l.at(
            "permute backward",
            &[
                ("dx (permute, onto zeros in place)", t * m),
                ("dx (router GEMM)", t * m),
                ("dx", t * m),
            ],
        );
    }
}

/// A dense product's bf16 operand copies for its section, where there are any.
fn copies(l: &mut Ledger, step: &str, elements: f64) {
    if elements > 0.0 {
        l.at(step, &[("bf16 operand copies", elements)]);
    }
}

#[cfg(test)]
mod tests {
    use crate::memory::{Execution, ExpertRoute, ImplementationModel, LayerShape, RankRows, Strategy};

    /// Under `shared_expert_overlap` what autodiff keeps of the shared expert, and its output,
    /// are live through the exchange. At a shape whose forward peaks inside the exchange (a
    /// narrow shared expert beside wide routed experts) the forward's peak grows by exactly
    /// them, `T · (3·Hs + 2·M)`, at the same step, and the backward, which burn's autodiff
    /// runs by depth whatever the order of issue, does not move. A replay that ran the shared
    /// expert after the exchange either way fails it.
    #[test]
    fn the_overlap_holds_the_shared_expert_through_the_exchange() {
        let (t, m, hs) = (512.0, 128.0, 64.0);
        // Gated, the output before the gate and the gate's scores are kept as well: `T·(M + 1)`.
        for (gated, kept) in [
            (true, t * (3.0 * hs + 2.0 * m + 1.0)),
            (false, t * (3.0 * hs + m)),
        ] {
            let shape = LayerShape {
                n_experts: 2,
                shared_expert: Some(64),
                shared_expert_gate: gated,
                ..LayerShape::paper(512, 128, 2048, 1, 1)
            };
            let run = |overlap| {
                let shape = LayerShape {
                    shared_expert_overlap: overlap,
                    ..shape
                };
                ImplementationModel::for_execution(
                    &shape,
                    &RankRows::balanced(&shape),
                    Strategy::None,
                    Execution::in_order(ExpertRoute::ExpertByExpert),
                )
            };
            let (plain, overlap) = (run(false), run(true));
            assert!(
                !plain.forward.step.contains("shared") && !plain.forward.step.contains("permute"),
                "the forward's peak is the exchange's: {:?}",
                plain.forward
            );
            assert_eq!(plain.forward.step, overlap.forward.step);
            assert_eq!(
                overlap.forward.elements - plain.forward.elements,
                kept,
                "gated {gated}"
            );
            assert_eq!(plain.backward, overlap.backward);
            assert_eq!(plain.saved, overlap.saved);
        }
    }
}
