//! The exchange's schedule as data and its CPU executor: the order of the steps on each
//! stream, the partition buffers, and a hazard check that fails when dependencies are missing.

use std::time::Duration;

use std::sync::Arc;

use burn::backend::{Autodiff, Flex, NdArray};
use mpipemoe::backend::{
    execute_in_order, execute_on, execute_on_threads, ExchangeRun, HostStore, Op, Role, Schedule, Span, Step,
    StepExecutor, StepHold, Stream, WorkerStreams,
};
use mpipemoe::comm::SingleRank;
use mpipemoe::memory::MemoryMeter;
use mpipemoe::memory::Strategy;
use mpipemoe::{Activation, MoeBackend};
use proptest::prelude::*;

fn ops(schedule: &Schedule, stream: Stream) -> Vec<Op> {
    schedule
        .stream_order(stream)
        .into_iter()
        .map(|i| schedule.steps[i].op)
        .collect()
}

#[test]
fn forward_alternates_dispatch_and_combine_on_the_comm_stream() {
    let s = Schedule::forward(3, Strategy::S1);
    assert_eq!(
        ops(&s, Stream::Comm),
        vec![
            Op::Dispatch(0),
            Op::Dispatch(1),
            Op::Combine(0),
            Op::Dispatch(2),
            Op::Combine(1),
            Op::Combine(2)
        ]
    );
    assert_eq!(
        ops(&s, Stream::Compute),
        vec![Op::Compute(0), Op::Compute(1), Op::Compute(2)]
    );
    assert_eq!(
        ops(&s, Stream::Copy),
        vec![
            Op::Offload(Role::Dispatched, 0),
            Op::Offload(Role::Dispatched, 1),
            Op::Offload(Role::Hidden, 0),
            Op::Offload(Role::Dispatched, 2),
            Op::Offload(Role::Hidden, 1),
            Op::Offload(Role::Hidden, 2),
        ]
    );
    // No copies without offloading.
    assert!(ops(&Schedule::forward(3, Strategy::S4), Stream::Copy).is_empty());
    assert!(ops(&Schedule::forward(3, Strategy::None), Stream::Copy).is_empty());
}

#[test]
fn backward_restores_per_strategy_one_partition_ahead() {
    let s4 = Schedule::backward(2, Strategy::S4);
    assert_eq!(
        ops(&s4, Stream::Comm),
        vec![
            Op::DispatchGrad(0),
            Op::Redispatch(0),
            Op::DispatchGrad(1),
            Op::Redispatch(1),
            Op::CombineGrad(0),
            Op::CombineGrad(1)
        ]
    );
    let s3 = Schedule::backward(2, Strategy::S3);
    assert_eq!(
        ops(&s3, Stream::Copy),
        vec![
            Op::Prefetch(Role::Dispatched, 0),
            Op::Prefetch(Role::Dispatched, 1)
        ]
    );
    let s2 = Schedule::backward(2, Strategy::S2);
    assert_eq!(
        ops(&s2, Stream::Copy),
        vec![Op::Prefetch(Role::Hidden, 0), Op::Prefetch(Role::Hidden, 1)]
    );
    assert!(ops(&Schedule::backward(2, Strategy::None), Stream::Copy).is_empty());
}

/// Two buffers per role (one `T_M` in forward), the dependencies that reuse implies, and every
/// content taken by its last reader.
#[test]
fn buffers_are_reused_with_the_waits_reuse_needs() {
    let s = Schedule::forward(4, Strategy::S1);
    let index = |op: Op| s.steps.iter().position(|x| x.op == op).unwrap();
    for step in &s.steps {
        for slot in step.reads.iter().chain(&step.writes) {
            let slots = if slot.role == Role::Hidden { 1 } else { 2 };
            assert!(slot.index < slots, "{:?} uses {slot:?}", step.op);
        }
        for &d in &step.deps {
            assert!(d < index(step.op), "{:?} waits for a later step", step.op);
        }
    }
    // S_2 reuses C_0's buffer: it waits for C_0 and for the offload of T_DI_0.
    let s2 = &s.steps[index(Op::Dispatch(2))];
    assert!(s2.deps.contains(&index(Op::Compute(0))));
    assert!(s2.deps.contains(&index(Op::Offload(Role::Dispatched, 0))));
    // C_1 overwrites the one T_M buffer: it waits for the offload of T_M_0.
    assert!(s.steps[index(Op::Compute(1))]
        .deps
        .contains(&index(Op::Offload(Role::Hidden, 0))));
    // The last reader of T_DI_i (C_i) takes it, after the offload has read it.
    let c1 = &s.steps[index(Op::Compute(1))];
    assert!(c1.takes.iter().any(|t| t.role == Role::Dispatched));
    assert!(c1.deps.contains(&index(Op::Offload(Role::Dispatched, 1))));
}

