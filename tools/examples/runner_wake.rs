//! How long a blocking call to a cubecl device thread takes after the host has left it idle, on
//! WGPU raw and under burn's fusion (`gpu_bench --wake` is the same on CUDA).
//!
//! ```text
//! cargo run --release -p mpipemoe-tools --features probes --example runner_wake [-- --calls 200]
//! ```
//!
//! A cubecl device's runner thread spins, yields and then sleeps 150 µs at a time while it has
//! nothing to do, and a blocking call is picked up only when its loop looks
//! (`mpipemoe::harness::runner_wake_latencies` cites the lines). For each idle gap (the host
//! busy on its own, as it is while it plans a step or runs a cuBLAS section) the probe times
//! `--calls` device syncs with nothing queued, each after that gap: on raw WGPU one call to the
//! backend's runner; under fusion fusion's runner drains its empty queue, then the backend's
//! syncs. It prints each gap's median and 90th percentile. Where a runner sleeps, the medians
//! step up by about a sleep step.
//!
//! `--keeper-us N` runs a helper thread beside the calls that touches both runners about
//! every N µs (fusion's with burn-fusion's non-blocking `FusionClient::flush_queue`, the
//! backend's with a blocking `memory_usage`), so that neither runs out of its spin budget: the
//! mitigation the design notes weigh, and what it costs in CPU time.

use std::time::{Duration, Instant};

use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
use burn::backend::Wgpu;
use burn::tensor::backend::Backend;
use burn_cubecl::cubecl::Runtime;
use clap::Parser;
use mpipemoe::harness::{process_cpu_s, quantile, runner_wake_latencies, RunnerKeeper};
use mpipemoe_tools::backends::{WgpuFusion, WgpuInner};

#[derive(Parser, Debug)]
struct Args {
    /// Timed calls per gap.
    #[arg(long, default_value_t = 200)]
    calls: usize,
    /// Idle gaps before each call, µs.
    #[arg(long, value_delimiter = ',', default_value = "0,50,100,150,200,300,500,1000")]
    gaps_us: Vec<u64>,
    /// A helper touches both runners about every N µs while the calls run (0: none).
    #[arg(long, default_value_t = 0)]
    keeper_us: u64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let keeper = (args.keeper_us > 0).then(|| {
        let device = WgpuDevice::default();
        let fusion = burn_fusion::get_client::<WgpuInner>(&device);
        let cube = WgpuRuntime::client(&device);
        RunnerKeeper::start(Duration::from_micros(args.keeper_us), move || {
            fusion.flush_queue();
            let _ = cube.memory_usage();
        })
    });
    let (start, cpu) = (Instant::now(), process_cpu_s());
    println!("blocking device sync after an idle gap: median / 90th percentile, µs");
    println!("| gap µs | raw WGPU | WGPU under fusion |");
    println!("|---|---|---|");
    for &gap in &args.gaps_us {
        let raw = summary::<Wgpu>(gap, args.calls)?;
        let fused = summary::<WgpuFusion>(gap, args.calls)?;
        println!("| {gap} | {raw} | {fused} |");
    }
    let touches = keeper.map_or(0, RunnerKeeper::stop);
    println!(
        "{:.1} s wall, {:.1} s CPU of the process; the keeper touched the runners {touches} times",
        start.elapsed().as_secs_f64(),
        process_cpu_s() - cpu
    );
    Ok(())
}

fn summary<B: Backend>(gap_us: u64, calls: usize) -> mpipemoe::Result<String> {
    let times = runner_wake_latencies::<B>(&Default::default(), Duration::from_micros(gap_us), calls)?;
    Ok(format!(
        "{:.1} / {:.1}",
        quantile(&times, 0.5),
        quantile(&times, 0.9)
    ))
}
