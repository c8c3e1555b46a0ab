//! Measuring the peak memory of one forward + backward pass of the layer on the CPU.

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use serde::Serialize;

use crate::comm::GroupOptions;
use crate::error::Result;
use crate::experts::HostInit;
use crate::layer::{MoeLayer, MoeStats, TensorMap};
use crate::memory::alloc::CountingAllocator;
use crate::{LocalGroup, MoeBackend, MoeLayerConfig};

/// What one rank's measured pass held and did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankMemory {
    /// Peak bytes this rank allocated during forward + backward above what it held before.
    /// Every block counts against the rank whose thread (or stream worker) allocated it.
    /// Offloaded partitions are not included: the host store lives outside the allocator.
    pub peak_device_bytes: usize,
    /// Most bytes this rank's host store held at once.
    pub host_bytes: usize,
    /// Rows this rank's experts received (kept assignments of the global batch).
    pub recv_rows: usize,
    /// The layer's stats of the measured pass (split, strategy, the budget's decision).
    pub stats: MoeStats,
}

/// What one measurement found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryMeasurement {
    /// The largest rank peak (the rank that would run out of memory first).
    pub peak_device_bytes: usize,
    /// The largest host-store peak of a rank.
    pub host_bytes: usize,
    /// Every rank's figures.
    pub ranks: Vec<RankMemory>,
}

/// Measures one forward + backward of a freshly initialised layer with `config` on
/// `n_ranks` ranks, each with `tokens_per_rank` tokens; see [`measure_layer_memory_with`].
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
    measure_layer_memory_with::<B>(
        alloc,
        config,
        None,
        None,
        tokens_per_rank,
        n_ranks,
        warm_up,
        device,
    )
}

/// Each rank's input tokens, `[tokens_per_rank · d_model]` for rank `r`.
pub type TokenSource<'a> = &'a (dyn Fn(usize) -> Vec<f32> + Sync);

/// Measures one forward + backward of a layer with `config` (and the canonical `weights`, if
/// given: a router that routes as a test wants) on `n_ranks` ranks, each with
/// `tokens_per_rank` tokens (from `tokens`, or seeded), with `loss = sum(y · probe)`.
///
/// `alloc` must be the process's global allocator. Each rank thread tags its allocations
/// with its rank, and the exchange's stream workers take their rank's tag; allocations by the
/// backend's own worker pool are not counted. With `warm_up`, each rank first runs one
/// unmeasured pass, so lazily created thread pools and buffers are live before the count
/// starts. Then, with all ranks idle at a barrier, the allocator's peak is reset, one pass
/// runs, and each rank's peak is read at the next barrier. Counts are process-wide, so nothing
/// else may run meanwhile.
#[allow(clippy::too_many_arguments)]
pub fn measure_layer_memory_with<B>(
    alloc: &CountingAllocator,
    config: &MoeLayerConfig,
    weights: Option<&TensorMap>,
    tokens: Option<TokenSource<'_>>,
    tokens_per_rank: usize,
    n_ranks: usize,
    warm_up: bool,
    device: &B::Device,
) -> Result<MemoryMeasurement>
where
    B: AutodiffBackend + MoeBackend,
{
    // Each rank on a pool of its own whose every thread carries the rank's tag: work the
    // layer hands to the pool (Flex's GEMMs, its experts side by side) counts against the
    // rank, and what the pool's threads keep between calls (gemm's packing buffers) is
    // allocated in the warm-up, under the tag of the rank that uses it.
    let ranks = LocalGroup::run_with(GroupOptions::pool_per_rank(n_ranks), n_ranks, |ctx| {
        rayon::broadcast(|_| CountingAllocator::tag_thread(Some(ctx.rank)));
        let layer = match weights {
            Some(w) => {
                MoeLayer::<B>::from_tensor_map(config, w, "weights".as_ref(), device, ctx.comm.clone())?
            }
            None => config.init_rank::<B>(device, ctx.comm.clone())?,
        };
        let m = config.d_model;
        let data = |name: &str| {
            let values = HostInit::new(config.seed, name, ctx.rank).uniform(tokens_per_rank * m, 1.0);
            TensorData::new(values, [tokens_per_rank, m]).convert::<B::FloatElem>()
        };
        let x = match tokens {
            Some(source) => TensorData::new(source(ctx.rank), [tokens_per_rank, m]).convert::<B::FloatElem>(),
            None => data("x"),
        };
        let x = Tensor::<B, 2>::from_data(x, device).require_grad();
        let probe = Tensor::<B, 2>::from_data(data("probe"), device);
        let pass = || -> Result<MoeStats> {
            let out = layer.try_forward(x.clone())?;
            let grads = (out.output * probe.clone()).sum().backward();
            drop(grads);
            Ok(out.stats)
        };
        if warm_up {
            pass()?;
        }
        ctx.comm.barrier()?;
        layer.context().meter().reset_peak();
        // Each rank's base and peak restart at the same instant: a block of this rank freed
        // by a peer in between would otherwise count as part of the pass.
        let base = alloc.reset_rank_peak(ctx.rank);
        let stats = pass()?;
        ctx.comm.barrier()?;
        let peak = alloc.rank_peak(ctx.rank).saturating_sub(base);
        let host = layer.context().meter().report().host_peak_bytes;
        ctx.comm.barrier()?;
        rayon::broadcast(|_| CountingAllocator::tag_thread(None));
        let recv_rows = stats.recv_rows;
        Ok(RankMemory {
            peak_device_bytes: peak,
            host_bytes: host,
            recv_rows,
            stats,
        })
    })?;
    Ok(MemoryMeasurement {
        peak_device_bytes: ranks.iter().map(|r| r.peak_device_bytes).max().unwrap_or(0),
        host_bytes: ranks.iter().map(|r| r.host_bytes).max().unwrap_or(0),
        ranks,
    })
}
