//! Memory reuse: the strategies S1–S4, the host store for offloaded partitions, and the
//! meter that keeps device and host bytes apart.

mod alloc;
mod host_store;
mod measure;
mod meter;
mod model;
mod strategy;

pub use alloc::CountingAllocator;
pub use host_store::{HostBlock, HostStore};
pub use measure::{measure_layer_memory, MemoryMeasurement};
pub use meter::{MemoryMeter, MemoryReport};
pub use model::{ImplementationModel, ImplementationTerms, LayerShape, MemoryPlan, PaperTerms, Term};
pub use strategy::{MemoryReuse, Restore, Strategy};
