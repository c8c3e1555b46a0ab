//! Memory reuse: the strategies S1–S4, the host store for offloaded partitions, and the
//! meter that keeps device and host bytes apart.

mod host_store;
mod meter;
mod strategy;

pub use host_store::{HostBlock, HostStore};
pub use meter::{MemoryMeter, MemoryReport};
pub use strategy::{MemoryReuse, Restore, Strategy};
