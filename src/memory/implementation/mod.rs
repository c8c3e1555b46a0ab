//! What this implementation holds, step by step: a replay of one forward + backward of the
//! layer on one rank, in the exchange's schedule order, that tracks every tensor's bytes and
//! the transient buffers of each step, and reports the peak with what is live at it.
//!
//! The sizes follow the code of the fused op (`exchange/fused/`, `exchange/ffn/`) and of
//! the layer around it, and were checked against a counting allocator on the Flex backend
//! (`tools/examples/memory.rs`): a GEMM briefly holds a second buffer of its output's size, a
//! tensor handed to the communicator by value is sent without a copy (a view of a shared
//! tensor is copied first), and the GELU derivative is computed in place. Backends that
//! allocate differently (NdArray composes the GELU derivative from several element-wise ops)
//! can peak higher than modelled.

mod experts;
mod ledger;
mod library;
mod replay;
mod steps;

use serde::Serialize;

use super::{Execution, ExpertRoute, LayerShape, RankRows, Strategy};
use replay::Replay;

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

    /// The model for one rank that handles `rows` (its routing of a real batch), its experts
    /// on the primitives, one after another, as the layer runs them on a GPU
    /// ([`Execution::on_gpu`]: in issue order at one rank, threaded above).
    pub fn for_rows(shape: &LayerShape, rows: &RankRows, strategy: Strategy) -> Self {
        let execution = Execution::on_gpu(ExpertRoute::ExpertByExpert, shape.n_ranks);
        Self::for_execution(shape, rows, strategy, execution)
    }

    /// The model for one rank that handles `rows`, the pass run as `execution` says.
    pub fn for_execution(
        shape: &LayerShape,
        rows: &RankRows,
        strategy: Strategy,
        execution: Execution,
    ) -> Self {
        Replay::new(shape, rows, strategy, execution).run()
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
