//! `gpu_bench --wake`: how long a blocking call to cubecl's device thread takes on CUDA after
//! the host has left it idle, raw and under burn's fusion (`tools/examples/runner_wake.rs` is
//! the same on WGPU; `mpipemoe::harness::runner_wake_latencies` cites cubecl's lines).
//!
//! A layer step makes a few blocking calls (the routing read, each cuBLAS section's call on the
//! device thread, and under fusion every resolve), with host work between them. Where the
//! device thread has gone to sleep by then, each such call waits for the rest of a 150 µs sleep
//! step; this table says from which idle gap on, on the lent machine's CPU.

use std::time::Duration;

use mpipemoe::harness::{quantile, runner_wake_latencies};
use serde::Serialize;

use super::Inner;

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

/// Every gap on the raw backend and under fusion, printed as a table as it goes.
pub(super) fn wake_rows() -> mpipemoe::Result<Vec<WakeRow>> {
    let device = Default::default();
    println!("blocking device sync after an idle gap, CUDA: median / 90th percentile, µs");
    println!("| gap µs | raw | under fusion |");
    println!("|---|---|---|");
    let mut rows = Vec::new();
    for gap_us in GAPS_US {
        let gap = Duration::from_micros(gap_us);
        let raw = runner_wake_latencies::<Inner>(&device, gap, CALLS)?;
        let fused = runner_wake_latencies::<mpipemoe_cuda::CudaMoeFusion<f32>>(&device, gap, CALLS)?;
        println!(
            "| {gap_us} | {:.1} / {:.1} | {:.1} / {:.1} |",
            quantile(&raw, 0.5),
            quantile(&raw, 0.9),
            quantile(&fused, 0.5),
            quantile(&fused, 0.9)
        );
        for (backend, times) in [("raw", raw), ("fusion", fused)] {
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
    Ok(rows)
}
