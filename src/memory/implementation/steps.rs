//! The exchange's steps in the replay: one loop over a schedule (forward or backward), the
//! all-to-alls and host copies, and the allowance for the streams running at once.

use super::ledger::StepMemory;
use super::replay::Replay;
use super::term;
use crate::pipeline::schedule::{Op, Role, Schedule, Step, Stream};

impl Replay<'_> {
    /// The fused exchange's forward: `T_O` is assembled from the partitions' returns, into
    /// a buffer made before the first step (`exchange/assemble.rs`, `RowAssembler`), except
    /// for one partition in issue order, whose returned rows are the result.
    pub(super) fn exchange_forward(&mut self, n: usize) {
        let m = self.m;
        let s_rows = self.rows.send_rows() as f64;
        if self.assembles(n) {
            self.ledger.alloc("exchange", "T_O", s_rows * m);
        }
        self.replay_schedule(&Schedule::forward(n, self.strategy), n);
        self.forward_weight_copies_end();
    }

    /// The fused exchange's backward: `dT_I` is assembled likewise, and the experts' weight
    /// gradients are stacked at the end.
    pub(super) fn exchange_backward(&mut self, n: usize) {
        let m = self.m;
        let s_rows = self.rows.send_rows() as f64;
        if self.assembles(n) {
            self.ledger.alloc("exchange backward", "dT_I", s_rows * m);
        }
        self.replay_schedule(&Schedule::backward(n, self.strategy), n);
        self.fold_shadow_gradients();
        self.stack_weight_gradients();
        // The backward's pass store, and the step's, go when the exchange's backward returns.
        self.ledger.free(super::library::WEIGHT_COPIES);
        self.ledger.free(super::library::SAVED_WEIGHT_COPIES);
    }

    /// Replays the steps of `schedule` (of `n` partitions) in issue order, then adds what the other streams may hold
    /// while each compute step runs.
    fn replay_schedule(&mut self, schedule: &Schedule, n: usize) {
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
            }
            memory.push(self.step_memory(step, before));
        }
        // In issue order too: a rank's exchange buffers are let go as its peers take them, on
        // the peers' time, so the steps of one rank's schedule overlap in memory even where
        // they do not in time. Measured (`tests/memory.rs`, in order, two ranks): without
        // the allowance the primitives' rows at n = 4 read 1.09–1.13 of the model, with it
        // 0.99–1.02.
        self.allow_concurrency(schedule, &memory);
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
        if !self.assembles(n) {
            self.ledger.alloc(name, assembled, q * m);
        }
    }

    /// Whether a pass of `n` partitions assembles its returned rows into a buffer of its
    /// own: above one partition, and with the threaded executor always (its workers write
    /// into a buffer the calling thread made, `RowAssembler::new`).
    fn assembles(&self, n: usize) -> bool {
        n > 1 || self.threaded
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

    fn step_memory(&self, step: &Step, before: f64) -> StepMemory {
        StepMemory {
            stream: step.stream(),
            before,
            after: self.ledger.total(),
            peak: self.ledger.step_peak.clone(),
        }
    }

    /// The replay runs the steps one after another in issue order, but the threaded executor
    /// runs the three streams at once (and in issue order the peers' hold on this rank's
    /// buffers does much the same): while `C_i` runs, the comm stream may still be returning the
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
