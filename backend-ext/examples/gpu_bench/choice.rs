//! The router's choice of experts on the device against the host's, at 4,096 tokens for the
//! routers of BENCHMARKS §15 (the goal shapes' 8 experts at top-1 and top-2, and the
//! fine-grained ones): the time from values on the device to the choice on the host.
//!
//! - `device`: the choice kernel and the read of `top_k` columns a token
//!   (`RouterKernels::router_choose`, what the layer runs on CUDA);
//! - `host`: the read of every value and `group_limited_top_k` on the host, what the layer ran
//!   before (and still runs where a value is not finite).
//!
//! Both sides end with the choice on the host, so each step is a host wait and needs no other
//! sync. The two are first checked to choose the same experts; a difference ends the run. They
//! run alternately, a step each, and each side's figure is the median of its steps.

use burn::tensor::{Distribution, Tensor};
use mpipemoe::backend::{DeviceChoice, RouterKernels};
use mpipemoe::harness::{group_limited_top_k, BENCH_ROUTERS};
use mpipemoe::RoutingRule;

use super::{median, primitive, Inner};
use std::time::Instant;

/// One router's figures: its label, `top_k`, and (median, min, max) ms of each side.
pub(super) struct ChoiceTimes {
    pub label: &'static str,
    pub top_k: usize,
    pub device: (f64, f64, f64),
    pub host: (f64, f64, f64),
}

/// Times both sides for every router at `tokens` tokens; `Err` where the device does not
/// choose or chooses otherwise than the host.
pub(super) fn choice_times(tokens: usize, repeats: usize) -> Result<Vec<ChoiceTimes>, String> {
    let device = Default::default();
    BENCH_ROUTERS
        .iter()
        .map(|&(label, n_experts, top_k, n_group, topk_group)| {
            // The routing bench's values: uniform in [-2, 2), no ties to speak of.
            let values =
                Tensor::<Inner, 2>::random([tokens, n_experts], Distribution::Uniform(-2.0, 2.0), &device);
            let rule = RoutingRule {
                n_group,
                topk_group,
                ..RoutingRule::top_k(top_k, true)
            };
            let on_device = || {
                let p = primitive(values.clone());
                Inner::router_choose(p.clone(), p, &rule).and_then(|read| read.wait())
            };
            let on_host = || {
                let host = values
                    .clone()
                    .into_data()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .expect("f32 values");
                group_limited_top_k(&host, n_experts, top_k, n_group, topk_group)
            };
            match on_device() {
                Some(DeviceChoice::Chosen(got)) if got == on_host() => {}
                Some(DeviceChoice::Chosen(_)) => {
                    return Err(format!("{label}: the device chose otherwise than the host"))
                }
                other => return Err(format!("{label}: the device's choice is {other:?}")),
            }
            // The sides alternate, two warm-up rounds first, so that both meet the same state
            // of the machine.
            let (mut device_ms, mut host_ms) = (Vec::new(), Vec::new());
            for round in 0..repeats + 2 {
                let start = Instant::now();
                std::hint::black_box(on_device());
                let device = start.elapsed().as_secs_f64() * 1e3;
                let start = Instant::now();
                std::hint::black_box(on_host());
                let host = start.elapsed().as_secs_f64() * 1e3;
                if round >= 2 {
                    device_ms.push(device);
                    host_ms.push(host);
                }
            }
            Ok(ChoiceTimes {
                label,
                top_k,
                device: median(device_ms),
                host: median(host_ms),
            })
        })
        .collect()
}
