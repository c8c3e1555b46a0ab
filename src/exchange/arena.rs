//! The partition arena: one device buffer per partition slot (`T_DI` ×2 where received rows
//! are permuted, `T_M`, `T_DO` ×2, which backward's `dT_DO` reuses, and `dT_DI` ×2; see
//! [`buffer_of`]), reused by every
//! partition, layer and step that the arena is handed to, instead of a fresh allocation for
//! each partition.
//!
//! The fused exchange asks its backend for the arena's buffers through [`SlotMemory`]; the
//! CubeCL backends have one (their GEMMs write `T_M`, `T_DO` and `dT_DI` straight into it, and
//! the received rows are copied into `T_DI` and `dT_DO` in expert-major order by one kernel);
//! the CPU backends have none and assemble each partition from fresh tensors, whose memory
//! their allocators already recycle.
//!
//! A buffer is reused only while nothing outside the arena still holds it: a strategy that
//! keeps `T_DI` and `T_M` for backward (none) takes the buffers with it, and the arena
//! allocates the slots again. And only the thread that last used a buffer gets it again (a
//! thread is a stream on CubeCL, and the device orders work only within a stream). So the
//! arena never aliases live data, and it holds at most one buffer per slot, sized for the
//! largest partition it has seen (it grows, never shrinks, and never allocates per partition
//! while the strategy reuses the slot).

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::sync::lock;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::schedule::Slot;
use crate::error::Result;

/// The partition arena of one layer (or of several layers that share it): the backends'
/// per-device buffers behind one handle, and their accounting.
///
/// Cloning shares the arena. Layers that run one after another may share one (each pass
/// empties every slot before it ends, so they never need a slot at the same time):
/// `layer_b.context_mut().set_partition_arena(layer_a.context().partition_arena())`.
#[derive(Clone, Default)]
pub struct PartitionArena {
    inner: Arc<ArenaInner>,
}

#[derive(Default)]
struct ArenaInner {
    /// One entry per backend type, device and dtype, created on first use.
    entries: Mutex<Vec<(String, Arc<dyn Any + Send + Sync>)>>,
    counters: Arc<ArenaCounters>,
}

/// What the arena holds and has done, shared by its entries: a backend's [`SlotMemory`]
/// reports each allocation and reuse here, and [`PartitionArena::stats`] reads it.
#[derive(Debug, Default)]
pub struct ArenaCounters {
    reserved: AtomicU64,
    allocations: AtomicU64,
    reuses: AtomicU64,
}

impl ArenaCounters {
    /// A buffer of `bytes` was allocated, replacing one of `replaced` bytes (0 if none).
    pub fn allocated(&self, bytes: u64, replaced: u64) {
        self.allocations.fetch_add(1, Ordering::Relaxed);
        self.reserved.fetch_add(bytes, Ordering::Relaxed);
        self.reserved.fetch_sub(replaced, Ordering::Relaxed);
    }

    /// A slot's buffer was handed out again.
    pub fn reused(&self) {
        self.reuses.fetch_add(1, Ordering::Relaxed);
    }
}

/// A reading of an arena's accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ArenaStats {
    /// Device bytes the arena's buffers hold now.
    pub reserved_bytes: u64,
    /// Buffers allocated since the arena was made (first use of a slot, growth, or a slot
    /// whose buffer a strategy kept for backward).
    pub allocations: u64,
    /// Times a slot's buffer was handed out again instead.
    pub reuses: u64,
}

impl PartitionArena {
    /// An empty arena.
    pub fn new() -> Self {
        Self::default()
    }

    /// The arena's accounting now.
    pub fn stats(&self) -> ArenaStats {
        let c = &self.inner.counters;
        ArenaStats {
            reserved_bytes: c.reserved.load(Ordering::Relaxed),
            allocations: c.allocations.load(Ordering::Relaxed),
            reuses: c.reuses.load(Ordering::Relaxed),
        }
    }

    /// The entry under `key` (a backend, device and dtype), made by `make` on first use
    /// with the arena's counters: where a backend keeps its [`SlotMemory`] for one device.
    pub fn entry<T: Any + Send + Sync>(
        &self,
        key: String,
        make: impl FnOnce(Arc<ArenaCounters>) -> T,
    ) -> Arc<T> {
        let mut entries = lock(&self.inner.entries);
        if let Some(found) = entries
            .iter()
            .find(|(k, _)| *k == key)
            .and_then(|(_, e)| e.clone().downcast::<T>().ok())
        {
            return found;
        }
        let made = Arc::new(make(self.inner.counters.clone()));
        entries.push((key, made.clone()));
        made
    }
}

