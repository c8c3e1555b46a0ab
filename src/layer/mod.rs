//! The MoE layer: config, module, output, and loading from canonical safetensors files.

mod adapters;
mod balance;
mod config;
mod context;
mod decode;
mod file;
mod grads;
mod io;
mod losses;
mod meta;
mod module;
mod output;
mod plan;
mod route;
mod shadows;

pub use adapters::ExpertLoraSpec;
pub use config::{ExchangePath, MoeLayerConfig, Partitions, MAX_PARTITIONS};
pub use context::MoeContext;
#[cfg(feature = "testkit")]
pub(crate) use file::{expect_tensor, parameter_shapes};
pub use file::{layer_file_config, read_safetensors, write_safetensors, TensorMap};
pub use grads::ParamKind;
pub use meta::{LayerMeta, SharedMeta};
pub use module::MoeLayer;
pub use output::{MoeOutput, MoeStats};