/// Runs `schedule` with steps that sleep `micros(step)` and returns the spans.
fn run_with_delays(schedule: &Schedule, micros: &(dyn Fn(&Step) -> u64 + Sync)) -> Vec<Span> {
    execute_on_threads(schedule, &|_, step| {
        std::thread::sleep(Duration::from_micros(micros(step)));
        Ok(())
    })
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Whatever each step takes, the executor never lets a step overwrite a buffer before its
    /// last reader has finished, or read one before its writer has.
    #[test]
    fn the_executor_respects_every_buffer_dependency(
        n in 1usize..6,
        strategy in prop::sample::select(Strategy::ALL.to_vec()),
        delays in prop::collection::vec(0u64..400, 64),
    ) {
        for schedule in [Schedule::forward(n, strategy), Schedule::backward(n, strategy)] {
            let spans = run_with_delays(&schedule, &|step| {
                let i = match step.op {
                    Op::Dispatch(i) | Op::Compute(i) | Op::Offload(_, i) | Op::Combine(i) | Op::DispatchGrad(i)
                    | Op::Redispatch(i) | Op::Prefetch(_, i) | Op::ComputeGrad(i) | Op::CombineGrad(i) => i,
                };
                delays[(i * 7 + step.stream() as usize * 3) % delays.len()]
            });
            prop_assert_eq!(schedule.check_trace(&spans), Ok(()));
        }
    }
}

/// The hazard check can fail: without its dependencies, a schedule whose compute steps are
/// slow lets the combine read an output before the compute has written it, and the check says
/// so.
#[test]
fn dropping_the_dependencies_is_caught() {
    let mut schedule = Schedule::forward(3, Strategy::S1);
    for step in &mut schedule.steps {
        step.deps.clear();
    }
    let spans = run_with_delays(&schedule, &|step| {
        if step.stream() == Stream::Compute {
            5000
        } else {
            0
        }
    });
    let hazard = schedule.check_trace(&spans).unwrap_err();
    assert!(hazard.contains("before") || hazard.contains("while"), "{hazard}");
    // With them, the same delays are safe.
    let schedule = Schedule::forward(3, Strategy::S1);
    let spans = run_with_delays(&schedule, &|step| {
        if step.stream() == Stream::Compute {
            5000
        } else {
            0
        }
    });
    assert_eq!(schedule.check_trace(&spans), Ok(()));
}

/// A failing step stops the run with its error, and the other workers do not hang.
#[test]
fn a_failing_step_stops_every_stream() {
    let schedule = Schedule::forward(4, Strategy::S1);
    let err = execute_on_threads(&schedule, &|_, step| match step.op {
        Op::Compute(1) => Err(mpipemoe::MoeError::Input("compute 1 failed".into())),
        _ => Ok(()),
    })
    .unwrap_err();
    assert!(err.to_string().contains("compute 1 failed"), "{err}");
    let err = execute_on_threads(&schedule, &|_, step| match step.op {
        Op::Offload(Role::Hidden, 0) => panic!("copy engine exploded"),
        _ => Ok(()),
    })
    .unwrap_err();
    assert!(err.to_string().contains("copy engine exploded"), "{err}");
}