impl fmt::Debug for PartitionArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PartitionArena")
            .field("stats", &self.stats())
            .finish()
    }
}

/// The arena buffer that holds `slot`'s partitions.
///
/// As in the paper (§III-C: one buffer for `T_M`, two each for `T_DI` and `T_DO`), with the
/// backward reusing the forward's: `dT_DO` lives in `T_DO`'s buffers and a restored `T_DI`
/// in `T_DI`'s (a layer's backward never runs during its forward, and each pass empties its
/// slots before it ends), and `T_M` has one buffer because the arena serves runs in issue
/// order, where partition `i`'s `T_M` is offloaded or dropped before partition `i + 1`
/// computes. Only `dT_DI` needs buffers of its own: `C'_i` reads `T_DI_i` and `dT_DO_i` while
/// it writes `dT_DI_i`.
pub fn buffer_of(slot: Slot) -> Slot {
    use super::schedule::Role;
    match slot.role {
        Role::GradOutput => Slot {
            role: Role::Output,
            index: slot.index,
        },
        Role::Hidden => Slot {
            role: Role::Hidden,
            index: 0,
        },
        _ => slot,
    }
}

/// A backend's access to the partition arena's buffers on one device, for the fused
/// exchange.
///
/// A slot's buffer holds a partition's rows expert by expert, each expert's block starting
/// at a multiple of [`row_align`](SlotMemory::row_align) rows so that the block is a view of
/// the buffer a kernel can be bound to (see `BlockLayout` in `exchange/blocks.rs`).
pub trait SlotMemory<B: Backend>: Send + Sync {
    /// The row multiple at which a block of `width` columns may start.
    fn row_align(&self, width: usize) -> usize;

    /// The buffer of `slot`, as a `[rows, width]` tensor: reused when nothing else holds it
    /// and it is large enough, allocated otherwise. Its content is undefined.
    ///
    /// # Errors
    /// [`MoeError::Memory`](crate::MoeError::Memory) if the size overflows.
    fn buffer(&self, slot: Slot, rows: usize, width: usize) -> Result<FloatTensor<B>>;

    /// Rows `start..start + len` of `buffer` as a view (`start` a multiple of the row
    /// alignment, `start + len` within the buffer).
    fn rows(&self, buffer: &FloatTensor<B>, start: usize, len: usize) -> FloatTensor<B>;

    /// `out = lhs · rhs (+ bias)`, written into `out` (a view from [`rows`](SlotMemory::rows)).
    ///
    /// # Shapes
    /// - lhs `[m, k]`, rhs `[k, n]`, bias `[1, n]`, out `[m, n]`
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the backend cannot launch the GEMM.
    fn gemm_into(
        &self,
        out: &FloatTensor<B>,
        lhs: FloatTensor<B>,
        rhs: FloatTensor<B>,
        bias: Option<FloatTensor<B>>,
    ) -> Result<()>;

    /// `out += addend`, in place: a low-rank adapter's term added to the block a GEMM wrote.
    ///
    /// # Shapes
    /// - out `[m, n]`, addend `[m, n]`
    fn add_into(&self, out: &FloatTensor<B>, addend: FloatTensor<B>);

    /// `dst[dst_rows[k]] = src[src_rows[k]]` for every `k`.
    ///
    /// # Shapes
    /// - src `[n_src, width]`, dst `[n_dst, width]`, `src_rows` and `dst_rows` of equal length
    fn copy_rows(&self, dst: &FloatTensor<B>, dst_rows: &[usize], src: FloatTensor<B>, src_rows: &[usize]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counters_track_what_the_arena_holds() {
        let arena = PartitionArena::new();
        let a = arena.entry("b/d/f32".into(), |c| c);
        let again = arena.entry("b/d/f32".into(), |_| unreachable!("made once"));
        assert!(Arc::ptr_eq(&a, &again));
        a.allocated(100, 0);
        a.allocated(300, 100);
        a.reused();
        assert_eq!(
            arena.stats(),
            ArenaStats {
                reserved_bytes: 300,
                allocations: 2,
                reuses: 1
            }
        );
    }
}
