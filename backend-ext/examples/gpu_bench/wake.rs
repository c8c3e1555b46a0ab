//! `gpu_bench --wake`: how long a blocking call to cubecl's device thread takes on CUDA after
//! the host has left it idle, raw and under burn's fusion (`tools/examples/runner_wake.rs` is
//! the same on WGPU; `mpipemoe::harness::runner_wake_latencies` cites cubecl's lines).
//!
//! A layer step makes a few blocking calls (the routing read, each cuBLAS section's call on the
//! device thread, and under fusion every resolve), with host work between them. Where the
//! device thread has gone to sleep by then, each such call waits for the rest of a 150 µs sleep
//! step; this table says from which idle gap on, on the lent machine's CPU. The last two
//! columns are the same calls with a `RunnerKeeper` touching both runners every 20 µs (plus the
//! sleep's slack): whether keeping them busy removes the wait on that machine, and what it
//! costs (the process's CPU seconds, printed at the end).

use std::time::{Duration, Instant};

use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::cubecl::Runtime;
use mpipemoe::harness::{process_cpu_s, quantile, runner_wake_latencies, RunnerKeeper};
use serde::Serialize;

use super::Inner;

type Fusion = mpipemoe_cuda::CudaMoeFusion<f32>;

/// Idle gaps before each call, µs.
const GAPS_US: [u64; 9] = [0, 50, 100, 150, 200, 300, 500, 1000, 3000];
/// Timed calls per gap and backend.
const CALLS: usize = 200;

#[derive(Serialize)]
pub(super) struct WakeRow {
    gap_us: u64,
    backend: &'static str,
    median_us: f64,
    p90_us: f64,
    min_us: f64,
    max_us: f64,
}

/// A keeper of the runners of `device` (fusion's too where `fusion`): every 20 µs, plus the
/// sleep's slack, a non-blocking flush of fusion's queue (burn-fusion 0.21 `client.rs`,
/// `flush_queue`) and a blocking memory-use call to cubecl's runner, so that neither runs out
/// of its spin budget while it runs.
pub(super) fn keeper(device: &burn::tensor::Device<Inner>, fusion: bool) -> RunnerKeeper {
    let fusion = fusion.then(|| burn_fusion::get_client::<Inner>(device));
    let cube = CudaRuntime::client(device);
    RunnerKeeper::start(Duration::from_micros(20), move || {
        if let Some(fusion) = &fusion {
            fusion.flush_queue();
        }
        let _ = cube.memory_usage();
    })
}

/// Every gap on the raw backend and under fusion, without and with a keeper, printed as a
/// table as it goes.
pub(super) fn wake_rows() -> mpipemoe::Result<Vec<WakeRow>> {
    let device = Default::default();
    println!("blocking device sync after an idle gap, CUDA: median / 90th percentile, µs");
    println!("| gap µs | raw | under fusion | raw, runners kept busy | under fusion, kept busy |");
    println!("|---|---|---|---|---|");
    let (start, cpu) = (Instant::now(), process_cpu_s());
    let mut keeper_cpu = 0.0;
    let mut rows = Vec::new();
    for gap_us in GAPS_US {
        let gap = Duration::from_micros(gap_us);
        let raw = runner_wake_latencies::<Inner>(&device, gap, CALLS)?;
        let fused = runner_wake_latencies::<Fusion>(&device, gap, CALLS)?;
        let kept_from = process_cpu_s();
        let keeper = keeper(&device, true);
        let raw_kept = runner_wake_latencies::<Inner>(&device, gap, CALLS);
        let fused_kept = runner_wake_latencies::<Fusion>(&device, gap, CALLS);
        keeper.stop();
        keeper_cpu += process_cpu_s() - kept_from;
        let (raw_kept, fused_kept) = (raw_kept?, fused_kept?);
        let cell = |t: &[f64]| format!("{:.1} / {:.1}", quantile(t, 0.5), quantile(t, 0.9));
        println!(
            "| {gap_us} | {} | {} | {} | {} |",
            cell(&raw),
            cell(&fused),
            cell(&raw_kept),
            cell(&fused_kept)
        );
        for (backend, times) in [
            ("raw", raw),
            ("fusion", fused),
            ("raw kept", raw_kept),
            ("fusion kept", fused_kept),
        ] {
            rows.push(WakeRow {
                gap_us,
                backend,
                median_us: quantile(&times, 0.5),
                p90_us: quantile(&times, 0.9),
                min_us: quantile(&times, 0.0),
                max_us: quantile(&times, 1.0),
            });
        }
    }
    println!(
        "{:.1} s wall, {:.1} s CPU of the process, {keeper_cpu:.1} s of it while a keeper ran",
        start.elapsed().as_secs_f64(),
        process_cpu_s() - cpu
    );
    Ok(rows)
}
