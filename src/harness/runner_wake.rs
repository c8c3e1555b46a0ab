//! How long a blocking device call takes after the host has left the device's runner thread
//! idle: the probe behind `tools/examples/runner_wake.rs` (WGPU) and `gpu_bench --wake` (CUDA).
//!
//! On a std target cubecl serves each device from a runner thread behind cubecl-common 0.10's
//! channel (`device/handle/mod.rs`: `ChannelDeviceHandle` where `multi_threading` holds). The
//! runner's loop (`device/handle/channel.rs`, `Server::start`) spins 8,192 times
//! (`SPIN_BUDGET_SERVER`), yields 64 times and then sleeps 150 µs at a time
//! (`SLEEP_STEP_SERVER`) until a full or flushed buffer of tasks is there; a blocking call
//! (`run_scoped`: enqueue, flush, wait for the answer) is picked up only when the loop looks.
//! burn's fusion has a runner of its own (burn-fusion 0.21 `client.rs`, stage `Upstream`)
//! beside the backend's (`Downstream`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Tensor};

use crate::error::{MoeError, Result};

/// Microseconds of `calls` device syncs with nothing queued, each after about `gap` of the host
/// busy on its own (a busy wait, so that the gap is what was asked: a sleep would add the
/// scheduler's timer slack). Each gap is `gap` times a factor spread evenly over 0.75 to 1.25
/// (the golden ratio's sequence), so that the calls do not lock onto the phase of the runner's
/// sleep steps: with one fixed gap, a call could always come just as the runner wakes, or just
/// after. A little work runs first, so that the runners exist and the kernels are compiled;
/// five untimed calls follow it.
pub fn runner_wake_latencies<B: Backend>(
    device: &B::Device,
    gap: Duration,
    calls: usize,
) -> Result<Vec<f64>> {
    let sync = || B::sync(device).map_err(|e| MoeError::Backend(format!("device sync: {e:?}")));
    let x = Tensor::<B, 2>::random([64, 64], Distribution::Default, device);
    let _ = (x * 2.0).sum().into_scalar();
    sync()?;
    let mut times = Vec::with_capacity(calls + 5);
    for i in 0..calls + 5 {
        let spread = 0.75 + 0.5 * (i as f64 * 0.618_033_988_749_895).fract();
        let this_gap = gap.mul_f64(spread);
        let idle = Instant::now();
        while idle.elapsed() < this_gap {
            std::hint::spin_loop();
        }
        let start = Instant::now();
        sync()?;
        times.push(start.elapsed().as_secs_f64() * 1e6);
    }
    Ok(times.split_off(5))
}

/// A helper thread that calls `touch` about every `period` until stopped: with a `touch` that
/// gives each device runner a task (burn-fusion's non-blocking `FusionClient::flush_queue` for
/// fusion's runner, a blocking `ComputeClient::memory_usage` for the backend's), neither runs
/// out of its spin budget while the helper runs. A probe of the mitigation, not part of a step:
/// it keeps a core busy (the runners spin instead of sleeping).
pub struct RunnerKeeper {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<u64>,
}

impl RunnerKeeper {
    /// Starts the helper; `touch` runs on its thread, then the thread sleeps for `period`.
    pub fn start(period: Duration, mut touch: impl FnMut() + Send + 'static) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut touches = 0;
            while !flag.load(Ordering::Relaxed) {
                touch();
                touches += 1;
                std::thread::sleep(period);
            }
            touches
        });
        Self { stop, thread }
    }

    /// Stops the helper and waits for it: how many times it called `touch`.
    pub fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}

/// User + system CPU seconds of this process so far, from `/proc/self/stat` (Linux), or 0
/// where it cannot be read: what a probe's helper threads cost, beside its wall time.
pub fn process_cpu_s() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // The fields after the command name: utime and stime are the 12th and 13th of them
    // (fields 14 and 15 of proc(5)).
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks: f64 = fields
        .get(11..13)
        .map_or(0.0, |f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum());
    // Linux's USER_HZ is 100 on every architecture it runs on.
    ticks / 100.0
}

/// The `q`-quantile of `times` (nearest rank; `q` in `[0, 1]`), or NaN where it is empty.
pub fn quantile(times: &[f64], q: f64) -> f64 {
    if times.is_empty() {
        return f64::NAN;
    }
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[((sorted.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_nearest_ranks() {
        let times = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(quantile(&times, 0.5), 3.0);
        assert_eq!(quantile(&times, 0.0), 1.0);
        assert_eq!(quantile(&times, 1.0), 5.0);
        assert_eq!(quantile(&times, 0.9), 5.0);
        assert_eq!(quantile(&times, 0.2), 2.0);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn process_cpu_counts_a_busy_thread() {
        let before = process_cpu_s();
        let start = Instant::now();
        let mut x = 0u64;
        while start.elapsed() < Duration::from_millis(100) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        // A tick is 10 ms; 100 ms of work on this thread is at least a few of them.
        assert!(process_cpu_s() - before >= 0.05, "{x}");
    }

    #[test]
    fn the_keeper_touches_until_it_is_stopped() {
        let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let seen = count.clone();
        let keeper = RunnerKeeper::start(Duration::from_micros(100), move || {
            seen.fetch_add(1, Ordering::Relaxed);
        });
        while count.load(Ordering::Relaxed) < 3 {
            std::thread::yield_now();
        }
        let touches = keeper.stop();
        assert!(touches >= 3);
        // Stopped and joined: no touch comes after the count it reported.
        assert_eq!(count.load(Ordering::Relaxed), touches);
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(count.load(Ordering::Relaxed), touches);
    }

    #[cfg(feature = "ndarray")]
    #[test]
    fn latencies_follow_the_gap_and_count_the_calls() {
        let device = Default::default();
        let start = Instant::now();
        let times =
            runner_wake_latencies::<burn_ndarray::NdArray>(&device, Duration::from_micros(2_000), 7).unwrap();
        // Twelve calls (five untimed), each after at least three quarters of its gap: the host
        // was kept busy for them.
        assert!(start.elapsed() >= Duration::from_micros(12 * 1_500));
        assert_eq!(times.len(), 7);
        assert!(times.iter().all(|t| t.is_finite() && *t >= 0.0));
    }
}
