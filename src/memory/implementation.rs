//! What this implementation holds, step by step: a replay of one forward + backward of the
//! layer on one rank, in the exchange's schedule order, that tracks every tensor's bytes and
//! the transient buffers of each step, and reports the peak with what is live at it.
//!
//! The sizes follow the code of the fused op (`exchange/fused.rs`, `exchange/ffn.rs`) and of
//! the layer around it, and were checked against a counting allocator on the Flex backend
//! (`tools/examples/memory.rs`): a GEMM briefly holds a second buffer of its output's size, a
//! tensor handed to the communicator by value is sent without a copy (a view of a shared
//! tensor is copied first), and the GELU derivative is computed in place. Backends that
//! allocate differently (NdArray composes the GELU derivative from several element-wise ops)
//! can peak higher than modelled.

use serde::Serialize;

use super::{LayerShape, RankRows, Restore, Strategy};
use crate::experts::Activation;
use crate::pipeline::schedule::{Op, Role, Schedule, Step, Stream};

/// One named tensor (or group of tensors) of the model, in elements.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Term {
    /// What it is (`T_DI[2]`, `z GEMM`, `expert weight gradients`, ...).
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

/// The moment of a pass at which the most is live, and what is live then.
#[derive(Debug, Clone, PartialEq, Serialize, Default)]
pub struct Phase {
    /// The step (`C'_3`, `unpermute`, ...).
    pub step: String,
    /// Elements live at that moment.
    pub elements: f64,
    /// Every tensor live then, persistent and transient.
    pub terms: Vec<Term>,
}

/// The live tensors of a replay and the highest point so far.
#[derive(Debug, Default)]
struct Ledger {
    live: Vec<Term>,
    peak: Phase,
    /// The highest point of the current step, and what was live then.
    step_peak: Phase,
}

/// One schedule step's memory, for the concurrency allowance.
#[derive(Debug, Clone)]
struct StepMemory {
    stream: Stream,
    before: f64,
    after: f64,
    peak: Phase,
}

impl Ledger {
    fn total(&self) -> f64 {
        self.live.iter().map(|t| t.elements).sum()
    }

    /// Records the moment `step` runs with `transient` buffers on top of what is live.
    fn at(&mut self, step: &str, transient: &[(&str, f64)]) {
        let total = self.total() + transient.iter().map(|t| t.1).sum::<f64>();
        let phase = || {
            let mut terms = self.live.clone();
            terms.extend(transient.iter().filter(|t| t.1 > 0.0).map(|&(n, e)| term(n, e)));
            Phase {
                step: step.to_string(),
                elements: total,
                terms,
            }
        };
        if total > self.step_peak.elements {
            self.step_peak = phase();
        }
        if total > self.peak.elements {
            self.peak = phase();
        }
    }

    /// Starts a schedule step: its peak starts from what is live.
    fn begin_step(&mut self) -> f64 {
        let total = self.total();
        self.step_peak = Phase {
            step: String::new(),
            elements: total,
            terms: self.live.clone(),
        };
        total
    }

    /// Raises the pass's peak to `phase` if it is higher.
    fn consider(&mut self, phase: Phase) {
        if phase.elements > self.peak.elements {
            self.peak = phase;
        }
    }

    fn alloc(&mut self, step: &str, name: impl Into<String>, elements: f64) {
        self.live.push(term(name, elements));
        self.at(step, &[]);
    }

    /// Adds `elements` to the live tensor `name` (allocating it if it is not live).
    fn grow(&mut self, step: &str, name: &str, elements: f64) {
        match self.live.iter_mut().find(|t| t.name == name) {
            Some(t) => t.elements += elements,
            None => self.live.push(term(name, elements)),
        }
        self.at(step, &[]);
    }

    fn free(&mut self, name: &str) -> f64 {
        match self.live.iter().position(|t| t.name == name) {
            Some(i) => self.live.remove(i).elements,
            None => 0.0,
        }
    }

    fn rename(&mut self, from: &str, to: impl Into<String>) {
        if let Some(t) = self.live.iter_mut().find(|t| t.name == from) {
            t.name = to.into();
        }
    }

