//! The ground floor: what several rooms share about the pipeline. The schedule (which step runs on which stream, reading and
//! writing which partition slots) is run by `exchange`, replayed for memory by `memory` and
//! timed by `sim`; the strategies (which activations survive to backward) are chosen by
//! `layer` and `tuning` and obeyed by all three; the chunk arithmetic cuts rows into partitions
//! for `dispatch`, `memory`, `sim` and `comm`. It depends on no other room (std and serde
//! only), so every arrow into it points down.

mod chunks;
pub(crate) mod schedule;
mod strategy;

pub use chunks::{chunk_len, chunk_range};
pub use strategy::{MemoryReuse, Restore, Strategy};
