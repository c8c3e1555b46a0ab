//! The exchange's schedule as data: which step runs on which stream, which partition buffers
//! it reads and writes, and what it must wait for. One function builds it; the CPU executor
//! (`executor.rs`) runs it with one worker thread per stream, and a GPU executor runs the same
//! steps on CUDA streams ordered by events.
//!
//! Buffers are partition-sized slots per role, reused round-robin (the paper's partition-buffer reuse, §IV): `T_DI` ×2 (one
//! partition received while the other is computed on), `T_M` ×1, `T_DO` ×2, and in backward
//! the received gradient `dT_DO` ×2, the restored `T_DI` and `T_M` ×2 each, and the gradient
//! sent back `dT_DI` ×2. Dependencies are derived from those accesses, in issue order: a step
//! waits for the writer of every slot it reads, and a write waits for every reader of the
//! slot's previous content. So no slot is overwritten before its last reader has finished,
//! which [`Schedule::check_trace`] verifies on a recorded run.

use std::collections::HashMap;

use super::{Restore, Strategy};

/// Where a step runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Stream {
    /// Expert GEMMs and activations.
    Compute,
    /// All-to-alls (dispatch, combine), in the same order on every rank.
    Comm,
    /// Host offload (forward) and prefetch (backward).
    Copy,
}

impl Stream {
    /// Every stream.
    pub const ALL: [Stream; 3] = [Stream::Compute, Stream::Comm, Stream::Copy];
}

/// What a partition buffer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Role {
    /// `T_DI`: the dispatched rows, expert-major.
    Dispatched,
    /// `T_M`: each expert's pre-activation hidden rows.
    Hidden,
    /// `T_DO`: the expert outputs, before the combine.
    Output,
    /// `dT_DO`: the gradient of the expert outputs, dispatched in backward.
    GradOutput,
    /// `dT_DI`: the gradient of the dispatched rows, before its combine.
    GradInput,
}

/// One partition buffer: a role and its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct Slot {
    /// What it holds.
    pub role: Role,
    /// Which of the role's buffers.
    pub index: usize,
}

/// A step of the schedule, on partition `i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Op {
    /// `S_i`: dispatch partition `i` of `T_I` to the experts' ranks.
    Dispatch(usize),
    /// `C_i`: the local experts on the dispatched partition.
    Compute(usize),
    /// Copy partition `i` of `T_DI` or `T_M` to the host.
    Offload(Role, usize),
    /// `R_i`: return the expert outputs to the ranks they came from.
    Combine(usize),
    /// `S'_i`: dispatch partition `i` of the gradient of `T_O`.
    DispatchGrad(usize),
    /// Dispatch partition `i` of `T_I` again to restore `T_DI` (S2, S4).
    Redispatch(usize),
    /// Copy partition `i` of `T_DI` or `T_M` back from the host (S1–S3).
    Prefetch(Role, usize),
    /// `C'_i`: the experts' backward on the partition (recomputing `T_M` where it was dropped).
    ComputeGrad(usize),
    /// `R'_i`: return the gradient of the dispatched rows to the ranks they came from.
    CombineGrad(usize),
}

impl Op {
    /// The stream the op runs on.
    pub fn stream(self) -> Stream {
        match self {
            Op::Compute(_) | Op::ComputeGrad(_) => Stream::Compute,
            Op::Dispatch(_)
            | Op::Combine(_)
            | Op::DispatchGrad(_)
            | Op::Redispatch(_)
            | Op::CombineGrad(_) => Stream::Comm,
            Op::Offload(..) | Op::Prefetch(..) => Stream::Copy,
        }
    }
}

/// One step: its op, the slots it reads and writes, those it empties (the last read of a
/// slot's content takes it, which frees the buffer), and the steps it waits for.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Step {
    /// What the step does.
    pub op: Op,
    /// Slots read.
    pub reads: Vec<Slot>,
    /// Slots written.
    pub writes: Vec<Slot>,
    /// Slots whose content this step reads last, and so takes.
    pub takes: Vec<Slot>,
    /// Indices of the steps on other streams that must finish first (steps on the same
    /// stream run in issue order anyway).
    pub deps: Vec<usize>,
}

impl Step {
    /// The stream the step runs on.
    pub fn stream(&self) -> Stream {
        self.op.stream()
    }
}

/// The steps of one pass in issue order.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Schedule {
    /// Every step, in issue order.
    pub steps: Vec<Step>,
}

/// When a step ran, in ticks of one logical clock shared by the workers of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Tick taken just before the step started.
    pub start: u64,
    /// Tick taken just after it finished.
    pub end: u64,
}

