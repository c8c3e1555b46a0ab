//! A counting global allocator, for measuring peak memory on the CPU, per rank.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Tags a thread can carry: 0 is "untagged", 1..=64 are ranks 0..=63.
const TAGS: usize = 65;

/// Bytes in front of every block: the allocating thread's tag. 16 keeps `malloc`'s alignment.
const HEADER: usize = 16;

thread_local! {
    static TAG: Cell<u8> = const { Cell::new(0) };
}

/// Wraps the system allocator and counts live bytes and their peak, in total and per tag.
///
/// A thread can tag itself ([`CountingAllocator::tag_thread`]); every block it allocates
/// carries the tag in a small header, so the free is counted against the thread that
/// allocated, whichever thread frees it (with ranks as threads, the exchange's payloads are
/// allocated by the sender and freed by the receiver). That gives each rank its own exact
/// peak instead of a share of the process's.
///
/// The library never installs it; a binary that measures memory does:
///
/// ```
/// #[global_allocator]
/// static ALLOC: mpipemoe::harness::CountingAllocator = mpipemoe::harness::CountingAllocator::new();
///
/// fn main() {
///     let before = ALLOC.reset_peak();
///     let block = vec![1u8; 1 << 20];
///     assert!(ALLOC.peak() >= before + (1 << 20));
///     drop(block);
/// }
/// ```
#[derive(Debug)]
pub struct CountingAllocator {
    current: [AtomicUsize; TAGS],
    peak: [AtomicUsize; TAGS],
    total: AtomicUsize,
    total_peak: AtomicUsize,
}

impl CountingAllocator {
    /// A counter at zero.
    pub const fn new() -> Self {
        Self {
            current: [const { AtomicUsize::new(0) }; TAGS],
            peak: [const { AtomicUsize::new(0) }; TAGS],
            total: AtomicUsize::new(0),
            total_peak: AtomicUsize::new(0),
        }
    }

    /// Tags the calling thread's future allocations with `rank` (0..=63); `None` untags it.
    pub fn tag_thread(rank: Option<usize>) {
        let tag = rank.map_or(0, |r| (r.min(TAGS - 2) + 1) as u8);
        TAG.with(|t| t.set(tag));
    }

    /// The calling thread's tag, for a helper thread to take over with
    /// [`set_thread_tag`](Self::set_thread_tag): the exchange's stream workers count against
    /// the rank that started them.
    pub fn thread_tag() -> u8 {
        TAG.try_with(|t| t.get()).unwrap_or(0)
    }

    /// Sets the calling thread's tag to one read by [`thread_tag`](Self::thread_tag).
    pub fn set_thread_tag(tag: u8) {
        let _ = TAG.try_with(|t| t.set(tag));
    }

    /// Bytes allocated and not yet freed, over all threads.
    pub fn current(&self) -> usize {
        self.total.load(Ordering::SeqCst)
    }

    /// The most bytes live at once since the last [`reset_peak`](Self::reset_peak).
    pub fn peak(&self) -> usize {
        self.total_peak.load(Ordering::SeqCst)
    }

    /// Live bytes allocated by threads tagged with `rank`.
    pub fn rank_current(&self, rank: usize) -> usize {
        self.current[rank.min(TAGS - 2) + 1].load(Ordering::SeqCst)
    }

    /// Peak of [`rank_current`](Self::rank_current) since the last reset.
    pub fn rank_peak(&self, rank: usize) -> usize {
        self.peak[rank.min(TAGS - 2) + 1].load(Ordering::SeqCst)
    }

    /// Restarts `rank`'s peak from its current level and returns that level: the base of a
    /// measurement of that rank, read and reset at the same instant.
    pub fn reset_rank_peak(&self, rank: usize) -> usize {
        let tag = rank.min(TAGS - 2) + 1;
        let now = self.current[tag].load(Ordering::SeqCst);
        self.peak[tag].store(now, Ordering::SeqCst);
        now
    }

    /// Restarts every peak from the current level and returns the total current level.
    pub fn reset_peak(&self) -> usize {
        for (c, p) in self.current.iter().zip(&self.peak) {
            p.store(c.load(Ordering::SeqCst), Ordering::SeqCst);
        }
        let now = self.current();
        self.total_peak.store(now, Ordering::SeqCst);
        now
    }

    fn grow(&self, tag: usize, bytes: usize) {
        let now = self.current[tag].fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.peak[tag].fetch_max(now, Ordering::SeqCst);
        let total = self.total.fetch_add(bytes, Ordering::SeqCst) + bytes;
        self.total_peak.fetch_max(total, Ordering::SeqCst);
    }

    fn shrink(&self, tag: usize, bytes: usize) {
        self.current[tag].fetch_sub(bytes, Ordering::SeqCst);
        self.total.fetch_sub(bytes, Ordering::SeqCst);
    }

    /// The layout of the whole block (header + user bytes) and the user offset within it.
    fn outer(layout: Layout) -> (Layout, usize) {
        let offset = HEADER.max(layout.align());
        let outer = Layout::from_size_align(layout.size() + offset, layout.align().max(HEADER))
            .expect("layout with a header stays valid");
        (outer, offset)
    }
}

impl Default for CountingAllocator {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every block is a system allocation of `outer(layout)`; the caller gets the address
// `offset` bytes in, which keeps the requested alignment (`offset` is a multiple of it) and
// leaves at least HEADER bytes in front for the tag. `dealloc` recomputes the same layout and
// offset from the caller's layout, as the GlobalAlloc contract guarantees it is the same one.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let (outer, offset) = Self::outer(layout);
        let base = unsafe { System.alloc(outer) };
        if base.is_null() {
            return base;
        }
        // Thread teardown may have destroyed the thread-local already: count as untagged.
        let tag = TAG.try_with(|t| t.get()).unwrap_or(0);
        unsafe {
            base.write(tag);
            self.grow(tag as usize, layout.size());
            base.add(offset)
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { self.alloc(layout) };
        if !ptr.is_null() {
            unsafe { ptr.write_bytes(0, layout.size()) };
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let (outer, offset) = Self::outer(layout);
        unsafe {
            let base = ptr.sub(offset);
            let tag = base.read() as usize;
            self.shrink(tag, layout.size());
            System.dealloc(base, outer);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}
