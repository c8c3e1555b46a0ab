//! A three-stream replay of the exchange's forward + backward schedule.

use serde::Serialize;

use crate::memory::{ImplementationModel, LayerShape, Restore, Strategy};
use crate::pipeline::chunk_len;
pub use crate::pipeline::schedule::Stream;
use crate::pipeline::schedule::{Op, Role, Schedule as ExchangeSchedule};
use crate::tuning::Profile;

/// A stream's index in the simulator's arrays.
fn stream_index(stream: Stream) -> usize {
    match stream {
        Stream::Compute => 0,
        Stream::Comm => 1,
        Stream::Copy => 2,
    }
}

/// One step of the schedule with its cost and, after the replay, its times (the schedule's own
/// step is [`backend::Op`](crate::backend::Op)).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimedStep {
    /// `S0`, `C0`, `R0`, `D0` (offload), `S'0`, `T0` (T_DI restore), `H0` (prefetch), ...
    pub name: String,
    /// The stream it runs on.
    pub stream: Stream,
    /// Fixed cost, seconds (not slowed by other streams).
    pub latency: f64,
    /// Work at full speed, seconds (slowed by interference).
    pub work: f64,
    /// Ops that must finish first (indices).
    pub deps: Vec<usize>,
    /// When it started, seconds (after simulation).
    pub start: f64,
    /// When it finished, seconds (after simulation).
    pub end: f64,
}

/// What the simulator predicts for one `(n, strategy)`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimResult {
    /// Partitions.
    pub n_partitions: usize,
    /// Strategy.
    pub strategy: Strategy,
    /// Forward + backward of the exchange, seconds.
    pub time: f64,
    /// Forward alone, seconds.
    pub forward: f64,
    /// Time each stream was busy, seconds: compute, comm, copy.
    pub busy: [f64; 3],
    /// Device bytes at the peak (this implementation's memory model).
    pub peak_bytes: f64,
    /// Host bytes (offloads).
    pub host_bytes: f64,
    /// The replayed schedule.
    #[serde(skip)]
    pub ops: Vec<TimedStep>,
}

/// The exchange's own [`Schedule`] (the one the executors run) for `shape` and `strategy`,
/// with each step's time from the profile's rates: forward, then backward, which starts when
/// the forward has finished.
fn schedule(
    shape: &LayerShape,
    strategy: Strategy,
    profile: &Profile,
    elem_bytes: usize,
) -> (Vec<TimedStep>, usize) {
    let costs = StepCosts::new(shape, strategy, profile, elem_bytes);
    let n = costs.n;
    let mut ops: Vec<TimedStep> = Vec::new();
    let add = |steps: &ExchangeSchedule, after: &[usize], ops: &mut Vec<TimedStep>| {
        let base = ops.len();
        for step in &steps.steps {
            let (stream, latency, work, name) = costs.of(step.op);
            let mut deps: Vec<usize> = step.deps.iter().map(|d| base + d).collect();
            deps.extend_from_slice(after);
            ops.push(TimedStep {
                name,
                stream,
                latency,
                work,
                deps,
                start: 0.0,
                end: 0.0,
            });
        }
        base..ops.len()
    };
    let forward = add(&ExchangeSchedule::forward(n, strategy), &[], &mut ops);
    let forward_ops = forward.end;
    let forward_end: Vec<usize> = forward.collect();
    add(&ExchangeSchedule::backward(n, strategy), &forward_end, &mut ops);
    (ops, forward_ops)
}

/// What each step of the exchange costs at the profile's rates.
struct StepCosts<'a> {
    profile: &'a Profile,
    n: usize,
    /// Rows of `T_I` (`tokens · top_k`).
    rows: f64,
    m: f64,
    h: f64,
    f: f64,
    bytes: f64,
    /// 1 where backward recomputes `T_M` (one more GEMM), else 0.
    recompute: f64,
}

impl<'a> StepCosts<'a> {
    fn new(shape: &LayerShape, strategy: Strategy, profile: &'a Profile, elem_bytes: usize) -> Self {
        Self {
            profile,
            n: shape.n_partitions.max(1),
            rows: (shape.tokens * shape.top_k) as f64,
            m: shape.d_model as f64,
            h: shape.d_hidden as f64,
            f: shape.d_inner() as f64,
            bytes: elem_bytes as f64,
            recompute: if strategy.hidden() == Restore::Recompute {
                1.0
            } else {
                0.0
            },
        }
    }

    fn part_rows(&self, i: usize) -> f64 {
        chunk_len(self.rows as usize, self.n, i) as f64
    }

    /// `count` GEMMs of `[r, M] × [M, H]`: a GEMM over `r` rows runs at
    /// `w_comp · r / (r + half)`, so fine partitions under-use the device.
    fn gemm(&self, r: f64, count: f64) -> f64 {
        let flops = count * 2.0 * r * self.m * self.h;
        flops / (self.profile.w_comp * r / (r + self.profile.gemm_half_rows)).max(1.0)
    }

    fn comm(&self, r: f64) -> f64 {
        r * self.m * self.bytes / self.profile.w_comm
    }

    fn copy(&self, r: f64, width: f64) -> f64 {
        r * width * self.bytes / self.profile.w_mem
    }

