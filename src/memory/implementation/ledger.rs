//! The replay's bookkeeping: the tensors live at each moment and the highest point so far.

use super::{term, Phase, Term};
use crate::pipeline::schedule::Stream;

/// The live tensors of a replay and the highest point so far.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    pub(super) live: Vec<Term>,
    peak: Phase,
    /// The highest point of the current step, and what was live then.
    pub(super) step_peak: Phase,
}

/// One schedule step's memory, for the concurrency allowance.
#[derive(Debug, Clone)]
pub(super) struct StepMemory {
    pub(super) stream: Stream,
    pub(super) before: f64,
    pub(super) after: f64,
    pub(super) peak: Phase,
}

impl Ledger {
    pub(super) fn total(&self) -> f64 {
        self.live.iter().map(|t| t.elements).sum()
    }

    /// Records the moment `step` runs with `transient` buffers on top of what is live.
    pub(super) fn at(&mut self, step: &str, transient: &[(&str, f64)]) {
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
    pub(super) fn begin_step(&mut self) -> f64 {
        let total = self.total();
        self.step_peak = Phase {
            step: String::new(),
            elements: total,
            terms: self.live.clone(),
        };
        total
    }

    /// Raises the pass's peak to `phase` if it is higher.
    pub(super) fn consider(&mut self, phase: Phase) {
        if phase.elements > self.peak.elements {
            self.peak = phase;
        }
    }

    pub(super) fn alloc(&mut self, step: &str, name: impl Into<String>, elements: f64) {
        self.live.push(term(name, elements));
        self.at(step, &[]);
    }

    /// Adds `elements` to the live tensor `name` (allocating it if it is not live).
    pub(super) fn grow(&mut self, step: &str, name: &str, elements: f64) {
        match self.live.iter_mut().find(|t| t.name == name) {
            Some(t) => t.elements += elements,
            None => self.live.push(term(name, elements)),
        }
        self.at(step, &[]);
    }

    /// Whether the tensor `name` is live.
    pub(super) fn holds(&self, name: &str) -> bool {
        self.live.iter().any(|t| t.name == name)
    }

    pub(super) fn free(&mut self, name: &str) -> f64 {
        match self.live.iter().position(|t| t.name == name) {
            Some(i) => self.live.remove(i).elements,
            None => 0.0,
        }
    }

    pub(super) fn rename(&mut self, from: &str, to: impl Into<String>) {
        if let Some(t) = self.live.iter_mut().find(|t| t.name == from) {
            t.name = to.into();
        }
    }

    /// Takes the peak so far and restarts it from what is live now.
    pub(super) fn take_peak(&mut self) -> Phase {
        let now = Phase {
            step: String::new(),
            elements: self.total(),
            terms: self.live.clone(),
        };
        std::mem::replace(&mut self.peak, now)
    }
}
