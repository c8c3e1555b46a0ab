//! The memory budget's rule, shared by the layer (on a batch's real rows) and the planner
//! (on a modelled imbalance): the smallest partition count at which some allowed strategy's
//! modelled peak, with headroom, fits the budget on every rank, and the cheapest such
//! strategy.

use serde::Serialize;

use super::{Execution, ExpertRoute, ImplementationModel, LayerShape, RankRows, Strategy};

/// The memory model's estimate is inflated by this factor before it is compared with the
/// budget. The model follows the code's allocations and tracked a counting allocator within
/// ±6% over the benchmark rows (BENCHMARKS.md §1); the headroom covers that error, the
/// scheduling of the stream workers, and allocator rounding.
pub const MODEL_HEADROOM: f64 = 1.10;

/// One `(n, strategy)` the rule considered.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct BudgetCandidate {
    /// Partitions.
    pub n_partitions: usize,
    /// Strategy.
    pub strategy: Strategy,
    /// The largest modelled rank peak, bytes (without the headroom).
    pub peak_bytes: f64,
    /// Whether it fits: `peak_bytes · MODEL_HEADROOM <= budget`.
    pub fits: bool,
}

/// The rule: for each `n` in order, the strategies in order (cheapest first), the first whose
/// peak (over the ranks, by `peak(n, strategy)`) fits `budget` with headroom. Returns the
/// choice, if any, and every candidate evaluated.
pub fn fit_budget(
    budget: usize,
    partitions: &[usize],
    strategies: &mut dyn FnMut(usize) -> Vec<Strategy>,
    peak: &mut dyn FnMut(usize, Strategy) -> f64,
) -> (Option<BudgetCandidate>, Vec<BudgetCandidate>) {
    let mut seen = Vec::new();
    for &n in partitions {
        for strategy in strategies(n) {
            let peak_bytes = peak(n, strategy);
            let candidate = BudgetCandidate {
                n_partitions: n,
                strategy,
                peak_bytes,
                fits: peak_bytes * MODEL_HEADROOM <= budget as f64,
            };
            seen.push(candidate);
            if candidate.fits {
                return (Some(candidate), seen);
            }
        }
    }
    (None, seen)
}

/// The modelled peak (bytes) of the rank described by `rows` under `strategy`, the pass run
/// as `execution` says.
pub fn rank_peak_bytes(
    shape: &LayerShape,
    rows: &RankRows,
    strategy: Strategy,
    execution: Execution,
    elem_bytes: usize,
) -> f64 {
    ImplementationModel::for_execution(shape, rows, strategy, execution).peak_device() * elem_bytes as f64
}

/// What the budget decided for one batch, and why. In [`MoeStats::memory`](crate::MoeStats).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryDecision {
    /// The budget, bytes per rank.
    pub budget_bytes: usize,
    /// Partitions chosen.
    pub n_partitions: usize,
    /// Strategy chosen.
    pub strategy: Strategy,
    /// Rows each rank receives for its experts. `[n_ranks]`
    pub recv_rows: Vec<usize>,
    /// Each rank's modelled peak under the choice, bytes. `[n_ranks]`
    pub peak_bytes: Vec<f64>,
    /// The route of the experts the model replayed: the one the exchange takes.
    pub route: ExpertRoute,
    /// Whether the model replayed the threaded executor (the exchange's for this layer).
    pub threaded: bool,
    /// Why this partition count and strategy (what did not fit before them).
    pub reason: String,
}
