//! What `examples/gpu_check.rs` runs for each reference case, in order: every single-GPU
//! configuration first, the NCCL ones last and only where an NCCL group could be made, so a
//! machine without NCCL (or whose bootstrap fails) still checks everything else and reports
//! NCCL as skipped. Plain data, so it is tested without a GPU (`tests/check_plan.rs`).

use mpipemoe::memory::Strategy;
use mpipemoe::GemmPrecision;

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
    /// The fused path with the experts' compute and the layer's dense products on cuBLAS
    /// (`CublasExperts` behind the communicator), at a GEMM precision: IEEE f32 is held to the
    /// cases' own 1e-4.
    Cublas {
        /// Partitions.
        n: usize,
        /// Memory strategy.
        strategy: Strategy,
        /// The GEMMs' precision.
        precision: GemmPrecision,
        /// Host waits on both sides of each section instead of the device hand-over.
        host_handover: bool,
        /// Thread ranks on the one GPU (1 or 2).
        ranks: usize,
        /// One expert shadowed (with 2 ranks).
        shadowed: bool,
        /// The in-order executor (partitions in the arena, padded blocks) instead of the
        /// backend's default.
        in_order: bool,
        /// Under burn's fusion (`Fusion<CubeBackend<..>>`, burn's default CUDA backend).
        fusion: bool,
    },
}

/// Which checks `gpu_check` runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Every check: the cuBLAS path's first, then the cubecl path's, NCCL's last.
    All,
    /// The cuBLAS path's checks alone (a short lease).
    Cublas,
}

impl Plan {
    /// `all` or `cublas`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "all" => Some(Plan::All),
            "cublas" => Some(Plan::Cublas),
            _ => None,
        }
    }
}

/// The cuBLAS path's checks of one case: every precision at n = 1 and partitioned with every
/// way `T_M` comes back, then in f32 the host hand-over, two ranks (one with a shadowed expert,
/// one offloading S1's partitions, whose rows and offloads go through the page-locked host
/// paths a group of thread ranks gets), the in-order executor (the arena's padded blocks) and
/// burn's fusion around the backend.
pub fn cublas_runs() -> Vec<CheckRun> {
    let f32 = GemmPrecision::F32;
    let run = |n, strategy, precision, (host_handover, ranks, shadowed, in_order, fusion)| CheckRun::Cublas {
        n,
        strategy,
        precision,
        host_handover,
        ranks,
        shadowed,
        in_order,
        fusion,
    };
    let plain = (false, 1, false, false, false);
    let mut runs = Vec::new();
    for precision in GemmPrecision::ALL {
        for (n, strategy) in [
            (1, Strategy::None),
            (3, Strategy::S4),
            (2, Strategy::S1),
            (2, Strategy::S3),
        ] {
            runs.push(run(n, strategy, precision, plain));
        }
    }
    runs.extend([
        run(1, Strategy::None, f32, (true, 1, false, false, false)),
        run(3, Strategy::S2, f32, (true, 1, false, false, false)),
        run(1, Strategy::None, f32, (false, 2, false, false, false)),
        run(3, Strategy::S4, f32, (false, 2, true, false, false)),
        run(2, Strategy::S1, f32, (false, 2, false, false, false)),
        run(3, Strategy::S1, f32, (false, 1, false, true, false)),
        run(2, Strategy::S3, f32, (false, 1, false, true, false)),
        run(1, Strategy::None, f32, (false, 1, false, false, true)),
        run(3, Strategy::S4, f32, (false, 1, false, true, true)),
    ]);
    runs
}

impl CheckRun {
    /// Whether this run needs an NCCL group.
    pub fn needs_nccl(self) -> bool {
        matches!(self, CheckRun::NcclRows { .. })
    }
}

/// The runs of one case under `plan`; the NCCL runs only `with_nccl`, and after every other run.
pub fn plan_runs(plan: Plan, with_nccl: bool) -> Vec<CheckRun> {
    match plan {
        Plan::Cublas => cublas_runs(),
        Plan::All => cublas_runs().into_iter().chain(check_runs(with_nccl)).collect(),
    }
}

/// The cubecl path's runs of one case; the NCCL runs only `with_nccl`, and after every other
/// run.
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
