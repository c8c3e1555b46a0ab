//! What `examples/gpu_check.rs` runs for each reference case, in order: every single-GPU
//! configuration first, the NCCL ones last and only where an NCCL group could be made, so a
//! machine without NCCL (or whose bootstrap fails) still checks everything else and reports
//! NCCL as skipped. Plain data, so it is tested without a GPU (`tests/check_plan.rs`).

use mpipemoe::memory::Strategy;

/// One check of one case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckRun {
    /// The reference path (plain differentiable tensor ops), f32.
    Reference,
    /// The fused path with the backend's default executor, in f32 (`bf16` false) or bf16.
    Fused {
        /// Partitions.
        n: usize,
        /// Memory strategy.
        strategy: Strategy,
        /// bf16 instead of f32.
        bf16: bool,
    },
    /// The fused path in issue order, which builds every partition in the partition arena.
    InOrderArena {
        /// Partitions.
        n: usize,
        /// Memory strategy.
        strategy: Strategy,
    },
    /// The fused path at two thread ranks on the one GPU (`LocalGroup`, experts sharded), with
    /// or without the hottest expert shadowed on both ranks: the all-to-all of rows and of the
    /// shadow's parameters between two ranks' streams.
    TwoRanks {
        /// Partitions.
        n: usize,
        /// Memory strategy.
        strategy: Strategy,
        /// One expert shadowed (`Shadowing::Fixed(1)`) instead of none.
        shadowed: bool,
    },
    /// The fused path with the rows moved by NCCL on device pointers (a one-rank group whose
    /// all-to-alls are not skipped) and S1–S3 offloading through its pinned path.
    NcclRows {
        /// Partitions.
        n: usize,
        /// Memory strategy.
        strategy: Strategy,
    },
}

impl CheckRun {
    /// Whether this run needs an NCCL group.
    pub fn needs_nccl(self) -> bool {
        matches!(self, CheckRun::NcclRows { .. })
    }
}

/// The runs of one case; the NCCL runs only `with_nccl`, and after every other run.
pub fn check_runs(with_nccl: bool) -> Vec<CheckRun> {
    let mut runs = vec![CheckRun::Reference];
    for n in [1, 2, 4] {
        for strategy in Strategy::ALL {
            for bf16 in [false, true] {
                runs.push(CheckRun::Fused { n, strategy, bf16 });
            }
        }
    }
    for n in [1, 3] {
        for strategy in Strategy::ALL {
            runs.push(CheckRun::InOrderArena { n, strategy });
        }
    }
    for (n, strategy) in [(1, Strategy::None), (3, Strategy::S4)] {
        for shadowed in [false, true] {
            runs.push(CheckRun::TwoRanks {
                n,
                strategy,
                shadowed,
            });
        }
    }
    if with_nccl {
        for n in [1, 3] {
            for strategy in Strategy::ALL {
                runs.push(CheckRun::NcclRows { n, strategy });
            }
        }
    }
    runs
}
