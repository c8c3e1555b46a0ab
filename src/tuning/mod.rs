//! Tuning: the adaptive number of partitions (Algorithm 1), the hardware profile, and the
//! cost model that picks a memory strategy (Eq. 10–13, Table III).

mod cost;
mod granularity;
mod measure;
mod profile;

pub use cost::{CostModel, StrategyChoice, StrategyCost};
pub use granularity::{search_best_gran, GranularityTable, Lookup, TrialTimer, WallClock};
pub use measure::{measure_profile, ProfileOptions};
pub use profile::Profile;
