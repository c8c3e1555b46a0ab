//! A device library's expert compute ([`Library`]): the partition's `C_i` and `C'_i` handed
//! whole to the path the communicator (or the backend) offers, in the buffers the arena or a
//! fresh tensor gives, the weight gradients added into stacked running sums.

use std::sync::Arc;

use burn::tensor::ops::FloatTensor;
use burn::tensor::Shape;

use super::{ExpertGradAcc, PerExpert, Restored};
use crate::comm::Communicator;
use crate::dispatch::PartitionPlan;
use crate::error::Result;
use crate::exchange::blocks::{block, layout_of, BlockLayout, Mem};
use crate::exchange::expert_path::{ExpertBackward, ExpertForward, ExpertGroups, ExpertPath, GemmPrecision};
use crate::exchange::rows::{dims2, float_dtype};
use crate::exchange::schedule::{Role, Slot};
use crate::exchange::shadows::ExpertSlots;
use crate::exchange::{MoeBackend, PassStore};
use crate::experts::Activation;

/// A device library's expert compute for a run, with what it needs besides the partition: the
/// precision, and the experts grouped as the path reads them (built once per pass).
pub(crate) struct Library<B: MoeBackend> {
    path: Arc<dyn ExpertPath<B>>,
    precision: GemmPrecision,
    groups: ExpertGroups<B>,
}

impl<B: MoeBackend> Library<B> {
    /// The communicator's expert path for `B` if it offers one, else the backend's own
    /// ([`MoeBackend::expert_path`]) where the run allows it
    /// ([`ExchangeRun::backend_experts`](crate::exchange::ExchangeRun::backend_experts)) and freezes no
    /// part, if any. Experts with low-rank adapters run on the
    /// primitives: a path's job has no adapter terms. `step` is the step's store (see
    /// [`ExpertGroups::step`]).
    pub(super) fn find(
        comm: &dyn Communicator,
        experts: &ExpertSlots<B>,
        run: &crate::exchange::ExchangeRun,
        step: PassStore,
    ) -> Option<Self> {
        if experts.own().has_adapters() {
            return None;
        }
        // The backend's own path computes every part's gradient; with frozen parts (base
        // weights under adapters elsewhere in the model) the primitives skip them instead.
        let own = run.backend_experts && !run.frozen.iter().any(|&f| f);
        let path = path_for::<B>(comm, own)?;
        Some(Self {
            path,
            precision: run.precision,
            groups: experts.groups(step),
        })
    }

    /// The step's store the path's groups carry.
    pub(super) fn step(&self) -> &PassStore {
        &self.groups.step
    }
}

/// The communicator's expert path for `B` if it offers one, else, where `own`, the backend's
/// own ([`MoeBackend::expert_path`]), if any: the path [`Library::find`] takes for experts
/// without adapters, and whose route [`MoeBackend::expert_route`] reports.
pub(crate) fn path_for<B: MoeBackend>(comm: &dyn Communicator, own: bool) -> Option<Arc<dyn ExpertPath<B>>> {
    comm.row_paths()
        .and_then(|p| p.experts::<B>())
        .or_else(|| own.then(B::expert_path).flatten())
}

/// A slot's buffer for blocks laid out by `layout`: the arena's where `mem` is one, a fresh
/// tensor otherwise.
fn slot_buffer<B: MoeBackend>(
    mem: Mem<'_, B>,
    slot: Slot,
    layout: &BlockLayout,
    width: usize,
    like: &FloatTensor<B>,
) -> Result<FloatTensor<B>> {
    match mem {
        Some(m) => m.buffer(slot, layout.total(), width),
        None => Ok(B::write_buffer(
            Shape::new([layout.total(), width]),
            &B::float_device(like),
            float_dtype::<B>(like),
        )),
    }
}

/// [`compute`] through a device library: the same slots, one call for the partition.
pub(super) fn compute_on<B: MoeBackend>(
    library: &Library<B>,
    x: FloatTensor<B>,
    part: &PartitionPlan,
    i: usize,
    experts: &ExpertSlots<B>,
    act: Activation,
    mem: Mem<'_, B>,
) -> Result<(FloatTensor<B>, PerExpert<B>)> {
    let [_, d_model] = dims2::<B>(&x);
    let d_inner = experts.d_inner();
    let rows_per_expert = &part.rows_per_expert;
    let layout = layout_of(mem, rows_per_expert, d_model);
    let hidden_layout = layout_of(mem, rows_per_expert, d_inner);
    let hidden_slot = Slot {
        role: Role::Hidden,
        index: i % 2,
    };
    let hidden = slot_buffer(mem, hidden_slot, &hidden_layout, d_inner, &x)?;
    let out = slot_buffer(mem, Slot::of(Role::Output, i), &layout, d_model, &x)?;
    let (out, hidden) = library.path.forward(ExpertForward {
        x,
        rows_per_expert,
        layout: &layout,
        hidden_layout: &hidden_layout,
        experts: &library.groups,
        activation: act,
        precision: library.precision,
        hidden,
        out,
    })?;
    let per_expert = rows_per_expert
        .iter()
        .enumerate()
        .map(|(e, &rows)| (rows > 0).then(|| block::<B>(mem, &hidden, &hidden_layout, e, rows)))
        .collect();
    Ok((out, per_expert))
}

/// [`compute_backward`] through a device library, adding into the stacked running sums.
pub(super) fn compute_backward_on<B: MoeBackend>(
    library: &Library<B>,
    restored: Restored<B>,
    part: &PartitionPlan,
    i: usize,
    act: Activation,
    mem: Mem<'_, B>,
    acc: &mut ExpertGradAcc<B>,
) -> Result<FloatTensor<B>> {
    let Restored { grad, x, hidden } = restored;
    let [_, d_model] = dims2::<B>(&x);
    let rows_per_expert = &part.rows_per_expert;
    let layout = layout_of(mem, rows_per_expert, d_model);
    let grad_x = slot_buffer(mem, Slot::of(Role::GradInput, i), &layout, d_model, &x)?;
    if rows_per_expert.iter().all(|&r| r == 0) {
        // Nothing to add: the running sums stay as they are (or unmade, then zeros).
        return Ok(grad_x);
    }
    let out = library.path.backward(ExpertBackward {
        grad,
        x,
        hidden,
        rows_per_expert,
        layout: &layout,
        experts: &library.groups,
        activation: act,
        precision: library.precision,
        grad_x,
        fresh: acc.stacked.is_none(),
        grads: acc.take_stacked(),
    })?;
    acc.stacked = Some(out.grads);
    Ok(out.grad_x)
}
