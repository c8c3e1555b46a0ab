//! The fused exchange op for any backend, written with primitive ops: the exchange's
//! [`Schedule`], run by the executor the run asks for (in order, or a worker per stream).
//!
//! Forward: `S_0`, then per partition `S_{i+1}`, `C_i`, `R_i`, with `T_DI` and `T_M` copied to
//! the host store behind them where the strategy offloads; backward mirrors it on gradients.
//! Each step takes its inputs from partition slots and puts its outputs into them; a slot is
//! emptied by the last reader of its content, so at most two dispatched partitions, one hidden
//! activation and two output partitions are live at once (and the same in backward), and a
//! write into a slot that is still occupied is a schedule hazard, reported as an error. What
//! survives into backward is the strategy's choice.
//!
//! The rooms: the passes and what survives between them (here), the partition slots and the
//! checked run of a schedule (`slots.rs`), the steps that move rows (`moves.rs`).

use std::sync::{Arc, Mutex};

use crate::sync::{into_inner, lock};

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::assemble::RowAssembler;
use super::blocks::Mem;
use super::executor::StepExecutor;
use super::ffn::{compute, compute_backward, ExpertCompute, ExpertGradAcc, Restored};
use super::schedule::{Op, Role, Schedule, Slot, Step};
use super::shadows::ExpertSlots;
use super::{ExchangeGrads, ExchangeRun, MoeBackend, PassStore};
use crate::comm::{HostOffload, Offloaded};
use crate::dispatch::ExchangePlan;
use crate::error::{MoeError, Result};
use crate::experts::ExpertTensors;
use crate::memory::Restore;

/// What the fused forward keeps for backward.
#[derive(Debug, Clone)]
pub struct Saved<B: MoeBackend> {
    /// The own experts and the shadow copies the forward received.
    experts: ExpertSlots<B>,
    /// `T_I`, kept only when `T_DI` is re-communicated (S2, S4).
    input: Option<FloatTensor<B>>,
    partitions: Vec<SavedPartition<B>>,
    device: B::Device,
    /// The step's store of the forward's device library, for the backward's (`None` on the
    /// primitives): what a path keeps across the step (`ExpertGroups::step`).
    step: Option<PassStore>,
}

#[derive(Debug, Clone)]
struct SavedPartition<B: Backend> {
    /// `T_DI_i` in expert-major order.
    dispatched: Stash<B>,
    /// `T_M_i` (pre-activation) per local expert; `None` for experts without rows. Empty
    /// where `T_M` is recomputed.
    hidden: Vec<Option<Stash<B>>>,
}

/// One activation between forward and backward.
#[derive(Debug, Clone)]
enum Stash<B: Backend> {
    Device(FloatTensor<B>),
    /// Offloaded to host memory: by the communicator's own offload path where it has one for
    /// `B` (pinned host memory on CUDA), by the host store otherwise.
    Parked(Arc<dyn Offloaded<B>>),
    /// Restored by re-communication or recomputation.
    Dropped,
}

impl<B: Backend> Stash<B> {
    /// Offloads through the communicator's offload path for `B` where it has one (pinned
    /// host memory on CUDA), through the host store otherwise.
    fn offload(tensor: FloatTensor<B>, run: &ExchangeRun) -> Result<Self> {
        let path = run
            .comm
            .row_paths()
            .and_then(|p| p.offload::<B>())
            .unwrap_or_else(|| Arc::new(HostOffload));
        Ok(Stash::Parked(path.offload(tensor, &run.host)?))
    }

    /// The tensor, if it was kept or offloaded.
    fn restore(self) -> Result<Option<FloatTensor<B>>> {
        match self {
            Stash::Device(t) => Ok(Some(t)),
            Stash::Parked(parked) => parked.restore().map(Some),
            Stash::Dropped => Ok(None),
        }
    }
}

mod moves;
mod slots;

use moves::{check_input, combine, dispatch};
use slots::{run_checked, Slots, Value};

