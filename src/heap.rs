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
//! reuses the pages of the first; and it serves blocks up to 160 bytes from glibc's fast bins
//! (the small vectors every tensor op allocates). The cost is resident memory: what a step
//! freed stays mapped (the layer's own peak, which the memory model and the counting allocator
//! measure, is unchanged).
//!
//! The library never makes the setting itself: it changes every allocation of the process, so
//! it is the program's to choose, first thing in `main` (this repository's binaries and
//! examples do). A comparison with another framework is fair only with the same setting on
//! both sides: glibc takes the same values from the environment,
//! `GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615:glibc.malloc.top_pad=67108864:glibc.malloc.arena_max=1:glibc.malloc.mxfast=160`
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
        // these; changing them while other threads allocate is allowed (glibc takes its
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
                // Blocks up to 160 bytes (glibc's most; the default is 128) from the fast
                // bins, which reuse a freed block without merging it with its neighbours: the
                // shapes, strides and index vectors every tensor op allocates and frees. A
                // decode step is thousands of such ops; with the default their merging and
                // unlinking was 2.1–2.5% of its samples, 1.4–1.6% with this (BENCHMARKS §13m).
                && libc::mallopt(libc::M_MXFAST, 160) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// The most bytes of `/proc/self/maps` [`reserve_huge_pages`] reads: a process with ranks on
/// threads has a few hundred mappings, each line under 200 bytes.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MAPS_BYTES: u64 = 1 << 20;

/// The main heap's mapping, `(start, bytes)`, as `/proc/self/maps` lists it.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn heap_mapping() -> Option<(usize, usize)> {
    use std::io::Read;
    let mut maps = String::new();
    std::fs::File::open("/proc/self/maps")
        .ok()?
        .take(MAPS_BYTES)
        .read_to_string(&mut maps)
        .ok()?;
    let line = maps.lines().find(|l| l.ends_with("[heap]"))?;
    let (start, end) = line.split_whitespace().next()?.split_once('-')?;
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    Some((start, end.checked_sub(start)?))
}

/// Grows the main heap to at least `bytes` without touching its pages, and asks the kernel to
/// back it with transparent huge pages (`MADV_HUGEPAGE`: 2 MiB pages on x86-64), so that what
/// the program allocates there next — a model's weights, loaded right after — is faulted in on
/// huge pages. Returns the heap's bytes under the advice, or `None` where the heap could not be
/// grown to `bytes` or the kernel refused the advice (off Linux or glibc, THP compiled out or
/// set to `never`, or without [`keep_freed_memory`], under which glibc maps large blocks
/// outside the heap).
///
/// A decode step reads its ~100 MB of weights anew at every token; on 4 KiB pages each step
/// walks ~25,000 page translations. On this project's VM a synthetic decode step over the
/// same bytes, alternating token by token between two copies of the weights in one process,
/// took 2.86 ms on huge pages against 3.02 ms on 4 KiB ones (BENCHMARKS §13m). The values are
/// the same; the reservation is address space, pages never touched are never backed; what the
/// hint can cost is the kernel compacting memory to find huge pages while the weights load
/// (`/sys/kernel/mm/transparent_hugepage/defrag`). Call it once, before the allocations it is
/// for, from the main thread or one started after [`keep_freed_memory`] (a thread that
/// allocated before the setting has an arena of its own, outside the heap).
pub fn reserve_huge_pages(bytes: usize) -> Option<usize> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let (_, before) = heap_mapping().unwrap_or((0, 0));
        if before < bytes {
            // SAFETY: a malloc and a free of one block that is never read or written. Under
            // `keep_freed_memory` glibc takes it from the heap's top by `brk`, and the block,
            // freed at the top with trimming off, leaves the heap its size. `black_box` keeps
            // the compiler from dropping a pair whose block nothing uses.
            unsafe { libc::free(std::hint::black_box(libc::malloc(bytes - before))) };
        }
        let (start, len) = heap_mapping()?;
        if len < bytes {
            return None;
        }
        // SAFETY: advice about a range the process has mapped (the heap, as the kernel lists
        // it); it changes neither the range's contents nor its mapping.
        match unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) } {
            0 => Some(len),
            _ => None,
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = bytes;
        None
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::{heap_mapping, keep_freed_memory, reserve_huge_pages};

    /// The kernel's THP setting, where it has one (`[madvise]`, `[always]` or `[never]`).
    fn thp_setting() -> Option<String> {
        let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
        let start = text.find('[')?;
        let end = text[start..].find(']')?;
        Some(text[start + 1..start + end].to_string())
    }

    /// The kernel's flags on the heap's mapping (`VmFlags` in `/proc/self/smaps`).
    fn heap_flags() -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut in_heap = false;
        for line in smaps.lines() {
            if line.contains("[heap]") {
                in_heap = true;
            } else if in_heap && line.starts_with("VmFlags:") {
                return line.to_string();
            }
        }
        String::new()
    }

    /// Under the kept heap, the heap grows to the bytes asked for and the kernel holds the
    /// advice on it (`hg` among the mapping's flags). Refused, the call is honest about why:
    /// the kernel has no THP, or the block came from outside the heap — in a test binary every
    /// test thread has allocated before the setting, so glibc may hand a new thread one of
    /// their arenas instead of the main one (`arena_get2` reuses arenas once there are as many
    /// as `arena_max`); the binaries call it from the main thread.
    #[test]
    fn the_heap_grows_and_carries_the_huge_page_advice() {
        assert!(keep_freed_memory());
        let bytes = 256 << 20;
        let got = std::thread::spawn(move || reserve_huge_pages(bytes))
            .join()
            .unwrap();
        match got {
            Some(len) => {
                assert!(len >= bytes, "{len} bytes reserved of {bytes}");
                assert_eq!(heap_mapping().map(|(_, l)| l >= bytes), Some(true));
                assert!(
                    heap_flags().split_whitespace().any(|f| f == "hg"),
                    "{}",
                    heap_flags()
                );
            }
            None => assert!(
                matches!(thp_setting().as_deref(), None | Some("never"))
                    || heap_mapping().is_none_or(|(_, len)| len < bytes),
                "refused with THP {:?} and a heap of {:?}",
                thp_setting(),
                heap_mapping()
            ),
        }
    }
}
