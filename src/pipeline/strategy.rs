//! Which activations survive the forward pass, and how the rest come back in backward.

use serde::{Deserialize, Serialize};

/// How a partition's activation is made available again in the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Restore {
    /// Kept on the device from forward to backward (no reuse).
    Keep,
    /// Copied to the host store in forward, copied back in backward.
    Offload,
    /// `T_DI` only: dispatched again from `T_I` by a second all-to-all.
    Recommunicate,
    /// `T_M` only: recomputed from `T_DI` with the first expert GEMM.
    Recompute,
}

/// A resolved memory-reuse strategy (the paper's Table III).
///
/// With any strategy other than [`Strategy::None`], a partition's `T_DI`, `T_M` and `T_DO`
/// are released once the partition's last step has read them, so at most two partitions' worth
/// (the schedule's slots) are alive at a time; the strategy says how the released `T_DI` and
/// `T_M` are restored for backward. On the CPU each partition's buffer is a tensor of its own,
/// and the allocator reuses the memory a released partition frees; one device arena per role
/// with partitions at offsets is the CUDA crate's work (not written yet). Every strategy
/// computes the same gradients as [`Strategy::None`] up to float rounding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Strategy {
    /// PipeMoE: every partition's `T_DI` and `T_M` are kept until backward.
    None,
    /// Offload `T_DI` and `T_M` to the host, prefetch them in backward.
    S1,
    /// Re-communicate `T_DI` from `T_I`; offload `T_M`.
    S2,
    /// Offload `T_DI`; recompute `T_M` from it.
    S3,
    /// Re-communicate `T_DI`; recompute `T_M`.
    S4,
}

impl Strategy {
    /// Every strategy, in the paper's order.
    pub const ALL: [Strategy; 5] = [
        Strategy::None,
        Strategy::S1,
        Strategy::S2,
        Strategy::S3,
        Strategy::S4,
    ];

    /// How the dispatched tokens `T_DI` come back in backward.
    pub fn dispatched(self) -> Restore {
        match self {
            Strategy::None => Restore::Keep,
            Strategy::S1 | Strategy::S3 => Restore::Offload,
            Strategy::S2 | Strategy::S4 => Restore::Recommunicate,
        }
    }

    /// How the hidden activation `T_M` comes back in backward.
    pub fn hidden(self) -> Restore {
        match self {
            Strategy::None => Restore::Keep,
            Strategy::S1 | Strategy::S2 => Restore::Offload,
            Strategy::S3 | Strategy::S4 => Restore::Recompute,
        }
    }

    /// Whether the op must keep its input `T_I` to dispatch it again in backward.
    pub fn keeps_input(self) -> bool {
        self.dispatched() == Restore::Recommunicate
    }

    /// Whether partition buffers are reused (everything but [`Strategy::None`]).
    pub fn reuses_buffers(self) -> bool {
        self != Strategy::None
    }

    /// Lower-case name as used on the command line (`none`, `s1`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Strategy::None => "none",
            Strategy::S1 => "s1",
            Strategy::S2 => "s2",
            Strategy::S3 => "s3",
            Strategy::S4 => "s4",
        }
    }

    /// Parses a command-line name (`none`, `s1`..`s4`, case-insensitive).
    pub fn parse(name: &str) -> Option<Strategy> {
        Strategy::ALL
            .into_iter()
            .find(|s| s.name().eq_ignore_ascii_case(name))
    }
}

impl std::fmt::Display for Strategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The layer's memory-reuse setting (`MoeLayerConfig::memory_reuse`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[non_exhaustive]
pub enum MemoryReuse {
    /// No reuse: the PipeMoE behaviour (and, with one partition, the FastMoE baseline).
    #[default]
    Off,
    /// Offload `T_DI` and `T_M`.
    S1,
    /// Re-communicate `T_DI`, offload `T_M`.
    S2,
    /// Offload `T_DI`, recompute `T_M`.
    S3,
    /// Re-communicate `T_DI`, recompute `T_M`.
    S4,
    /// The cheapest strategy by the cost model (Eq. 13) that fits `memory_budget`, from the
    /// layer's hardware profile.
    Auto,
}

impl MemoryReuse {
    /// The fixed strategy this setting names; `None` for [`MemoryReuse::Auto`].
    pub fn fixed(self) -> Option<Strategy> {
        match self {
            MemoryReuse::Off => Some(Strategy::None),
            MemoryReuse::S1 => Some(Strategy::S1),
            MemoryReuse::S2 => Some(Strategy::S2),
            MemoryReuse::S3 => Some(Strategy::S3),
            MemoryReuse::S4 => Some(Strategy::S4),
            MemoryReuse::Auto => None,
        }
    }
}

impl From<Strategy> for MemoryReuse {
    fn from(s: Strategy) -> Self {
        match s {
            Strategy::None => MemoryReuse::Off,
            Strategy::S1 => MemoryReuse::S1,
            Strategy::S2 => MemoryReuse::S2,
            Strategy::S3 => MemoryReuse::S3,
            Strategy::S4 => MemoryReuse::S4,
        }
    }
}
