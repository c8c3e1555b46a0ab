//! Tuning: the adaptive number of partitions (Algorithm 1), the hardware profile, the cost
//! model that picks a memory strategy (Eq. 10–13, Table III), and which hot experts to shadow.

mod cost;
mod granularity;
mod measure;
mod profile;
mod shadowing;

pub use cost::{CostModel, StrategyChoice, StrategyCost};
pub use granularity::{search_best_gran, GranularityTable, Lookup, TrialTimer, WallClock};
pub use measure::{measure_profile, ProfileOptions};
pub use profile::Profile;
pub use shadowing::{choose_shadows, hottest_experts, shadowed_step_time, ShadowCosts, Shadowing};
