//! A one-rank group whose all-to-alls really leave the device.

use super::{Communicator, Payload, SingleRank};
use crate::error::Result;

/// One rank whose all-to-alls go device → host → device instead of being skipped.
///
/// On a single GPU this stands in for the network: every partition of the exchange is copied
/// out over PCIe and back, at a transfer cost similar to a NIC's. Any figure measured with it is
/// an emulation and must say so. On the CPU it is a memory copy.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostLoopback;

impl Communicator for HostLoopback {
    fn rank(&self) -> usize {
        0
    }

    fn n_ranks(&self) -> usize {
        1
    }

    fn is_identity(&self) -> bool {
        false
    }

    fn exchange(&self, op: &'static str, outgoing: Vec<Payload>) -> Result<Vec<Payload>> {
        SingleRank.exchange(op, outgoing)
    }

    fn split(&self, _color: usize) -> Result<std::sync::Arc<dyn Communicator>> {
        Ok(std::sync::Arc::new(HostLoopback))
    }
}
