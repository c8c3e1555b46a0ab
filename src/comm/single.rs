//! The trivial group of one rank.

use super::{Communicator, Payload};
use crate::error::{MoeError, Result};

/// A group of exactly one rank: every exchange returns what was sent.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleRank;

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }

    fn n_ranks(&self) -> usize {
        1
    }

    fn exchange(&self, op: &'static str, outgoing: Vec<Payload>) -> Result<Vec<Payload>> {
        if outgoing.len() != 1 {
            return Err(MoeError::comm(
                op,
                0,
                format!("{} payloads for a group of 1 rank", outgoing.len()),
            ));
        }
        Ok(outgoing)
    }

    fn split(&self, _color: usize) -> Result<std::sync::Arc<dyn Communicator>> {
        Ok(std::sync::Arc::new(SingleRank))
    }
}
