//! The heap setting of the binaries that train, as a flag: freed memory stays in the process
//! for the next step ([`mpipemoe::heap`], the library's documented opt-in) or glibc's defaults.

pub use mpipemoe::heap::keep_freed_memory;

/// The `--heap` flag of the binaries that train, so that a benchmark can compare both.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Heap {
    /// Keep freed memory in the process for the next step (`mpipemoe::heap::keep_freed_memory`).
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

/// The memory the machine can give the process now without swapping, bytes: Linux's
/// `MemAvailable` (`/proc/meminfo`, read no further than its first 64 KiB). `None` where it is
/// not known (another system, a kernel without the field).
pub fn available_host_bytes() -> Option<u64> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open("/proc/meminfo")
        .ok()?
        .take(64 << 10)
        .read_to_string(&mut text)
        .ok()?;
    mem_available(&text)
}

/// `MemAvailable` of a `/proc/meminfo` text, bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut fields = line["MemAvailable:".len()..].split_whitespace();
    let value: u64 = fields.next()?.parse().ok()?;
    match fields.next() {
        Some("kB") => value.checked_mul(1024),
        _ => None,
    }
}

#[cfg(test)]
mod meminfo_tests {
    use super::mem_available;

    #[test]
    fn mem_available_reads_the_field_in_bytes_or_nothing() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20971520 kB\n";
        assert_eq!(mem_available(text), Some(20 << 30));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(mem_available("MemAvailable: lots kB\n"), None);
        assert_eq!(mem_available("MemAvailable: 5 MB\n"), None);
        assert_eq!(mem_available("MemAvailable: 18446744073709551615 kB\n"), None);
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
        // `black_box`: an optimised build may otherwise drop an allocation nothing reads.
        let block = std::hint::black_box(vec![1u8; size]);
        assert!(
            mapped_bytes() >= before + size,
            "glibc's default did not map the block: {} → {}",
            before,
            mapped_bytes()
        );
        drop(block);
        assert!(keep_freed_memory(), "glibc refused the setting");
        let before = mapped_bytes();
        let block = std::hint::black_box(vec![1u8; size]);
        let address = block.as_ptr() as usize;
        assert_eq!(mapped_bytes(), before, "the block was still mapped on its own");
        drop(block);
        let again = std::hint::black_box(vec![2u8; size]);
        assert_eq!(again.as_ptr() as usize, address, "the freed block was not reused");
    }
}