/// The generic fused forward: `T_O` from `T_I` over the plan's partitions, on any backend,
/// with burn's primitive ops and the run's communicator. Backends without a faster exchange
/// of their own implement [`MoeBackend::exchange_forward`] with it.
///
/// Longer than most functions here, on purpose: its body is the forward's step table, one
/// short arm per op of [`Schedule::forward`], over state the arms share (slots, stashes,
/// the assembler); apart, each arm would take that state as six parameters and the table
/// would no longer read against the schedule.
///
/// # Shapes
/// - input (`T_I`): `[n_rows, d_model]` in plan order → `T_O`, the same shape
///
/// # Errors
/// [`MoeError::Input`] if `T_I` or the experts disagree with the plan; [`MoeError::Comm`] if a
/// collective fails; [`MoeError::Memory`] if the host store refuses an offload.
pub fn forward<B: MoeBackend>(
    input: FloatTensor<B>,
    experts: ExpertTensors<B>,
    plan: &ExchangePlan,
    run: &ExchangeRun,
) -> Result<(FloatTensor<B>, Saved<B>)> {
    check_input::<B>(&input, &experts, plan, &run.shadows)?;
    // The shadows' copies, broadcast by their owners before the first dispatch: every rank
    // runs these collectives at the same point of the same pass.
    let experts = ExpertSlots::new(experts, &run.shadows, &run.comm)?;
    let comm = run.comm.as_ref();
    let strategy = run.strategy;
    let n = plan.n_partitions();
    let device = B::float_device(&input);
    let executor = run.executor_for::<B>(&device);
    let slots = Slots::<B>::new(executor);
    let saved: Mutex<Vec<SavedPartition<B>>> = Mutex::new(
        (0..n)
            .map(|_| SavedPartition {
                dispatched: Stash::Dropped,
                hidden: Vec::new(),
            })
            .collect(),
    );
    let threaded = executor == StepExecutor::StreamThreads;
    let output = Mutex::new(RowAssembler::<B>::new(&input, plan, threaded));
    let memory = B::slot_memory(run, &input);
    let mem: Mem<'_, B> = memory.as_deref();
    let how = ExpertCompute::find(comm, &experts, run, PassStore::default());
    let step_fn = |_: usize, step: &Step| -> Result<()> {
        match step.op {
            Op::Dispatch(i) => {
                let target = Slot::of(Role::Dispatched, i);
                let rows = dispatch::<B>(&input, &plan.partitions[i], comm, mem, target)?;
                slots.put(step, target, Value::Rows(rows))
            }
            Op::Offload(Role::Dispatched, i) => {
                let x = slots.rows(step, Role::Dispatched, i)?;
                lock(&saved)[i].dispatched = Stash::offload(x, run)?;
                Ok(())
            }
            Op::Compute(i) => {
                let x = slots.rows(step, Role::Dispatched, i)?;
                let (out, hidden) = compute::<B>(
                    x.clone(),
                    &plan.partitions[i],
                    i,
                    &experts,
                    run.activation,
                    mem,
                    &how,
                )?;
                if strategy.dispatched() == Restore::Keep {
                    lock(&saved)[i].dispatched = Stash::Device(x);
                }
                match strategy.hidden() {
                    Restore::Keep => {
                        lock(&saved)[i].hidden = hidden.into_iter().map(|z| z.map(Stash::Device)).collect();
                    }
                    Restore::Offload => {
                        slots.put(
                            step,
                            Slot {
                                role: Role::Hidden,
                                index: 0,
                            },
                            Value::Hidden(hidden),
                        )?;
                    }
                    Restore::Recommunicate | Restore::Recompute => {}
                }
                slots.put(step, Slot::of(Role::Output, i), Value::Rows(out))
            }
            Op::Offload(Role::Hidden, i) => {
                let hidden = slots.hidden(step, i, 0)?;
                let stashed = hidden
                    .into_iter()
                    .map(|z| z.map(|z| Stash::offload(z, run)).transpose())
                    .collect::<Result<Vec<_>>>()?;
                lock(&saved)[i].hidden = stashed;
                Ok(())
            }
            Op::Combine(i) => {
                let out = slots.rows(step, Role::Output, i)?;
                let rows = combine::<B>(out, &plan.partitions[i], comm, mem)?;
                lock(&output).place(&plan.partitions[i], rows);
                Ok(())
            }
            other => unreachable!("{other:?} is not a forward step"),
        }
    };
    run_checked(
        executor,
        &device,
        &Schedule::forward(n, strategy),
        &slots,
        &step_fn,
    )?;
    let output = into_inner(output).finish();
    Ok((
        output,
        Saved {
            device,
            input: strategy.keeps_input().then_some(input),
            experts,
            partitions: into_inner(saved),
            step: how.step(),
        },
    ))
}