fn slot(role: Role, index: usize) -> Slot {
    Slot { role, index }
}

impl Slot {
    /// The slot of `role` that partition `i` uses: the roles with two buffers alternate.
    pub(crate) fn of(role: Role, i: usize) -> Slot {
        Slot { role, index: i % 2 }
    }
}

impl Schedule {
    /// The forward pass of `n` partitions under `strategy`: `S_0`, then per partition `i`:
    /// `S_{i+1}` (the next partition is received while this one is computed), `C_i`, `R_i`,
    /// with `T_DI` and `T_M` offloaded behind them where the strategy offloads.
    pub fn forward(n: usize, strategy: Strategy) -> Self {
        let dispatched = |i: usize| slot(Role::Dispatched, i % 2);
        let mut ops: Vec<(Op, Vec<Slot>, Vec<Slot>)> = Vec::new();
        let issue_dispatch = |ops: &mut Vec<(Op, Vec<Slot>, Vec<Slot>)>, i: usize| {
            ops.push((Op::Dispatch(i), vec![], vec![dispatched(i)]));
            if strategy.dispatched() == Restore::Offload {
                ops.push((Op::Offload(Role::Dispatched, i), vec![dispatched(i)], vec![]));
            }
        };
        issue_dispatch(&mut ops, 0);
        for i in 0..n {
            if i + 1 < n {
                issue_dispatch(&mut ops, i + 1);
            }
            let offload_hidden = strategy.hidden() == Restore::Offload;
            let mut writes = vec![slot(Role::Output, i % 2)];
            if offload_hidden {
                writes.push(slot(Role::Hidden, 0));
            }
            ops.push((Op::Compute(i), vec![dispatched(i)], writes));
            if offload_hidden {
                ops.push((Op::Offload(Role::Hidden, i), vec![slot(Role::Hidden, 0)], vec![]));
            }
            ops.push((Op::Combine(i), vec![slot(Role::Output, i % 2)], vec![]));
        }
        Self::from_accesses(ops)
    }

    /// The backward pass of `n` partitions under `strategy`, mirroring the forward: per
    /// partition `S'_i` and the restore of `T_DI` (re-dispatch or prefetch) and `T_M`
    /// (prefetch) one partition ahead of `C'_i`, then `R'_i`.
    pub fn backward(n: usize, strategy: Strategy) -> Self {
        let mut ops: Vec<(Op, Vec<Slot>, Vec<Slot>)> = Vec::new();
        let restore = |ops: &mut Vec<(Op, Vec<Slot>, Vec<Slot>)>, i: usize| {
            ops.push((Op::DispatchGrad(i), vec![], vec![slot(Role::GradOutput, i % 2)]));
            match strategy.dispatched() {
                Restore::Recommunicate => {
                    ops.push((Op::Redispatch(i), vec![], vec![slot(Role::Dispatched, i % 2)]));
                }
                Restore::Offload => ops.push((
                    Op::Prefetch(Role::Dispatched, i),
                    vec![],
                    vec![slot(Role::Dispatched, i % 2)],
                )),
                _ => {}
            }
            if strategy.hidden() == Restore::Offload {
                ops.push((
                    Op::Prefetch(Role::Hidden, i),
                    vec![],
                    vec![slot(Role::Hidden, i % 2)],
                ));
            }
        };
        restore(&mut ops, 0);
        for i in 0..n {
            if i + 1 < n {
                restore(&mut ops, i + 1);
            }
            let mut reads = vec![slot(Role::GradOutput, i % 2)];
            if strategy.dispatched() != Restore::Keep {
                reads.push(slot(Role::Dispatched, i % 2));
            }
            if strategy.hidden() == Restore::Offload {
                reads.push(slot(Role::Hidden, i % 2));
            }
            ops.push((Op::ComputeGrad(i), reads, vec![slot(Role::GradInput, i % 2)]));
            ops.push((Op::CombineGrad(i), vec![slot(Role::GradInput, i % 2)], vec![]));
        }
        Self::from_accesses(ops)
    }

