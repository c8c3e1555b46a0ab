//! The gate: which experts each token goes to, with what weight, and the auxiliary losses.

mod losses;
mod module;
mod topk;

pub use losses::{load_balancing_loss, z_loss};
pub use module::{Router, Routing};
pub use topk::top_k_host;
