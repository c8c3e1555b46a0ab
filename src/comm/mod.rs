//! Communication between expert-parallel ranks.
//!
//! [`Communicator`] is the one interface the layer talks to. It has a single required
//! primitive, [`Communicator::exchange`] (every rank sends one payload to every rank), from which
//! the collectives the layer needs are built: the uneven all-to-all of token rows, the
//! exchange of per-expert counts, all-gather and all-reduce. [`LocalGroup`] runs N ranks as
//! threads of one process (tests, CI, CPU training); the CUDA crate adds NCCL.

mod communicator;
mod local;
mod loopback;
mod single;

pub use communicator::{Communicator, Payload};
pub use local::{GroupOptions, LocalComm, LocalGroup, RankContext};
pub use loopback::HostLoopback;
pub use single::SingleRank;
