//! An opt-in, process-wide heap setting for programs that train: freed memory stays in the
//! process for the next step instead of going back to the kernel.
//!
//! glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh `mmap`
//! and returns it with `munmap` when it is freed. A training step allocates the same large
//! tensors every step — one `[4096, 3072]` f32 hidden tensor is 48 MiB — so every step the
//! kernel maps, zeroes and faults in each of them anew (`exc_page_fault` and `clear_page` in a
//! profile). [`keep_freed_memory`] turns glibc's mmap path off, so large blocks come from the
//! heap too, stops it trimming the heap's top, and gives every thread the one main heap (a
//! thread's own arena maps large blocks whatever the mmap setting says), so the second step
//! reuses the pages of the first. The cost is resident memory: what a step freed stays mapped (the layer's own peak,
//! which the memory model and the counting allocator measure, is unchanged).
//!
//! The library never makes the setting itself: it changes every allocation of the process, so
//! it is the program's to choose, first thing in `main` (this repository's binaries and
//! examples do). A comparison with another framework is fair only with the same setting on
//! both sides: glibc takes the same three values from the environment,
//! `GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615:glibc.malloc.top_pad=67108864:glibc.malloc.arena_max=1`
//! (what `scripts/bench/models_peer.py` gives the PyTorch process). Off glibc it does nothing.
//!
//! ```
//! // First thing in `main`, before anything large is allocated.
//! let kept = mpipemoe::heap::keep_freed_memory();
//! assert_eq!(kept, cfg!(all(target_os = "linux", target_env = "gnu")));
//! ```

/// glibc's heap grows by this much beyond each request, so that a step's growth takes few
/// `brk` calls.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub const TOP_PAD_BYTES: usize = 64 << 20;

/// Keeps freed memory in the process (see the module docs); returns whether the allocator
/// took the setting (`false` off glibc).
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes glibc's tuning parameters, and any value is valid for
        // these three; changing them while other threads allocate is allowed (glibc takes its
        // arena locks).
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0) == 1
                // -1 turns trimming off altogether (mallopt(3)); `c_int::MAX`, as first
                // written, is only 2 GiB, and a 163 M-parameter model's step frees more than
                // that at once (the optimizer's moments), so the heap was trimmed and faulted
                // in again every step (4.7 M minor faults in 5 steps).
                && libc::mallopt(libc::M_TRIM_THRESHOLD, -1) == 1
                && libc::mallopt(libc::M_TOP_PAD, TOP_PAD_BYTES as libc::c_int) == 1
                // One arena for every thread. A thread's own arena lives in heaps of at most
                // 64 MiB, and glibc serves a larger block there with `mmap` whatever
                // M_MMAP_MAX says (sysmalloc's fallback), unmapping it on free: with ranks
                // on threads, every expert weight and gradient of a large layer was mapped and
                // faulted in afresh each step (strace: a 96 MiB `mmap` per stacked expert
                // tensor, from the rank threads).
                && libc::mallopt(libc::M_ARENA_MAX, 1) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