/// The threaded executor runs the compute stream on the calling thread and each other stream
/// on a thread of its own: one start fewer a pass, and the experts computed where the caller
/// computes (on the CPU, its pool). A compute step that panics stops the other streams too.
#[test]
fn the_threaded_executor_computes_on_the_calling_thread() {
    let schedule = Schedule::forward(3, Strategy::S1);
    let caller = std::thread::current().id();
    let seen = std::sync::Mutex::new(Vec::new());
    execute_on_threads(&schedule, &|_, step| {
        seen.lock()
            .unwrap()
            .push((step.stream(), std::thread::current().id()));
        Ok(())
    })
    .unwrap();
    let seen = seen.into_inner().unwrap();
    for stream in [Stream::Compute, Stream::Comm, Stream::Copy] {
        let threads: std::collections::HashSet<_> =
            seen.iter().filter(|s| s.0 == stream).map(|s| s.1).collect();
        assert_eq!(threads.len(), 1, "{stream:?} on one thread: {seen:?}");
        assert_eq!(threads.contains(&caller), stream == Stream::Compute, "{stream:?}");
    }
    let err = execute_on_threads(&schedule, &|_, step| match step.op {
        Op::Compute(1) => panic!("the experts exploded"),
        _ => Ok(()),
    })
    .unwrap_err();
    assert!(err.to_string().contains("the experts exploded"), "{err}");
}

/// Device streams kept as a ledger: which steps each stream has run since its last fence,
/// the fences, and what went wrong. A step on another stream must find each step it waits for
/// fenced, and what a step held must be let go only after its stream was fenced since it ran.
#[derive(Default)]
struct Ledger {
    unfenced: std::collections::HashMap<Option<Stream>, Vec<usize>>,
    fences: usize,
    wrong: Vec<String>,
}

#[derive(Default)]
struct LedgerStreams(std::sync::Mutex<Ledger>);

thread_local! {
    static ON: std::cell::Cell<Option<Stream>> = const { std::cell::Cell::new(None) };
}

impl WorkerStreams for LedgerStreams {
    fn run_on(&self, stream: Stream, work: &mut dyn FnMut() -> mpipemoe::Result<()>) -> mpipemoe::Result<()> {
        ON.with(|on| on.set(Some(stream)));
        let out = work();
        ON.with(|on| on.set(None));
        out
    }

    fn fence(&self) -> mpipemoe::Result<()> {
        let mut ledger = self.0.lock().unwrap();
        ledger.fences += 1;
        ledger.unfenced.remove(&ON.with(|on| on.get()));
        Ok(())
    }
}

/// Let go after the executor says its stream was fenced: checks that it was.
struct Held(std::sync::Arc<LedgerStreams>, usize);

impl Drop for Held {
    fn drop(&mut self) {
        let mut ledger = self.0 .0.lock().unwrap();
        if ledger.unfenced.values().flatten().any(|&i| i == self.1) {
            ledger
                .wrong
                .push(format!("step {}'s hold let go before its stream's fence", self.1));
        }
    }
}

/// Runs `schedule` on the ledger; returns the fences and the faults found.
fn fences_of(schedule: &Schedule) -> (usize, Vec<String>) {
    // Shared with every hold, which the executor wants `'static`.
    let streams = std::sync::Arc::new(LedgerStreams::default());
    execute_on(&*streams, schedule, &|index, step| {
        let mut ledger = streams.0.lock().unwrap();
        for &d in &step.deps {
            if ledger.unfenced.values().flatten().any(|&i| i == d) {
                ledger.wrong.push(format!(
                    "{:?} ran before {:?} was fenced",
                    step.op, schedule.steps[d].op
                ));
            }
        }
        ledger
            .unfenced
            .entry(Some(step.stream()))
            .or_default()
            .push(index);
        let hold: StepHold = vec![Box::new(Held(streams.clone(), index))];
        Ok(hold)
    })
    .unwrap();
    let mut ledger = streams.0.lock().unwrap();
    if ledger.unfenced.values().any(|steps| !steps.is_empty()) {
        let left = format!("unfenced at the end: {:?}", ledger.unfenced);
        ledger.wrong.push(left);
    }
    (ledger.fences, std::mem::take(&mut ledger.wrong))
}

