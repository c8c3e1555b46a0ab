//! The partition slots of one pass ([`Slots`]): each step takes its inputs from them and puts
//! its outputs into them, a slot emptied by the last reader of its content; and the run of a
//! schedule on the backend's worker streams, checked for hazards.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use crate::error::{MoeError, Result};
use crate::exchange::executor::StepExecutor;
use crate::exchange::schedule::{Role, Schedule, Slot, Step, Stream};
use crate::exchange::streams::StepHold;
use crate::exchange::MoeBackend;
use crate::sync::lock;

/// What a partition slot holds.
pub(super) enum Value<B: Backend> {
    /// A `[rows, width]` block (`T_DI`, `T_DO`, `dT_DO`, `dT_DI`).
    Rows(FloatTensor<B>),
    /// `T_M`: each local expert's pre-activation rows (`None` for an expert without rows).
    Hidden(Vec<Option<FloatTensor<B>>>),
}

impl<B: Backend> Clone for Value<B> {
    fn clone(&self) -> Self {
        match self {
            Value::Rows(t) => Value::Rows(t.clone()),
            Value::Hidden(h) => Value::Hidden(h.clone()),
        }
    }
}

/// The partition slots of one pass.
pub(super) struct Slots<B: Backend> {
    map: Mutex<HashMap<Slot, Value<B>>>,
    /// With a worker per stream: what each stream's current step read, kept until the
    /// executor has fenced that stream (`None` in issue order, where one stream orders every
    /// read before any reuse of the memory).
    held: Option<Mutex<HashMap<Stream, Vec<Value<B>>>>>,
    /// What failed steps held, dropped with the slots: after every worker fenced its stream.
    failed: Mutex<Vec<Vec<Value<B>>>>,
}

impl<B: Backend> Slots<B> {
    pub(super) fn new(executor: StepExecutor) -> Self {
        Self {
            map: Mutex::new(HashMap::new()),
            held: (executor == StepExecutor::StreamThreads).then(|| Mutex::new(HashMap::new())),
            failed: Mutex::new(Vec::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Slot, Value<B>>> {
        lock(&self.map)
    }

    /// Keeps `value`, which `step` reads, until `step`'s stream is fenced.
    pub(super) fn hold(&self, step: &Step, value: &Value<B>) {
        if let Some(held) = &self.held {
            lock(held).entry(step.stream()).or_default().push(value.clone());
        }
    }

    pub(super) fn hold_rows(&self, step: &Step, rows: &FloatTensor<B>) {
        self.hold(step, &Value::Rows(rows.clone()));
    }

    /// Runs `step` with `step_fn` and hands what it read to the executor, which drops it
    /// after fencing the step's stream; a failed step's reads wait for the end of the pass.
    pub(super) fn run(&self, index: usize, step: &Step, step_fn: &StepFn<'_>) -> Result<StepHold> {
        let result = step_fn(index, step);
        let held = match &self.held {
            Some(held) => lock(held).remove(&step.stream()).unwrap_or_default(),
            None => Vec::new(),
        };
        match result {
            Ok(()) => Ok(vec![Box::new(held) as Box<dyn std::any::Any + Send>]),
            Err(e) => {
                lock(&self.failed).push(held);
                Err(e)
            }
        }
    }

    /// Fills `slot`. It must be empty: its previous content's last reader takes it, so an
    /// occupied slot means a step is about to overwrite what another has not read yet.
    pub(super) fn put(&self, step: &Step, slot: Slot, value: Value<B>) -> Result<()> {
        if self.lock().insert(slot, value).is_some() {
            return Err(MoeError::Backend(format!(
                "schedule hazard: {:?} overwrote {slot:?} before its last reader took it",
                step.op
            )));
        }
        Ok(())
    }

    /// The content of `slot`, taken where `step` is its last reader, shared otherwise.
    fn get(&self, step: &Step, slot: Slot) -> Result<Value<B>> {
        let mut map = self.lock();
        let missing = || {
            MoeError::Backend(format!(
                "schedule hazard: {:?} read {slot:?} before anything wrote it",
                step.op
            ))
        };
        let value = if step.takes.contains(&slot) {
            map.remove(&slot).ok_or_else(missing)?
        } else {
            map.get(&slot).ok_or_else(missing)?.clone()
        };
        drop(map);
        self.hold(step, &value);
        Ok(value)
    }

    pub(super) fn rows(&self, step: &Step, role: Role, i: usize) -> Result<FloatTensor<B>> {
        match self.get(step, Slot::of(role, i))? {
            Value::Rows(t) => Ok(t),
            Value::Hidden(_) => unreachable!("{role:?} slots hold row blocks"),
        }
    }

    pub(super) fn hidden(&self, step: &Step, i: usize, index: usize) -> Result<Vec<Option<FloatTensor<B>>>> {
        match self.get(
            step,
            Slot {
                role: Role::Hidden,
                index,
            },
        )? {
            Value::Hidden(h) => Ok(h),
            Value::Rows(_) => unreachable!("hidden slots hold per-expert blocks (partition {i})"),
        }
    }
}

/// One step of a pass, on the state its table shares.
pub(super) type StepFn<'a> = dyn Fn(usize, &Step) -> Result<()> + Sync + 'a;

/// Runs `schedule` on the backend's worker streams for `device` (built here, on the calling
/// thread, so every pass of this thread uses the same device streams) and checks the recorded
/// spans for hazards (a few microseconds: the steps are counted in tens).
pub(super) fn run_checked<B: MoeBackend>(
    executor: StepExecutor,
    device: &B::Device,
    schedule: &Schedule,
    slots: &Slots<B>,
    step_fn: &StepFn<'_>,
) -> Result<()> {
    let streams = B::worker_streams(device);
    let spans = executor.run_on(streams.as_ref(), schedule, &|index, step| {
        slots.run(index, step, step_fn)
    })?;
    schedule
        .check_trace(&spans)
        .map_err(|hazard| MoeError::Backend(format!("schedule hazard: {hazard}")))
}