    /// Takes the peak so far and restarts it from what is live now.
    fn take_peak(&mut self) -> Phase {
        let now = Phase {
            step: String::new(),
            elements: self.total(),
            terms: self.live.clone(),
        };
        std::mem::replace(&mut self.peak, now)
    }
}

/// What this implementation holds for one forward + backward of the layer on one rank
/// (elements), step by step (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ImplementationModel {
    /// Kept on the device from forward to backward.
    pub saved: Vec<Term>,
    /// Kept on the host (offloads).
    pub host: Vec<Term>,
    /// The forward pass's peak.
    pub forward: Phase,
    /// The backward pass's peak.
    pub backward: Phase,
}

impl ImplementationModel {
    /// The model for `shape` with balanced routing.
    pub fn new(shape: &LayerShape, strategy: Strategy) -> Self {
        Self::for_rows(shape, &RankRows::balanced(shape), strategy)
    }

    /// The model for one rank that handles `rows` (its routing of a real batch).
    pub fn for_rows(shape: &LayerShape, rows: &RankRows, strategy: Strategy) -> Self {
        Replay::new(shape, rows, strategy).run()
    }

    /// Device elements at the peak of forward + backward.
    pub fn peak_device(&self) -> f64 {
        self.forward.elements.max(self.backward.elements)
    }

    /// Host elements (the offloads).
    pub fn host(&self) -> f64 {
        self.host.iter().map(|t| t.elements).sum()
    }

    /// The pass and step of the peak.
    pub fn peak(&self) -> &Phase {
        if self.forward.elements >= self.backward.elements {
            &self.forward
        } else {
            &self.backward
        }
    }
}

struct Replay<'a> {
    rows: &'a RankRows,
    strategy: Strategy,
    m: f64,
    h: f64,
    f: f64,
    activation: Activation,
    shared: Option<f64>,
    /// One rank: all-to-alls return their input, dispatched rows are views of `T_I`.
    identity: bool,
    /// Received rows are regrouped expert-major (several ranks and several local experts).
    permuted: bool,
    /// Whether each local expert's weight gradients exist yet.
    grads_seen: Vec<bool>,
    ledger: Ledger,
    host: Vec<Term>,
}

impl<'a> Replay<'a> {
    fn new(shape: &LayerShape, rows: &'a RankRows, strategy: Strategy) -> Self {
        let identity = shape.n_ranks <= 1;
        Self {
            rows,
            strategy,
            m: shape.d_model as f64,
            h: shape.d_hidden as f64,
            f: shape.d_inner() as f64,
            activation: shape.activation,
            shared: shape.shared_expert.map(|h| h as f64),
            identity,
            permuted: !identity && shape.local_experts() > 1,
            grads_seen: vec![false; shape.local_experts()],
            ledger: Ledger::default(),
            host: Vec::new(),
        }
    }

    fn recv(&self, i: usize) -> f64 {
        self.rows.partition_recv(i) as f64
    }

    fn send(&self, i: usize) -> f64 {
        self.rows.send[i] as f64
    }

