//! The heap setting of the binaries that train: freed memory stays in the process for the next
//! step instead of going back to the kernel.
//!
//! glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh `mmap`
//! and returns it with `munmap` when it is freed. A training step allocates the same large
//! tensors every step — one `[4096, 3072]` f32 hidden tensor is 48 MiB — so every step the
//! kernel maps, zeroes and faults in each of them anew (`exc_page_fault` and `clear_page` in a
//! profile). [`keep_freed_memory`] turns glibc's mmap path off, so large blocks come from the
//! heap too, and stops it trimming the heap's top, so the second step reuses the pages of the
//! first. PyTorch's CPU allocator gets a similar effect for large tensors by asking for huge
//! pages. The cost is resident memory: what a step freed stays mapped (the layer's own peak,
//! which the memory model and the counting allocator measure, is unchanged).
//!
//! The setting is process-wide, so the library never makes it; binaries call this first
//! thing in `main`. Off glibc it does nothing.

/// glibc's heap grows by this much beyond each request, so that a step's growth takes few
/// `brk` calls.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TOP_PAD: libc::c_int = 64 << 20;

/// Keeps freed memory in the process (see the module docs); returns whether the allocator
/// took the setting (`false` off glibc).
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes glibc's tuning parameters; it is called before the
        // binaries allocate anything large, and any value is valid for these three.
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX) == 1
                && libc::mallopt(libc::M_TOP_PAD, TOP_PAD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// The `--heap` flag of the binaries that train, so that a benchmark can compare both.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Heap {
    /// Keep freed memory in the process for the next step ([`keep_freed_memory`]).
    #[default]
    Keep,
    /// glibc's defaults: large blocks are mapped and unmapped one by one.
    System,
}

impl Heap {
    /// Applies the setting; call it first thing in `main`. Returns whether the heap keeps
    /// freed memory.
    pub fn apply(self) -> bool {
        match self {
            Heap::Keep => keep_freed_memory(),
            Heap::System => false,
        }
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// Bytes glibc holds in mmapped blocks right now.
    fn mapped_bytes() -> usize {
        // SAFETY: mallinfo2 only reads the allocator's counters.
        unsafe { libc::mallinfo2().hblkhd }
    }

    /// With glibc's defaults a 48 MiB block is mapped on its own; once the setting is made,
    /// the same block comes from the heap and, freed, stays there for the next one.
    #[test]
    fn large_blocks_come_from_the_heap_once_the_setting_is_made() {
        let size = 48 << 20;
        let before = mapped_bytes();
        let block = vec![1u8; size];
        assert!(
            mapped_bytes() >= before + size,
            "glibc's default did not map the block: {} → {}",
            before,
            mapped_bytes()
        );
        drop(block);
        assert!(keep_freed_memory(), "glibc refused the setting");
        let before = mapped_bytes();
        let block = vec![1u8; size];
        let address = block.as_ptr() as usize;
        assert_eq!(mapped_bytes(), before, "the block was still mapped on its own");
        drop(block);
        let again = vec![2u8; size];
        assert_eq!(again.as_ptr() as usize, address, "the freed block was not reused");
    }
}