    /// Derives dependencies and takes from the slot accesses of ops in issue order.
    fn from_accesses(ops: Vec<(Op, Vec<Slot>, Vec<Slot>)>) -> Self {
        #[derive(Default)]
        struct SlotState {
            writer: Option<usize>,
            readers: Vec<usize>,
        }
        let mut state: HashMap<Slot, SlotState> = HashMap::new();
        let mut steps: Vec<Step> = Vec::with_capacity(ops.len());
        for (index, (op, reads, writes)) in ops.into_iter().enumerate() {
            let mut deps = Vec::new();
            for r in &reads {
                let s = state.entry(*r).or_default();
                deps.extend(s.writer);
                s.readers.push(index);
            }
            for w in &writes {
                let s = state.entry(*w).or_default();
                // Write after read, and write after write of a content nobody read.
                deps.extend(s.readers.iter().copied());
                if s.readers.is_empty() {
                    deps.extend(s.writer);
                }
                s.writer = Some(index);
                s.readers.clear();
            }
            deps.sort_unstable();
            deps.dedup();
            deps.retain(|&d| steps[d].stream() != op.stream());
            steps.push(Step {
                op,
                reads,
                writes,
                takes: Vec::new(),
                deps,
            });
        }
        // The last reader of each content takes it: the reader after which no step reads the
        // slot again before its next write.
        // The last reader of each content takes it (the reader after which no step reads the
        // slot again before its next write), so it must also wait for the content's other
        // readers: readers on different streams may otherwise run in either order.
        let mut contents: Vec<(Slot, Vec<usize>)> = Vec::new();
        let mut open: HashMap<Slot, Vec<usize>> = HashMap::new();
        for (index, step) in steps.iter().enumerate() {
            for w in &step.writes {
                if let Some(readers) = open.remove(w) {
                    contents.push((*w, readers));
                }
            }
            for r in &step.reads {
                open.entry(*r).or_default().push(index);
            }
        }
        contents.extend(open);
        for (slot, readers) in contents {
            let (&taker, others) = readers.split_last().expect("a content in `open` has a reader");
            steps[taker].takes.push(slot);
            let stream = steps[taker].stream();
            let extra: Vec<usize> = others
                .iter()
                .copied()
                .filter(|&o| steps[o].stream() != stream)
                .collect();
            steps[taker].deps.extend(extra);
            steps[taker].deps.sort_unstable();
            steps[taker].deps.dedup();
        }
        Self { steps }
    }

    /// The indices of the steps on `stream`, in the order it runs them.
    pub fn stream_order(&self, stream: Stream) -> Vec<usize> {
        (0..self.steps.len())
            .filter(|&i| self.steps[i].stream() == stream)
            .collect()
    }

    /// Checks a recorded run (one span per step): every step started after its stream
    /// predecessor finished, every read came after the write of the content it read, the
    /// step that takes a content started after its other readers finished, and no slot was
    /// written before every reader of its previous content had finished.
    ///
    /// # Errors
    /// A description of the first hazard found.
    pub fn check_trace(&self, spans: &[Span]) -> std::result::Result<(), String> {
        if spans.len() != self.steps.len() {
            return Err(format!("{} spans for {} steps", spans.len(), self.steps.len()));
        }
        for stream in Stream::ALL {
            for pair in self.stream_order(stream).windows(2) {
                if spans[pair[1]].start < spans[pair[0]].end {
                    return Err(format!(
                        "{:?} started before {:?} on the {stream:?} stream had finished",
                        self.steps[pair[1]].op, self.steps[pair[0]].op
                    ));
                }
            }
        }
        let mut writer: HashMap<Slot, usize> = HashMap::new();
        let mut readers: HashMap<Slot, Vec<usize>> = HashMap::new();
        for (index, step) in self.steps.iter().enumerate() {
            for r in &step.reads {
                let w = *writer
                    .get(r)
                    .ok_or_else(|| format!("{:?} reads {r:?}, which nothing wrote", step.op))?;
                if spans[index].start < spans[w].end {
                    return Err(format!(
                        "{:?} read {r:?} before {:?} had finished writing it",
                        step.op, self.steps[w].op
                    ));
                }
                readers.entry(*r).or_default().push(index);
            }
            for t in &step.takes {
                for &reader in readers.get(t).into_iter().flatten() {
                    if reader != index && spans[index].start < spans[reader].end {
                        return Err(format!(
                            "{:?} took {t:?} while {:?} was still reading it",
                            step.op, self.steps[reader].op
                        ));
                    }
                }
            }
            for w in &step.writes {
                for &reader in readers.get(w).into_iter().flatten() {
                    if spans[index].start < spans[reader].end {
                        return Err(format!(
                            "{:?} overwrote {w:?} while {:?} was still reading it",
                            step.op, self.steps[reader].op
                        ));
                    }
                }
                readers.remove(w);
                writer.insert(*w, index);
            }
        }
        Ok(())
    }
}
