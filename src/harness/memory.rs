//! Measuring the peak memory of one forward + backward pass of the layer on the CPU.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use serde::Serialize;

use super::CountingAllocator;
use crate::error::Result;
use crate::experts::HostInit;
use crate::{LocalGroup, MoeBackend, MoeLayerConfig};

/// What one measurement found, per rank.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MemoryMeasurement {
    /// Peak bytes allocated by a rank during forward + backward above what it held before, for
    /// the rank with the largest peak (the one that would run out of memory first). Each rank
    /// thread is tagged, so every block counts against the rank that allocated it. Offloaded
    /// partitions are not included: the host store lives outside the allocator.
    pub peak_device_bytes: usize,
    /// Most bytes this rank's host store held at once.
    pub host_bytes: usize,
}

/// Measures one forward + backward of a layer with `config` on `n_ranks` ranks, each with
/// `tokens_per_rank` tokens, with `loss = sum(y · probe)`.
///
/// `alloc` must be the process's global allocator. Each rank thread tags its allocations
/// with its rank; allocations by helper threads (the backend's worker pool) are not counted.
/// With `warm_up`, each rank first runs one
/// unmeasured pass, so lazily created thread pools and buffers are live before the count
/// starts; once per process and shape is enough, since the count is of live bytes. Then, with
/// all ranks idle at a barrier, the allocator's peak is reset, one pass runs, and the peak is
/// read at the next barrier. Counts are process-wide, so nothing else may run meanwhile.
pub fn measure_layer_memory<B>(
    alloc: &CountingAllocator,
    config: &MoeLayerConfig,
    tokens_per_rank: usize,
    n_ranks: usize,
    warm_up: bool,
    device: &B::Device,
) -> Result<MemoryMeasurement>
where
    B: AutodiffBackend + MoeBackend,
{
    let results = LocalGroup::run(n_ranks, |ctx| {
        CountingAllocator::tag_thread(Some(ctx.rank));
        let layer = config.init_rank::<B>(device, ctx.comm.clone())?;
        let m = config.d_model;
        let data = |name: &str| {
            let values = HostInit::new(config.seed, name, ctx.rank).uniform(tokens_per_rank * m, 1.0);
            TensorData::new(values, [tokens_per_rank, m]).convert::<B::FloatElem>()
        };
        let x = Tensor::<B, 2>::from_data(data("x"), device).require_grad();
        let probe = Tensor::<B, 2>::from_data(data("probe"), device);
        let pass = || -> Result<()> {
            let out = layer.try_forward(x.clone())?;
            let grads = (out.output * probe.clone()).sum().backward();
            drop(grads);
            Ok(())
        };
        if warm_up {
            pass()?;
        }
        ctx.comm.barrier()?;
        if ctx.rank == 0 {
            alloc.reset_peak();
        }
        layer.context().meter().reset_peak();
        ctx.comm.barrier()?;
        let base = alloc.rank_current(ctx.rank);
        pass()?;
        ctx.comm.barrier()?;
        let peak = alloc.rank_peak(ctx.rank).saturating_sub(base);
        let host = layer.context().meter().report().host_peak_bytes;
        ctx.comm.barrier()?;
        CountingAllocator::tag_thread(None);
        Ok((peak, host))
    })?;
    Ok(MemoryMeasurement {
        peak_device_bytes: results.iter().map(|r| r.0).max().unwrap_or(0),
        host_bytes: results.iter().map(|r| r.1).max().unwrap_or(0),
    })
}
