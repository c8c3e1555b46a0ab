//! The experts: feed-forward networks, one per expert, stored as stacked weight tensors.

mod activation;
pub(crate) mod flex_gelu;
mod init;
mod module;
mod shared;

pub use activation::Activation;
pub(crate) use activation::{activation_backward, activation_forward, gelu_backward_composed};
pub use init::seeded_uniform;
pub(crate) use init::HostInit;
pub(crate) use module::ExpertsSpec;
pub use module::{ExpertTensors, Experts};
pub use shared::SharedExpert;