/// The threaded executor fences a stream only where a step on another stream waits for its
/// last step, and at the end where something ran since: at n partitions without offloads the
/// entry fence, every dispatch and compute, the combines that a later compute waits for (all
/// but the last two), and the comm stream's end fence, where it fenced every step before
/// (it fenced every step and both workers' ends: 3n + 3, 9 at n = 2, where now 6). Every
/// strategy, both passes, n up to 5: no step runs before what it waits for is fenced, no hold
/// is let go unfenced, nothing is left unfenced.
#[test]
fn the_threaded_executor_fences_only_what_another_stream_waits_for() {
    for n in 1..6 {
        for strategy in Strategy::ALL {
            for schedule in [Schedule::forward(n, strategy), Schedule::backward(n, strategy)] {
                let (fences, wrong) = fences_of(&schedule);
                assert!(wrong.is_empty(), "n = {n}, {strategy:?}: {wrong:?}");
                // Never more than the entry fence, one a step and one a worker.
                assert!(
                    fences <= 1 + schedule.steps.len() + 3,
                    "n = {n}, {strategy:?}: {fences}"
                );
            }
        }
    }
    let counts: Vec<usize> = (1..=4)
        .map(|n| fences_of(&Schedule::forward(n, Strategy::None)).0)
        .collect();
    assert_eq!(counts, [4, 6, 9, 12], "forward, no offload, n = 1..4");
    let counts: Vec<usize> = (1..=4)
        .map(|n| fences_of(&Schedule::backward(n, Strategy::None)).0)
        .collect();
    assert_eq!(counts, [4, 6, 9, 12], "backward, no offload, n = 1..4");
}

/// The in-order executor (asynchronous device backends) runs every step once, in an order
/// the hazard check accepts, and stops at the first failing step without running later ones.
#[test]
fn the_in_order_executor_keeps_every_dependency_and_stops_at_an_error() {
    for n in 1..6 {
        for strategy in Strategy::ALL {
            for schedule in [Schedule::forward(n, strategy), Schedule::backward(n, strategy)] {
                let ran = std::sync::Mutex::new(Vec::new());
                let spans = execute_in_order(&schedule, &|index, _| {
                    ran.lock().unwrap().push(index);
                    Ok(())
                })
                .unwrap();
                assert_eq!(
                    ran.into_inner().unwrap(),
                    (0..schedule.steps.len()).collect::<Vec<_>>()
                );
                assert_eq!(schedule.check_trace(&spans), Ok(()), "n={n} {strategy}");
            }
        }
    }
    let schedule = Schedule::forward(4, Strategy::S1);
    let failing = schedule
        .steps
        .iter()
        .position(|s| s.op == Op::Compute(1))
        .unwrap();
    let ran = std::sync::Mutex::new(Vec::new());
    let err = execute_in_order(&schedule, &|index, step| {
        ran.lock().unwrap().push(index);
        match step.op {
            Op::Compute(1) => Err(mpipemoe::MoeError::Input("compute 1 failed".into())),
            _ => Ok(()),
        }
    })
    .unwrap_err();
    assert!(err.to_string().contains("compute 1 failed"), "{err}");
    assert_eq!(ran.into_inner().unwrap().last(), Some(&failing));
}

/// Which executor each backend gets: in order on the CPU backends (the threads share the cores
/// the GEMMs fill; BENCHMARKS.md §7), and what a run asks for when it asks.
#[test]
fn each_backend_gets_its_executor_and_a_run_can_override_it() {
    let (flex, ndarray) = (Default::default(), Default::default());
    assert_eq!(<Flex as MoeBackend>::step_executor(&flex), StepExecutor::InOrder);
    assert_eq!(
        <NdArray as MoeBackend>::step_executor(&ndarray),
        StepExecutor::InOrder
    );
    assert_eq!(
        <Autodiff<Flex> as MoeBackend>::step_executor(&flex),
        StepExecutor::InOrder
    );
    let mut run = ExchangeRun::new(
        Arc::new(SingleRank),
        Activation::Gelu,
        Strategy::None,
        HostStore::new(MemoryMeter::default()),
    );
    // CubeCL backends by runtime name (as `Runtime::name` gives it): CUDA overlaps on a worker
    // per stream, WGPU (either shader compiler) and the rest run in order.
    assert_eq!(
        StepExecutor::for_cubecl_runtime("cuda"),
        StepExecutor::StreamThreads
    );
    for name in ["wgpu<wgsl>", "wgpu<spirv>", "hip", "cpu"] {
        assert_eq!(
            StepExecutor::for_cubecl_runtime(name),
            StepExecutor::InOrder,
            "{name}"
        );
    }
    assert_eq!(run.executor_for::<Flex>(&flex), StepExecutor::InOrder);
    run.executor = Some(StepExecutor::StreamThreads);
    assert_eq!(
        run.executor_for::<Autodiff<Flex>>(&flex),
        StepExecutor::StreamThreads
    );
}
