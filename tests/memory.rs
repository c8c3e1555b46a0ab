//! Memory reuse measured with a counting allocator on a mid-size config, and the paper's
//! memory model (Eq. 1–9) against hand-computed values.
//!
//! The allocator counts every thread of the process, so everything that measures runs inside
//! one test function, one configuration at a time.

use burn::backend::{Autodiff, Flex};
use mpipemoe::harness::{measure_layer_memory, CountingAllocator};
use mpipemoe::memory::{ImplementationModel, LayerShape, PaperTerms};
use mpipemoe::{MemoryReuse, MoeLayerConfig, Partitions, Strategy};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator::new();

type B = Autodiff<Flex>;

fn shape(tokens: usize, m: usize, h: usize, ranks: usize, n: usize) -> LayerShape {
    LayerShape::paper(tokens, m, h, ranks, n)
}

#[test]
fn memory_reuse_saves_what_the_model_says() {
    let (m, h, tokens) = (64, 256, 512);
    let device = Default::default();
    let mut report = Vec::new();
    for ranks in [1, 2] {
        let config = |n: usize, reuse: MemoryReuse| {
            MoeLayerConfig::new(m, h, ranks, 1)
                .with_seed(3)
                .with_partitions(Partitions::Fixed(n))
                .with_memory_reuse(reuse)
        };
        // Every measurement warms up first: at this small size, lazily created pools are
        // comparable to the peak itself. Then the FastMoE-style baseline.
        measure_layer_memory::<B>(&ALLOC, &config(1, MemoryReuse::Off), 64, ranks, true, &device).unwrap();
        let baseline =
            measure_layer_memory::<B>(&ALLOC, &config(1, MemoryReuse::Off), tokens, ranks, true, &device)
                .unwrap()
                .peak_device_bytes as f64;
        for n in [4, 8] {
            for strategy in Strategy::ALL {
                let measured = measure_layer_memory::<B>(
                    &ALLOC,
                    &config(n, strategy.into()),
                    tokens,
                    ranks,
                    true,
                    &device,
                )
                .unwrap();
                let s = shape(tokens, m, h, ranks, n);
                let implementation = ImplementationModel::new(&s, strategy);
                let label = format!("ranks {ranks} n {n} {strategy}");
                // Host bytes are exactly what the strategy offloads: T_DI and/or T_M.
                assert_eq!(
                    measured.host_bytes as f64,
                    implementation.host() * 4.0,
                    "{label}: host bytes"
                );
                // The implementation's own model predicts the device peak.
                let model_ratio = measured.peak_device_bytes as f64 / (implementation.peak_device() * 4.0);
                assert!(
                    (0.7..1.3).contains(&model_ratio),
                    "{label}: measured/implementation model {model_ratio:.2}"
                );
                let saving = baseline - measured.peak_device_bytes as f64;
                if strategy.reuses_buffers() {
                    assert!(saving > 0.0, "{label}: no saving ({saving} bytes)");
                    let modelled = PaperTerms::new(&s).to_bytes(4).saving_vs_fastmoe(true);
                    let ratio = saving / modelled;
                    report.push(format!(
                        "{label}: saving {saving} B, paper {modelled:.0} B, ratio {ratio:.2}"
                    ));
                    if strategy == Strategy::S4 {
                        assert!(
                            ratio >= 0.95,
                            "{label}: measured/modelled saving {ratio:.2} < 0.95"
                        );
                    }
                }
            }
        }
    }
    eprintln!("{}", report.join("\n"));
}

#[test]
fn paper_equations_match_hand_computation() {
    // B = 4096 tokens, M = 1024, H = 4096, E = N = 8, n = 4 (BERT-L expert shape).
    let terms = PaperTerms::new(&shape(4096, 1024, 4096, 8, 4));
    let (b, m, h, e, n) = (4096.0, 1024.0, 4096.0, 8.0, 4.0);
    assert_eq!(terms.m_ms, 4.0 * (e * m + 2.0 * h * m));
    assert_eq!(terms.m_act, 4.0 * b * m + b * h);
    assert_eq!(terms.m_buf, b * m + b * h);
    assert_eq!(terms.m_act_pipe, 4.0 * b * m + b * h);
    assert_eq!(terms.m_buf_pipe, terms.m_act_pipe);
    let delta = b * (2.0 * m * (n - 2.0) / n + h * (n - 1.0) / n);
    assert_eq!(terms.delta_m_act, delta);
    assert_eq!(terms.delta_m_buf, delta);
    assert_eq!(terms.phi, 2.0 * delta / (terms.m_ms + 2.0 * terms.m_act_pipe));
    // 4096 · (1024 + 3072) = 16_777_216 elements each; φ = 33_554_432 / 100_696_064.
    assert_eq!(delta, 16_777_216.0);
    assert!((terms.phi - 0.333_224_9).abs() < 1e-6, "phi {}", terms.phi);
    // Bytes scale by the dtype size; φ does not.
    let bytes = terms.to_bytes(2);
    assert_eq!(bytes.m_act, 2.0 * terms.m_act);
    assert_eq!(bytes.phi, terms.phi);
    // With E/N local experts the model states count this rank's experts only.
    let sharded = PaperTerms::new(&shape(4096, 1024, 4096, 8, 4).with_experts(64));
    assert_eq!(sharded.m_ms, 4.0 * (64.0 * m + 2.0 * h * m * 8.0));
}

trait WithExperts {
    fn with_experts(self, n_experts: usize) -> Self;
}

impl WithExperts for LayerShape {
    fn with_experts(mut self, n_experts: usize) -> Self {
        self.n_experts = n_experts;
        self
    }
}
