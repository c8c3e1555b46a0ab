//! The MoE layer: config, module, output, and loading from canonical safetensors files.

mod balance;
mod budget;
mod config;
mod context;
mod grads;
mod io;
mod meta;
mod module;
mod output;
mod tuning;

pub use config::{ExchangePath, MoeLayerConfig, Partitions, MAX_PARTITIONS};
pub use context::MoeContext;
pub use grads::ParamKind;
pub(crate) use io::{expect_tensor, parameter_shapes};
pub use io::{read_safetensors, write_safetensors, TensorMap};
pub use meta::{LayerMeta, SharedMeta};
pub use module::MoeLayer;
pub use output::{MoeOutput, MoeStats};