    /// A step's stream, latency, work at full speed (seconds) and name.
    fn of(&self, op: Op) -> (Stream, f64, f64, String) {
        let p = self.profile;
        let all_to_all =
            |i: usize, name: String| (Stream::Comm, p.comm_latency, self.comm(self.part_rows(i)), name);
        let width = |role: Role| if role == Role::Dispatched { self.m } else { self.f };
        match op {
            Op::Dispatch(i) => all_to_all(i, format!("S{i}")),
            Op::Combine(i) => all_to_all(i, format!("R{i}")),
            Op::DispatchGrad(i) => all_to_all(i, format!("S'{i}")),
            Op::Redispatch(i) => all_to_all(i, format!("T{i}")),
            Op::CombineGrad(i) => all_to_all(i, format!("R'{i}")),
            Op::Compute(i) => (
                Stream::Compute,
                p.comp_latency,
                self.gemm(self.part_rows(i), 2.0),
                format!("C{i}"),
            ),
            Op::ComputeGrad(i) => (
                Stream::Compute,
                p.comp_latency,
                self.gemm(self.part_rows(i), 4.0 + self.recompute),
                format!("C'{i}"),
            ),
            Op::Offload(role, i) => (
                Stream::Copy,
                p.mem_latency,
                self.copy(self.part_rows(i), width(role)),
                format!("D{i}"),
            ),
            Op::Prefetch(role, i) => (
                Stream::Copy,
                p.mem_latency,
                self.copy(self.part_rows(i), width(role)),
                format!("H{i}"),
            ),
        }
    }
}

/// Runs the schedule: each stream executes its ops in issue order, an op starts when its
/// stream is free and its dependencies are done, and its work proceeds at a speed that
/// depends on which streams are busy (σ for compute; μ_comp or μ_all for the all-to-all; η_all
/// for copies while an all-to-all runs).
fn replay(ops: &mut [TimedStep], profile: &Profile) -> [f64; 3] {
    let count = ops.len();
    let mut queues: [Vec<usize>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for (i, op) in ops.iter().enumerate() {
        queues[stream_index(op.stream)].push(i);
    }
    let mut head = [0usize; 3];
    let mut running: [Option<(usize, f64, f64)>; 3] = [None; 3]; // (op, latency left, work left)
    let mut done = vec![false; count];
    let mut finished = 0;
    let mut now = 0.0;
    let mut busy = [0.0; 3];
    while finished < count {
        // Start whatever can start.
        for s in 0..3 {
            if running[s].is_none() && head[s] < queues[s].len() {
                let op = queues[s][head[s]];
                if ops[op].deps.iter().all(|&d| done[d]) {
                    ops[op].start = now;
                    running[s] = Some((op, ops[op].latency, ops[op].work));
                    head[s] += 1;
                }
            }
        }
        let active = [running[0].is_some(), running[1].is_some(), running[2].is_some()];
        let factor = |s: usize| -> f64 {
            match s {
                0 if active[1] || active[2] => profile.sigma,
                1 if active[0] && active[2] => profile.mu_all,
                1 if active[2] => profile.mu_all,
                1 if active[0] => profile.mu_comp,
                2 if active[1] => profile.eta_all,
                _ => 1.0,
            }
        };
        // Time to the next completion (of a latency phase or of the work).
        let mut dt = f64::INFINITY;
        for (s, slot) in running.iter().enumerate() {
            if let Some((_, lat, work)) = slot {
                let t = if *lat > 0.0 { *lat } else { work / factor(s) };
                dt = dt.min(t);
            }
        }
        assert!(
            dt.is_finite(),
            "the schedule deadlocked: a dependency is never issued"
        );
        now += dt;
        for s in 0..3 {
            if let Some((op, lat, work)) = running[s].as_mut() {
                busy[s] += dt;
                if *lat > 0.0 {
                    *lat -= dt;
                } else {
                    *work -= dt * factor(s);
                }
                if *lat <= 1e-15 && *work <= 1e-15 {
                    ops[*op].end = now;
                    done[*op] = true;
                    finished += 1;
                    running[s] = None;
                } else if *lat < 0.0 {
                    *lat = 0.0;
                }
            }
        }
    }
    busy
}

/// Predicts time and memory of one forward + backward of the exchange with `shape`'s `n`
/// partitions and `strategy`, on `profile`.
pub fn simulate(shape: &LayerShape, strategy: Strategy, profile: &Profile, elem_bytes: usize) -> SimResult {
    let (mut ops, forward_ops) = schedule(shape, strategy, profile, elem_bytes);
    let busy = replay(&mut ops, profile);
    let time = ops.iter().map(|o| o.end).fold(0.0, f64::max);
    let forward = ops[..forward_ops].iter().map(|o| o.end).fold(0.0, f64::max);
    let model = ImplementationModel::new(shape, strategy);
    SimResult {
        n_partitions: shape.n_partitions,
        strategy,
        time,
        forward,
        busy,
        peak_bytes: model.peak_device() * elem_bytes as f64,
        host_bytes: model.host() * elem_bytes as f64,
        ops,
    }
}

/// Simulates every `(n, strategy)` of the grid and returns the results, best first.
pub fn sweep(
    shape: &LayerShape,
    partitions: &[usize],
    strategies: &[Strategy],
    profile: &Profile,
    elem_bytes: usize,
) -> Vec<SimResult> {
    let mut out = Vec::new();
    for &n in partitions {
        for &strategy in strategies {
            let s = LayerShape {
                n_partitions: n,
                ..*shape
            };
            out.push(simulate(&s, strategy, profile, elem_bytes));
        }
    }
    out.sort_by(|a, b| a.time.total_cmp(&b.time));
    out
}
