//! The call census (`Census`, CUPTI's callbacks) against work whose calls are known, before
//! the benchmark trusts its host waits and launches per layer step:
//!
//! - reads: each `into_data` of a fresh sum is one launch and one host wait (cubecl-cuda 0.10
//!   `compute/command.rs` `read_async` records a fence that `compute/sync/fence.rs` `wait_sync`
//!   waits for with `cuEventSynchronize`), and at most one more wait for the drop queue's fence
//!   (the read flushes: cubecl-runtime 0.10 `memory_management/drop_queue/queue.rs`).
//!   Each read's wait returns inside the window, so it must also have its time (the census's
//!   entry and exit callbacks paired through CUPTI's `correlationData`), and each thread's
//!   waits together no more than the window's wall time;
//! - a cuBLAS product: the GEMM's launch must be seen, through the driver (a kernel named like
//!   a GEMM) or the runtime, or the benchmark's launch counts leave cuBLAS out. Which of the two
//!   is printed, so the benchmark's rows can be read without double counting.

use burn::tensor::{Distribution, Tensor, TensorPrimitive};
use mpipemoe::backend::ExpertPath;
use mpipemoe::GemmPrecision;
use mpipemoe_cuda::{CallCounts, CallKind, Census, CublasExperts, CudaMoe};

type Inner = CudaMoe<f32>;

/// Reads counted in the first check.
const READS: u64 = 5;

pub(crate) fn checks() -> Vec<(String, Result<String, String>)> {
    let census = match Census::start() {
        Ok(census) => census,
        Err(e) => return vec![("census".into(), Ok(format!("(skipped: {e})")))],
    };
    vec![
        (format!("census: {READS} reads"), reads(&census)),
        ("census: one cuBLAS product".into(), product(&census)),
    ]
}

/// The calls that wait, by name, for a note.
fn waits(calls: &CallCounts) -> String {
    calls
        .driver()
        .iter()
        .chain(calls.runtime())
        .filter(|(name, _)| CallKind::of(name) == CallKind::Wait)
        .map(|(name, c)| format!("{name} {c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn reads(census: &Census) -> Result<String, String> {
    let device = Default::default();
    let x = Tensor::<Inner, 1>::random([1024], Distribution::Default, &device);
    // The kernel compiled and the pools warm outside the window.
    let _ = (x.clone() + 1.0).into_data();
    let window = std::time::Instant::now();
    let ((), calls) = census
        .count(|| {
            for _ in 0..READS {
                let _ = (x.clone() + 1.0).into_data();
            }
        })
        .map_err(|e| e.to_string())?;
    let window_ns = window.elapsed().as_nanos() as u64;
    let waits_seen = calls.driver_of(CallKind::Wait) + calls.runtime_of(CallKind::Wait);
    let launches = calls.driver_of(CallKind::Launch);
    let named: u64 = calls.kernels().values().sum();
    let timed = calls.spent_of(CallKind::Wait);
    let note = format!(
        "{waits_seen} host waits ({}), {launches} driver launches, {named} named; {} driver waits timed, {:.3} ms in all, on {}",
        waits(&calls),
        timed.calls,
        timed.ns as f64 / 1e6,
        calls.threads().collect::<Vec<_>>().join(", ")
    );
    // A wait that another thread began in the window may end after it (counted, not timed);
    // the reads' own end inside it. Each thread's waits follow one another.
    let threads = calls.threads().count().max(1) as u64;
    if timed.calls < READS || timed.calls > calls.driver_of(CallKind::Wait) || timed.ns > window_ns * threads
    {
        return Err(format!(
            "expected the reads' driver waits timed, within the window's {:.3} ms a thread: {note}",
            window_ns as f64 / 1e6
        ));
    }
    if !(READS..=2 * READS + 1).contains(&waits_seen) {
        return Err(format!(
            "expected {READS} to {} host waits: {note}",
            2 * READS + 1
        ));
    }
    if launches < READS || named != launches {
        return Err(format!(
            "expected at least {READS} launches, each with its kernel's name: {note}"
        ));
    }
    Ok(note)
}

fn product(census: &Census) -> Result<String, String> {
    let path = CublasExperts::new(0).map_err(|e| format!("no cuBLAS path: {e}"))?;
    let device = Default::default();
    let random = |r: usize, c: usize| {
        Tensor::<Inner, 2>::random([r, c], Distribution::Default, &device)
            .into_primitive()
            .tensor()
    };
    let (a, b) = (random(256, 512), random(512, 384));
    let multiply = || -> Result<(), String> {
        let out = path
            .matmul(a.clone(), b.clone(), GemmPrecision::Tf32)
            .map_err(|e| e.to_string())?;
        let _ = Tensor::<Inner, 2>::from_primitive(TensorPrimitive::Float(out)).into_data();
        Ok(())
    };
    multiply()?;
    let (done, calls) = census.count(multiply).map_err(|e| e.to_string())?;
    done?;
    let gemm_kernels: u64 = calls
        .kernels()
        .iter()
        .filter(|(name, _)| name.to_lowercase().contains("gemm"))
        .map(|(_, c)| c)
        .sum();
    let runtime = calls.runtime_of(CallKind::Launch);
    let note = format!(
        "GEMM kernels through the driver {gemm_kernels}, runtime launches {runtime} ({} driver launches in all; kernels: {})",
        calls.driver_of(CallKind::Launch),
        calls
            .kernels()
            .iter()
            .map(|(name, c)| format!("{} {c}", name.chars().take(48).collect::<String>()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if gemm_kernels == 0 && runtime == 0 {
        return Err(format!("the GEMM's launch was not counted: {note}"));
    }
    Ok(note)
}