/// The generic fused backward: gradients of `T_I` and the experts from the gradient of `T_O`,
/// restoring each partition's `T_DI` and `T_M` as the run's strategy says.
///
/// Its body is the backward's step table, one arm per op of [`Schedule::backward`], for the
/// same reason as [`forward`]'s.
///
/// # Errors
/// [`MoeError::Comm`] if a collective fails.
pub fn backward<B: MoeBackend>(
    grad_out: FloatTensor<B>,
    saved: Saved<B>,
    plan: &ExchangePlan,
    run: &ExchangeRun,
) -> Result<ExchangeGrads<B>> {
    let comm = run.comm.as_ref();
    let strategy = run.strategy;
    let Saved {
        experts,
        input,
        partitions,
        device,
        step: step_store,
    } = saved;
    if strategy.keeps_input() && input.is_none() {
        return Err(MoeError::Memory(
            "re-communication needs T_I, which the forward did not keep".into(),
        ));
    }
    let n = plan.n_partitions();
    let executor = run.executor_for::<B>(&device);
    let slots = Slots::<B>::new(executor);
    let stashes: Vec<Mutex<SavedPartition<B>>> = partitions.into_iter().map(Mutex::new).collect();
    // A slot without rows in every partition has zero gradients.
    let idle_slot = (0..experts.n_slots()).any(|e| {
        plan.partitions
            .iter()
            .all(|p| p.rows_per_expert.get(e).is_none_or(|&r| r == 0))
    });
    let acc = Mutex::new(ExpertGradAcc::<B>::new(&experts, run.frozen, idle_slot));
    let threaded = executor == StepExecutor::StreamThreads;
    let input_grad = Mutex::new(RowAssembler::<B>::new(&grad_out, plan, threaded));
    let memory = B::slot_memory(run, &grad_out);
    let mem: Mem<'_, B> = memory.as_deref();
    // The forward's step store: what a path kept across the step (dropped with this pass).
    let how = ExpertCompute::find(comm, &experts, run, step_store.unwrap_or_default());
    let take_dispatched = |i: usize| std::mem::replace(&mut lock(&stashes[i]).dispatched, Stash::Dropped);
    let take_hidden = |i: usize| -> Result<Vec<Option<FloatTensor<B>>>> {
        std::mem::take(&mut lock(&stashes[i]).hidden)
            .into_iter()
            .map(|z| z.map_or(Ok(None), |z| z.restore()))
            .collect()
    };
    let step_fn = |_: usize, step: &Step| -> Result<()> {
        match step.op {
            Op::DispatchGrad(i) => {
                let target = Slot::of(Role::GradOutput, i);
                let grad = dispatch::<B>(&grad_out, &plan.partitions[i], comm, mem, target)?;
                slots.put(step, target, Value::Rows(grad))
            }
            Op::Redispatch(i) => {
                let input = input.as_ref().expect("checked above");
                let target = Slot::of(Role::Dispatched, i);
                let x = dispatch::<B>(input, &plan.partitions[i], comm, mem, target)?;
                slots.put(step, target, Value::Rows(x))
            }
            Op::Prefetch(Role::Dispatched, i) => {
                let x = take_dispatched(i)
                    .restore()?
                    .expect("an offloaded T_DI is on the host");
                slots.put(step, Slot::of(Role::Dispatched, i), Value::Rows(x))
            }
            Op::Prefetch(Role::Hidden, i) => {
                slots.put(step, Slot::of(Role::Hidden, i), Value::Hidden(take_hidden(i)?))
            }
            Op::ComputeGrad(i) => {
                let part = &plan.partitions[i];
                let grad = slots.rows(step, Role::GradOutput, i)?;
                let x = match strategy.dispatched() {
                    Restore::Keep => {
                        let x = take_dispatched(i)
                            .restore()?
                            .expect("a kept T_DI is on the device");
                        // Written on the comm stream in forward: held until this step's fence.
                        slots.hold_rows(step, &x);
                        x
                    }
                    _ => slots.rows(step, Role::Dispatched, i)?,
                };
                let hidden = match strategy.hidden() {
                    Restore::Keep => {
                        let hidden = take_hidden(i)?;
                        slots.hold(step, &Value::Hidden(hidden.clone()));
                        hidden
                    }
                    Restore::Offload => slots.hidden(step, i, i % 2)?,
                    // Recomputed from T_DI by the expert backward.
                    Restore::Recommunicate | Restore::Recompute => vec![None; part.rows_per_expert.len()],
                };
                let grad_x = compute_backward::<B>(
                    Restored { grad, x, hidden },
                    part,
                    i,
                    &experts,
                    run.activation,
                    mem,
                    &mut lock(&acc),
                    &how,
                )?;
                slots.put(step, Slot::of(Role::GradInput, i), Value::Rows(grad_x))
            }
            Op::CombineGrad(i) => {
                let grad_x = slots.rows(step, Role::GradInput, i)?;
                let rows = combine::<B>(grad_x, &plan.partitions[i], comm, mem)?;
                lock(&input_grad).place(&plan.partitions[i], rows);
                Ok(())
            }
            other => unreachable!("{other:?} is not a backward step"),
        }
    };
    run_checked(
        executor,
        &device,
        &Schedule::backward(n, strategy),
        &slots,
        &step_fn,
    )?;
    let grads = if threaded {
        // The sums were allocated on the compute worker's stream: the gradients handed back
        // are copies on this thread's stream, and the sums are let go only after this
        // stream has read them (the rule in `exchange/streams.rs`).
        let (grads, sums) = into_inner(acc).finish_on_caller(&run.shadows, comm)?;
        super::streams::fence::<B>(&device)?;
        drop(sums);
        grads
    } else {
        into_inner(acc).finish(&run.shadows, comm)?
    };
    // The adapters' `b` gradients were summed for `scale · b` (`adapter_scales.rs`).
    Ok(ExchangeGrads {
        input: into_inner(input_grad).finish(),
        experts: experts.unfold_grads(grads),
    })
}
