//! The gate: which experts each token goes to, with what weight, and the auxiliary losses.

mod balance;
mod losses;
mod module;
mod rule;
mod topk;

pub(crate) use balance::score_bias_step;
pub(crate) use losses::{load_balancing_loss, z_loss};
pub(crate) use module::buffer;
pub use module::{Router, Routing};
pub use rule::{RoutingRule, Scoring};
pub(crate) use topk::group_limited_top_k;
