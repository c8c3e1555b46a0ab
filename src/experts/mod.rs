//! The experts: feed-forward networks, one per expert, stored as stacked weight tensors.

mod activation;
#[cfg(feature = "cubecl")]
mod cubecl_activation;
#[cfg(feature = "flex")]
pub(crate) mod flex_gelu;
#[cfg(feature = "flex")]
pub(crate) mod flex_swiglu;
#[cfg(feature = "flex")]
pub(crate) mod gelu_math;
mod init;
mod kernels;
mod lora;
mod module;
mod shard;
mod shared;
#[cfg(feature = "flex")]
mod swiglu_math;
mod tensors;
mod weights;

pub use activation::Activation;
pub(crate) use activation::{activation_backward, activation_forward, activation_with_backward};
#[cfg(feature = "testkit")]
pub(crate) use activation::{
    clamped_swiglu_backward_composed, clamped_swiglu_composed, gelu_backward_composed,
    swiglu_backward_composed, swiglu_composed,
};
pub use init::seeded_uniform;
pub(crate) use init::HostInit;
pub use kernels::ActivationKernels;
pub use lora::{ExpertAdapters, ExpertLora, LoraScaling};
pub use module::Experts;
pub(crate) use module::ExpertsSpec;
pub use shard::{ExpertShard, ShardCheck};
pub use shared::SharedExpert;
pub use tensors::{ExpertGrads, ExpertPart, ExpertTensors, LowRankTensors, EXPERT_PARTS};
pub use weights::ExpertWeights;