    fn run(mut self) -> ImplementationModel {
        let (t, s, m) = (self.rows.tokens as f64, self.rows.send_rows() as f64, self.m);
        let n = self.rows.n_partitions();
        let l = &mut self.ledger;
        // Layer forward: the finite check (a float and a bool temporary), the router's
        // scores (small, kept by autodiff), the permuted rows T_I.
        l.at("input check", &[("is_finite temporaries", t * m * 1.25)]);
        l.alloc("permute", "T_I", s * m);
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
        if let Some(hs) = self.shared {
            // The shared SwiGLU expert on every token, and what autodiff keeps for its
            // backward: the first GEMM's output [T, 2Hs], the gate's sigmoid, silu and the
            // hidden product [T, Hs] each, and the output before the gate [T, M] (measured:
            // 5·Hs + M per token).
            l.alloc("shared expert", "shared expert activations", t * (5.0 * hs + m));
            l.at("shared expert", &[("gated output", t * m)]);
        }
        // The caller's loss reads y; autodiff keeps T_O (and the weights) for backward.
        l.at("loss", &[("y · probe", t * m)]);
        l.free("y");
        let saved: Vec<Term> = l
            .live
            .iter()
            .filter(|x| x.name.starts_with("saved") || x.name.starts_with("T_I, kept"))
            .cloned()
            .collect();
        let forward = l.take_peak();

        if let Some(hs) = self.shared {
            // The shared branch was recorded last, so autodiff runs its backward first: dy and
            // the gradient of its first GEMM's output on top of its activations, which it then
            // frees, leaving its weight gradients and its gradients of x (through its first
            // GEMM and through its gate, and their sum: three [T, M] until the end).
            l.at(
                "shared expert backward",
                &[("dy", t * m), ("shared gradients", t * 2.0 * hs)],
            );
            l.free("shared expert activations");
            l.alloc(
                "shared expert backward",
                "shared expert gradients (dx parts, weights)",
                3.0 * t * m + 3.0 * hs * m + m,
            );
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
        l.free("T_I, kept for backward");
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
        let backward = l.take_peak();
        ImplementationModel {
            saved,
            host: self.host,
            forward,
            backward,
        }
    }

    /// An all-to-all of `send` rows out and `recv` rows in. A view of a shared tensor (a
    /// partition of `T_I` or `dT_O`) is copied before it is sent; an owned one is moved.
    fn all_to_all(&mut self, step: &str, send: f64, recv: f64, view: bool) {
        if self.identity {
            return;
        }
        let m = self.m;
        let copy = if view { send * m } else { 0.0 };
        self.ledger.at(
            step,
            &[
                ("send copy", copy),
                ("payloads", send * m),
                ("received", recv * m),
            ],
        );
    }

    fn exchange_forward(&mut self, n: usize) {
        let m = self.m;
        let s_rows = self.rows.send_rows() as f64;
        if n > 1 {
            self.ledger.alloc("exchange", "T_O", s_rows * m);
        }
        let schedule = Schedule::forward(n, self.strategy);
        let mut memory = Vec::with_capacity(schedule.steps.len());
        for step in &schedule.steps {
            let before = self.ledger.begin_step();
            match step.op {
                Op::Dispatch(i) => self.dispatch_step(&format!("S_{i}"), i, "T_DI"),
                Op::Offload(role, i) => {
                    let (width, what) = self.host_copy(&format!("offload {i}"), role, i);
                    self.host.push(term(format!("{what}[{i}]"), self.recv(i) * width));
                    if role == Role::Hidden {
                        self.ledger.free("T_M buffer");
                    }
                }
                Op::Compute(i) => self.compute(i),
                Op::Combine(i) => self.combine_step(&format!("R_{i}"), i, n, "T_DO", "T_O"),
                _ => unreachable!("forward steps only"),
            }
            memory.push(self.step_memory(step, before));
        }
        self.allow_concurrency(&schedule, &memory);
    }
    fn step_memory(&self, step: &Step, before: f64) -> StepMemory {
        StepMemory {
            stream: step.stream(),
            before,
            after: self.ledger.total(),
            peak: self.ledger.step_peak.clone(),
        }
    }

    /// The replay runs the steps one after another in issue order, but the executor runs
    /// the three streams at once: while `C_i` runs, the comm stream may still be returning the
    /// previous partition (its output buffer not yet freed) or already receiving the next one
    /// (its buffers already allocated), and the copy stream likewise. For every compute step,
    /// the most memory one step of each other stream that is not ordered with it can hold on
    /// top of the replay's figure is added.
    fn allow_concurrency(&mut self, schedule: &Schedule, memory: &[StepMemory]) {
        let reach = reachability(schedule);
        for (c, mem) in memory.iter().enumerate() {
            if mem.stream != Stream::Compute {
                continue;
            }
            let mut phase = mem.peak.clone();
            for stream in [Stream::Comm, Stream::Copy] {
                let extra = (0..memory.len())
                    .filter(|&s| memory[s].stream == stream && !reach[c][s] && !reach[s][c])
                    .map(|s| {
                        let other = &memory[s];
                        // Issued before: the replay already freed its inputs; after: it had
                        // not yet allocated its outputs.
                        let extra = other.peak.elements - if s < c { other.after } else { other.before };
                        (extra.max(0.0), s)
                    })
                    .max_by(|a, b| a.0.total_cmp(&b.0));
                if let Some((extra, s)) = extra.filter(|e| e.0 > 0.0) {
                    phase.elements += extra;
                    phase.step = format!("{} while {:?} runs", phase.step, schedule.steps[s].op);
                    phase
                        .terms
                        .push(term(format!("{:?} in flight", schedule.steps[s].op), extra));
                }
            }
            self.ledger.consider(phase);
        }
    }

    /// `C_i`: every local expert's FFN on its rows.
    fn compute(&mut self, i: usize) {
        let (m, h, f) = (self.m, self.h, self.f);
        let name = format!("C_{i}");
        let keeps_hidden =
            self.strategy.hidden() != Restore::Recompute && self.strategy.hidden() != Restore::Recommunicate;
        // SwiGLU's silu(gate) · up holds one [r, H] temporary besides its result.
        let act_temp = match self.activation {
            Activation::SwiGlu => 1.0,
            _ => 0.0,
        };
        let (mut outs, mut zs) = (0.0, 0.0);
        let experts: Vec<f64> = self.rows.recv[i].iter().map(|&r| r as f64).collect();
        for &r in experts.iter().filter(|&&r| r > 0.0) {
            let l = &mut self.ledger;
            l.at(
                &name,
                &[
                    ("outputs so far", outs),
                    ("T_M so far", zs),
                    ("z GEMM", 2.0 * r * f),
                ],
            );
            l.at(
                &name,
                &[
                    ("outputs so far", outs),
                    ("T_M so far", zs),
                    ("z", r * f),
                    ("activation", r * h),
                    ("activation temporaries", act_temp * r * h),
                ],
            );
            l.at(
                &name,
                &[
                    ("outputs so far", outs),
                    ("T_M so far", zs),
                    ("z", r * f),
                    ("activation", r * h),
                    ("output GEMM", 2.0 * r * m),
                ],
            );
            outs += r * m;
            if keeps_hidden {
                zs += r * f;
            }
        }
        let rows = self.recv(i);
        let l = &mut self.ledger;
        if experts.iter().filter(|&&r| r > 0.0).count() > 1 {
            l.at(
                &name,
                &[
                    ("outputs so far", outs),
                    ("T_M so far", zs),
                    ("concatenated", rows * m),
                ],
            );
        }
        match self.strategy.hidden() {
            Restore::Keep => l.alloc(&name, format!("saved T_M[{i}]"), rows * f),
            Restore::Offload => l.alloc(&name, "T_M buffer", rows * f),
            _ => {}
        }
        let di = format!("T_DI[{i}]");
        if self.strategy.dispatched() == Restore::Keep {
            l.rename(&di, format!("saved T_DI[{i}]"));
        } else {
            l.free(&di);
        }
        l.alloc(&name, format!("T_DO[{i}]"), rows * m);
    }

    fn exchange_backward(&mut self, n: usize) {
        let m = self.m;
        let s_rows = self.rows.send_rows() as f64;
        if n > 1 {
            self.ledger.alloc("exchange backward", "dT_I", s_rows * m);
        }
        let schedule = Schedule::backward(n, self.strategy);
        let mut memory = Vec::with_capacity(schedule.steps.len());
        for step in &schedule.steps {
            let before = self.ledger.begin_step();
            match step.op {
                Op::DispatchGrad(i) => self.dispatch_step(&format!("S'_{i}"), i, "dT_DO"),
                Op::Redispatch(i) => self.dispatch_step(&format!("re-dispatch {i}"), i, "T_DI"),
                Op::Prefetch(role, i) => {
                    let name = format!("prefetch {i}");
                    let (width, what) = self.host_copy(&name, role, i);
                    let rows = self.recv(i);
                    self.ledger.alloc(&name, format!("{what}[{i}]"), rows * width);
                }
                Op::ComputeGrad(i) => self.compute_backward(i),
                Op::CombineGrad(i) => self.combine_step(&format!("R'_{i}"), i, n, "dT_DI", "dT_I"),
                _ => unreachable!("backward steps only"),
            }
            memory.push(self.step_memory(step, before));
        }
        self.allow_concurrency(&schedule, &memory);
        self.stack_weight_gradients();
    }

    /// A dispatch all-to-all of partition `i` (S, S' or a re-dispatch): this rank's rows out,
    /// the received rows in as `what[i]`, reordered expert-major where routing permutes them.
    fn dispatch_step(&mut self, name: &str, i: usize, what: &str) {
        let m = self.m;
        let (q, p) = (self.send(i), self.recv(i));
        self.all_to_all(name, q, p, true);
        if self.permuted {
            self.ledger
                .at(name, &[("received", p * m), ("expert-major copy", p * m)]);
        }
        let size = if self.identity { 0.0 } else { p * m };
        self.ledger.alloc(name, format!("{what}[{i}]"), size);
    }

    /// A combine all-to-all of partition `i` (R or R'): the expert outputs `freed[i]` go back,
    /// and with one partition the returned rows are the assembled result `assembled` itself.
    fn combine_step(&mut self, name: &str, i: usize, n: usize, freed: &str, assembled: &str) {
        let m = self.m;
        let (q, p) = (self.send(i), self.recv(i));
        if self.permuted {
            self.ledger.at(name, &[("source-major copy", p * m)]);
        }
        self.all_to_all(name, p, q, false);
        self.ledger.free(&format!("{freed}[{i}]"));
        if n == 1 {
            self.ledger.alloc(name, assembled, q * m);
        }
    }

    /// The transient of a device ↔ host copy of partition `i`'s `role` (all its rows for
    /// `T_DI`, the largest expert's rows for `T_M`, which is copied expert by expert); returns
    /// the role's width and name.
    fn host_copy(&mut self, name: &str, role: Role, i: usize) -> (f64, &'static str) {
        let (width, what, rows) = if role == Role::Dispatched {
            (self.m, "T_DI", self.recv(i))
        } else {
            let largest = self.rows.recv[i].iter().copied().max().unwrap_or(0) as f64;
            (self.f, "T_M", largest)
        };
        self.ledger.at(name, &[("host copy", rows * width)]);
        (width, what)
    }

    /// The end of the backward: the weight gradients are stacked role by role
    /// (`ffn.rs::ExpertGradAcc::finish`). An expert that received no rows gets zeros, and with
    /// more than one local expert the concatenation copies a role's gradients while its
    /// per-expert parts are still held.
    fn stack_weight_gradients(&mut self) {
        let (m, h, f) = (self.m, self.h, self.f);
        let experts = self.grads_seen.len() as f64;
        let unseen = self.grads_seen.iter().filter(|&&seen| !seen).count() as f64;
        self.grads_seen.iter_mut().for_each(|seen| *seen = true);
        let l = &mut self.ledger;
        if unseen > 0.0 {
            l.grow(
                "stack weight gradients",
                "expert weight gradients",
                unseen * (h * m + m * f),
            );
        }
        if experts > 1.0 {
            l.at(
                "stack weight gradients",
                &[("stacked copy of one role", experts * (m * f).max(h * m))],
            );
        }
    }

    /// `C'_i`: every local expert's FFN backward on its rows (recomputing `T_M` where it was
    /// dropped), accumulating the weight gradients.
    fn compute_backward(&mut self, i: usize) {
        let (m, h, f) = (self.m, self.h, self.f);
        let name = format!("C'_{i}");
        let recompute = self.strategy.hidden() == Restore::Recompute;
        let experts: Vec<f64> = self.rows.recv[i].iter().map(|&r| r as f64).collect();
        let (act_temp, grad_temp, grad_width) = match self.activation {
            Activation::Gelu => (0.0, 0.0, 0.0),
            Activation::Relu => (0.0, 0.0, h),
            // SwiGLU's backward: two [r, H] temporaries and the [r, 2H] result.
            Activation::SwiGlu => (h, 2.0 * h, f),
        };
        let mut grads_x = 0.0;
        // The partition's T_M is freed expert by expert as each expert's z is consumed.
        let hidden_name = if self.strategy.hidden() == Restore::Keep {
            format!("saved T_M[{i}]")
        } else {
            format!("T_M[{i}]")
        };
        for (e, &r) in experts.iter().enumerate().filter(|(_, &r)| r > 0.0) {
            // An expert's weight gradients are allocated by its first backward GEMMs and
            // added to in place by later partitions.
            let first = !self.grads_seen[e];
            self.grads_seen[e] = true;
            let l = &mut self.ledger;
            let z = if recompute {
                l.at(
                    &name,
                    &[
                        ("input gradients so far", grads_x),
                        ("z GEMM (recompute)", 2.0 * r * f),
                    ],
                );
                r * f
            } else {
                0.0
            };
            l.at(
                &name,
                &[
                    ("input gradients so far", grads_x),
                    ("z (recomputed)", z),
                    ("activation", r * h),
                    ("activation temporaries", act_temp * r),
                ],
            );
            l.at(
                &name,
                &[
                    ("input gradients so far", grads_x),
                    ("z (recomputed)", z),
                    ("activation", r * h),
                    ("dW_out GEMM", 2.0 * h * m),
                ],
            );
            if first {
                l.grow(&name, "expert weight gradients", h * m);
            }
            l.at(
                &name,
                &[
                    ("input gradients so far", grads_x),
                    ("z (recomputed)", z),
                    ("dA GEMM", 2.0 * r * h),
                ],
            );
            l.at(
                &name,
                &[
                    ("input gradients so far", grads_x),
                    ("z (recomputed)", z),
                    ("dA", r * h),
                    ("activation backward temporaries", r * (grad_temp + grad_width)),
                ],
            );
            // z is consumed by the activation's backward.
            let consumed = r * f;
            if let Some(t) = l.live.iter_mut().find(|t| t.name == hidden_name) {
                t.elements = (t.elements - consumed).max(0.0);
            }
            let dz = if grad_width > 0.0 { r * grad_width } else { r * h };
            l.at(
                &name,
                &[
                    ("input gradients so far", grads_x),
                    ("dZ", dz),
                    ("dW_in GEMM", 2.0 * m * f),
                ],
            );
            if first {
                l.grow(&name, "expert weight gradients", m * f);
            }
            l.at(
                &name,
                &[
                    ("input gradients so far", grads_x),
                    ("dZ", dz),
                    ("dX GEMM", 2.0 * r * m),
                ],
            );
            grads_x += r * m;
        }
        let rows = self.recv(i);
        let l = &mut self.ledger;
        if experts.iter().filter(|&&r| r > 0.0).count() > 1 {
            l.at(
                &name,
                &[("input gradients so far", grads_x), ("concatenated", rows * m)],
            );
        }
        l.free(&hidden_name);
        l.free(&format!("dT_DO[{i}]"));
        l.free(&format!("T_DI[{i}]"));
        l.free(&format!("saved T_DI[{i}]"));
        l.alloc(&name, format!("dT_DI[{i}]"), rows * m);
    }
}

/// `reach[a][b]`: step `b` cannot start before step `a` has finished (through dependencies
/// and the order of each stream).
fn reachability(schedule: &Schedule) -> Vec<Vec<bool>> {
    let n = schedule.steps.len();
    let mut next: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (b, step) in schedule.steps.iter().enumerate() {
        for &a in &step.deps {
            next[a].push(b);
        }
    }
    for stream in Stream::ALL {
        for pair in schedule.stream_order(stream).windows(2) {
            next[pair[0]].push(pair[1]);
        }
    }
    (0..n)
        .map(|a| {
            let mut seen = vec![false; n];
            let mut stack = next[a].clone();
            while let Some(b) = stack.pop() {
                if !seen[b] {
                    seen[b] = true;
                    stack.extend(next[b].iter().copied());
                }
            }
            seen
        })
        .collect()
}
