//! Host-side bookkeeping of step 2 of the forward recipe (routing counts and plans): which rows go where, in which partition.
//!
//! Nothing here is differentiated. [`DispatchPlan`] orders this rank's (token, choice)
//! assignments into the rows of `T_I` and back; [`ExchangePlan`] is what the exchange op
//! needs: row counts for every (source rank, destination rank, expert) and how each
//! partition cuts them.

mod capacity;
mod combine_map;
mod counts;
mod expert_rows;
mod partition;
mod plan;
mod row_map;
mod shadows;

pub use crate::pipeline::{chunk_len, chunk_range};
pub use capacity::capacity_for;
#[cfg(any(test, feature = "testkit"))]
pub use capacity::CapacityDecision;
pub use combine_map::CombineMap;
pub use counts::RoutingCounts;
pub use expert_rows::ExpertRows;
pub use partition::{PartitionPlan, SplitScheme};
pub use plan::{DispatchPlan, ExchangePlan, RoutingStats};
pub use row_map::RowMap;
