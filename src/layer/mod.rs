//! The MoE layer: config, module, output, and loading from canonical safetensors files.

mod config;
mod context;
mod grads;
mod io;
mod module;
mod output;
mod tuning;

pub use config::{ExchangePath, MoeLayerConfig, Partitions};
pub use context::MoeContext;
pub use grads::ParamKind;
pub(crate) use io::{expect_tensor, parameter_shapes};
pub use io::{read_safetensors, write_safetensors, LayerMeta, SharedMeta, TensorMap};
pub use module::MoeLayer;
pub use output::{MoeOutput, MoeStats};
