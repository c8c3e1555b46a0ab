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
