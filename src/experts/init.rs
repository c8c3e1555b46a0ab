//! Deterministic parameter initialisation on the host.
//!
//! Backends seed their random generators per process, so with ranks as threads two ranks
//! would draw from one shared stream in an order that depends on scheduling. Drawing every
//! parameter on the host from a stream keyed by (seed, tensor, expert) makes each expert's
//! weights identical whatever the rank count and whichever rank owns it, and every replica
//! of the router identical on every rank.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::rng::SplitMix64;

/// A SplitMix64 stream ([`crate::rng::SplitMix64`]) keyed by seed, tensor and expert: small,
/// fast, and good enough for weight initialisation.
#[derive(Debug, Clone)]
pub(crate) struct HostInit {
    stream: SplitMix64,
}

impl HostInit {
    /// A stream for one tensor (and one expert, for stacked expert tensors).
    pub(crate) fn new(seed: u64, tensor: &str, expert: usize) -> Self {
        let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
        for b in tensor.bytes() {
            state = (state ^ b as u64).wrapping_mul(0x100_0000_01B3);
        }
        state ^= (expert as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
        let mut stream = SplitMix64::new(state);
        stream.next_u64();
        Self { stream }
    }

    /// `count` values uniform in `[-bound, bound)`.
    pub(crate) fn uniform(&mut self, count: usize, bound: f64) -> Vec<f32> {
        (0..count)
            .map(|_| {
                let unit = self.stream.next_f64();
                ((2.0 * unit - 1.0) * bound) as f32
            })
            .collect()
    }

    /// A tensor of `shape` uniform in `[-1/sqrt(fan_in), 1/sqrt(fan_in))`, as `nn::Linear`.
    pub(crate) fn tensor<B: Backend, const D: usize>(
        &mut self,
        shape: [usize; D],
        fan_in: usize,
        device: &B::Device,
    ) -> Tensor<B, D> {
        let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
        let values = self.uniform(shape.iter().product(), bound);
        Tensor::from_data(TensorData::new(values, shape).convert::<B::FloatElem>(), device)
    }
}

/// Stacks per-expert tensors drawn by [`HostInit`] for the experts in `experts`.
pub(crate) fn stacked<B: Backend, const D: usize, const D1: usize>(
    seed: u64,
    name: &str,
    experts: std::ops::Range<usize>,
    shape: [usize; D],
    fan_in: usize,
    device: &B::Device,
) -> Tensor<B, D1> {
    let parts: Vec<Tensor<B, D1>> = experts
        .map(|e| {
            HostInit::new(seed, name, e)
                .tensor::<B, D>(shape, fan_in, device)
                .unsqueeze::<D1>()
        })
        .collect();
    Tensor::cat(parts, 0)
}

/// `count` values uniform in `[-bound, bound)`, from the deterministic host stream keyed by
/// (`seed`, `key`) that the layer's own initialisation uses. Models built around the layer
/// use it to give every rank identical replicas without touching the backend's global RNG.
pub fn seeded_uniform(seed: u64, key: &str, count: usize, bound: f64) -> Vec<f32> {
    HostInit::new(seed, key, 0).uniform(count, bound)
}
