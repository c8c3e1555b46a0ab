//! Communication between expert-parallel ranks.
//!
//! [`Communicator`] is the one interface the layer talks to. It has a single required
//! primitive, [`Communicator::exchange`] (every rank sends one payload to every rank), from which
//! the collectives the layer needs are built: the uneven all-to-all of token rows, the
//! exchange of per-expert counts, all-gather and all-reduce. [`LocalGroup`] runs N ranks as
//! threads of one process (tests, CI, CPU training); the CUDA crate adds NCCL, whose
//! [`RowPaths`] keep the rows' all-to-all on the device, posted by the same
//! [`post_all_to_all_v`] as the host twin [`HostRows`].

mod communicator;
mod device_rows;
mod local;
mod loopback;
mod peer;
mod reduce;
mod single;

pub use communicator::{Communicator, Payload};
pub use device_rows::{HostOffload, HostRows, OffloadPath, Offloaded, RowExchange, RowPaths, WithRowPaths};
pub use local::{in_rank_pool, GroupOptions, LocalComm, LocalGroup, RankContext};
pub use loopback::HostLoopback;
pub use peer::{
    host_all_to_all_v, host_all_to_all_v_into, post_all_to_all_v, HostPeers, PeerLayout, PeerTransport,
};
pub use reduce::{all_reduce_tensor, broadcast_tensor, HostReduce, TensorReduce};
pub use single::SingleRank;

/// The contiguous slice of `total` items that `rank` of `n_ranks` holds when they are split as
/// evenly as possible (the first `total % n_ranks` ranks hold one more): how the examples and
/// the case harness split a global batch over ranks.
pub fn rank_range(total: usize, n_ranks: usize, rank: usize) -> std::ops::Range<usize> {
    crate::pipeline::chunk_range(total, n_ranks, rank)
}
