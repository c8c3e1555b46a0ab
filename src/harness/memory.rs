//! Measuring the peak memory of one forward + backward pass of the layer: on the CPU with the
//! process's counting allocator, on the CubeCL backends from the device allocator
//! (`harness/device_memory.rs`), both through [`PeakMeter`].

use std::sync::Arc;

use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use serde::Serialize;

use crate::comm::GroupOptions;
use crate::error::Result;
use crate::experts::HostInit;
use crate::layer::{MoeLayer, MoeStats, TensorMap};
use crate::memory::alloc::CountingAllocator;
use crate::{Communicator, LocalGroup, MoeBackend, MoeLayerConfig};

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
    /// Device bytes the layer's partition arena held after the pass: buffers the pass
    /// allocated and the arena keeps for the next (0 on the backends without an arena, the
    /// CPU backends).
    pub arena_bytes: u64,
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

/// Where a measurement reads each rank's bytes: the counting allocator on the CPU, the device
/// allocator on the CubeCL backends
/// ([`DeviceMemoryMeter`](super::DeviceMemoryMeter)).
pub trait PeakMeter: Sync {
    /// Called on each rank's thread with `Some(rank)` before the rank builds its layer, and
    /// with `None` when it is done: where the meter counts per thread, it tags the rank's
    /// threads here. The default does nothing.
    fn tag(&self, rank: Option<usize>) {
        let _ = rank;
    }

    /// Starts `rank`'s count now, on the rank's thread, with every rank idle; returns the
    /// bytes the rank holds now.
    fn start(&self, rank: usize) -> usize;

    /// The most bytes `rank` held at once since [`start`](Self::start), read on the rank's
    /// thread after its pass, with every rank idle.
    fn peak(&self, rank: usize) -> usize;

    /// Whether what each thread of the rank's pool allocates counts against the rank (the
    /// counting allocator): the warm-up then has every thread of the pool make what it keeps
    /// between calls. The default: no.
    fn counts_pool_threads(&self) -> bool {
        false
    }
}

impl PeakMeter for CountingAllocator {
    /// Tags the rank's thread and every thread of its pool: work the layer hands to the pool
    /// (Flex's GEMMs, its experts side by side) counts against the rank.
    fn tag(&self, rank: Option<usize>) {
        rayon::broadcast(|_| CountingAllocator::tag_thread(rank));
    }

    fn start(&self, rank: usize) -> usize {
        self.reset_rank_peak(rank)
    }

    fn peak(&self, rank: usize) -> usize {
        self.rank_peak(rank)
    }

    fn counts_pool_threads(&self) -> bool {
        true
    }
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
    measure_layer_peak::<B>(
        alloc,
        config,
        weights,
        tokens,
        tokens_per_rank,
        n_ranks,
        warm_up,
        device,
        &|comm| comm,
    )
}

/// One product large enough for gemm to pack its operands, on the calling thread.
fn warm_thread<B: Backend>(device: &B::Device) {
    let a = Tensor::<B, 2>::ones([256, 256], device);
    let _ = a.clone().matmul(a).into_data();
}

/// A rank's communicator passed through a wrapper first (e.g. one that adds a device library's
/// expert path, `mpipemoe_cuda::with_cublas`).
pub type WrapComm<'a> = &'a (dyn Fn(Arc<dyn Communicator>) -> Arc<dyn Communicator> + Sync);

/// [`measure_layer_memory_with`] with the bytes read from `meter`: the same pass, on any
/// backend whose memory a [`PeakMeter`] reads, each rank's communicator passed through `wrap`.
///
/// The measured pass builds its partition buffers afresh (the layer gets a new
/// [`PartitionArena`](crate::backend::PartitionArena) after the warm-up), so on the backends
/// that keep them between passes (the CubeCL backends) they count in the pass, as the memory
/// model counts them, and as the CPU backends, which build them fresh each pass, count them.
#[allow(clippy::too_many_arguments)]
pub fn measure_layer_peak<B>(
    meter: &dyn PeakMeter,
    config: &MoeLayerConfig,
    weights: Option<&TensorMap>,
    tokens: Option<TokenSource<'_>>,
    tokens_per_rank: usize,
    n_ranks: usize,
    warm_up: bool,
    device: &B::Device,
    wrap: WrapComm<'_>,
) -> Result<MemoryMeasurement>
where
    B: AutodiffBackend + MoeBackend,
{
    // Each rank on a pool of its own whose every thread carries the rank's tag (for a meter
    // that counts per thread): what the pool's threads keep between calls (gemm's packing
    // buffers) is allocated in the warm-up, under the tag of the rank that uses it.
    let ranks = LocalGroup::run_with(GroupOptions::pool_per_rank(n_ranks), n_ranks, |ctx| {
        meter.tag(Some(ctx.rank));
        let comm = wrap(ctx.comm.clone());
        let mut layer = match weights {
            Some(w) => MoeLayer::<B>::from_tensor_map(config, w, "weights".as_ref(), device, comm)?,
            None => config.init_rank::<B>(device, comm)?,
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
        let pass = |layer: &MoeLayer<B>| -> Result<MoeStats> {
            let out = layer.try_forward(x.clone())?;
            let grads = (out.output * probe.clone()).sum().backward();
            drop(grads);
            Ok(out.stats)
        };
        if warm_up {
            // What each thread of the rank's pool allocates once and keeps (gemm's packing
            // slab, a thread-local the size of the L2 cache, gemm-common 0.19 `gemm.rs`
            // `L2_SLAB`) is made on every thread here: the warm-up pass may leave a thread
            // that takes no product in it, and that thread's first product in the measured
            // pass would count its slab as the layer's.
            if meter.counts_pool_threads() {
                rayon::broadcast(|_| warm_thread::<B>(device));
            }
            pass(&layer)?;
        }
        let arena = crate::backend::PartitionArena::new();
        layer.set_partition_arena(arena.clone());
        ctx.comm.barrier()?;
        layer.context().meter().reset_peak();
        // Each rank's base and peak restart at the same instant: a block of this rank freed
        // by a peer in between would otherwise count as part of the pass.
        let base = meter.start(ctx.rank);
        let stats = pass(&layer)?;
        ctx.comm.barrier()?;
        let peak = meter.peak(ctx.rank).saturating_sub(base);
        let host = layer.context().meter().report().host_peak_bytes;
        ctx.comm.barrier()?;
        meter.tag(None);
        let recv_rows = stats.recv_rows;
        Ok(RankMemory {
            peak_device_bytes: peak,
            host_bytes: host,
            recv_rows,
            arena_bytes: arena.stats().reserved_bytes,
            stats,
        })
    })?;
    Ok(MemoryMeasurement {
        peak_device_bytes: ranks.iter().map(|r| r.peak_device_bytes).max().unwrap_or(0),
        host_bytes: ranks.iter().map(|r| r.host_bytes).max().unwrap_or(0),
        ranks,
    })
}
