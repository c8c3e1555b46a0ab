//! The layer's device memory on WGPU, read from cubecl's allocator
//! (`harness::DeviceMemoryMeter`): FastMoE-style (one partition, no reuse), PipeMoE (n
//! partitions, no reuse) and MPipeMoE under each strategy, beside this implementation's
//! memory model, as `gpu_memory` reads them on CUDA. The meter samples, so what the test holds
//! it to is what sampling can promise; the figures are printed.

use burn::backend::wgpu::{WgpuDevice, WgpuRuntime};
use burn::backend::Autodiff;
use burn_cubecl::CubeBackend;
use mpipemoe::harness::{measure_layer_peak, DeviceMemoryMeter};
use mpipemoe::memory::Strategy;
use mpipemoe::{MemoryReuse, MoeLayerConfig, Partitions};

use super::alone;

type Raw = Autodiff<CubeBackend<WgpuRuntime, f32, i32, u32>>;

const MIB: f64 = 1024.0 * 1024.0;

#[test]
fn device_memory_against_the_model_on_wgpu() {
    let _device = alone();
    let device = WgpuDevice::default();
    let meter = DeviceMemoryMeter::<WgpuRuntime>::new(&device);
    let (m, h, tokens) = (128, 512, 1024);
    let mut runs = vec![(1, Strategy::None)];
    runs.extend(Strategy::ALL.map(|s| (4, s)));
    for (n, strategy) in runs {
        let config = MoeLayerConfig::new(m, h, 4, 1)
            .with_router_bias(true)
            .with_seed(3)
            .with_partitions(Partitions::Fixed(n))
            .with_memory_reuse(MemoryReuse::from(strategy))
            .with_memory_budget(Some(usize::MAX / 4));
        let measured =
            measure_layer_peak::<Raw>(&meter, &config, None, None, tokens, 1, true, &device, &|c| c).unwrap();
        let rank = &measured.ranks[0];
        let model = rank.stats.memory.as_ref().unwrap().peak_bytes[0];
        let sample = meter.last(0).unwrap();
        let line = format!(
            "n={n} {strategy}: in use {:.2} MiB, model {:.2} MiB, {:.2}; reserved {:.2} MiB; {} samples",
            rank.peak_device_bytes as f64 / MIB,
            model / MIB,
            rank.peak_device_bytes as f64 / model,
            sample.peak_reserved as f64 / MIB,
            sample.samples
        );
        eprintln!("{line}");
        // What a sampler can promise (see `harness/device_memory.rs`): it never sees more than
        // the pass's true peak, and its last read, after the pass, sees at least the partition
        // buffers the pass allocated and the arena keeps. The true peak moves from run to run
        // on WGPU: over eleven runs 0.95–1.13 of the model at n = 4 and 1.01–1.56 at n = 1
        // (one partition, whose large buffers are freed and allocated again within the pass).
        // So at n = 4 a pass counted twice, or a warm-up's buffers counted in it, fails.
        let ratio = rank.peak_device_bytes as f64 / model;
        let bound = if n == 1 { 2.0 } else { 1.5 };
        assert!(ratio <= bound, "{line}");
        assert!(
            rank.arena_bytes > 0,
            "{line}: the pass allocated no partition buffer"
        );
        assert!(
            rank.peak_device_bytes as u64 >= rank.arena_bytes,
            "{line}: arena {}",
            rank.arena_bytes
        );
        assert!(sample.peak_reserved >= sample.peak_in_use, "{line}");
    }
}
