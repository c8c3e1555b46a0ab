//! The reference twin's experts when the layer shadows: this rank's own, then a copy of each
//! shadowed expert, broadcast by its owner to every rank through the differentiable
//! broadcast, so that the copies' gradients are summed back onto the owner's parameters by
//! autodiff. The fused op does the same inside itself (`exchange/shadows.rs`), without the
//! concatenation and the split of gradients these ops cost; the two are held equal by the
//! exactness tests.

use std::sync::Arc;

use burn::tensor::{Tensor, TensorPrimitive};

use super::MoeLayer;
use crate::comm::Communicator;
use crate::error::Result;
use crate::exchange::MoeBackend;
use crate::experts::ExpertWeights;

impl<B: MoeBackend> MoeLayer<B> {
    /// The experts the reference exchange runs this step:
    /// [`MoeLayer::expert_weights`] with a copy of every expert in `shadows`
    /// (increasing index) appended.
    ///
    /// Each owner broadcasts its shadowed experts' parameters (one row per expert) to every
    /// rank: one [`MoeBackend::broadcast`] per owner with shadows, in rank order. The copies are
    /// therefore exact, and every rank builds the same graph whatever it owns: a rank that
    /// does not own the shadows passes rows of its own experts of the same shape, which the
    /// broadcast does not read but which keep its node tracked and at the owner's depth, so
    /// that the backward's all-reduce runs on every rank at the same point. That all-reduce
    /// sums the copies' gradients over the ranks onto the owner's parameters.
    ///
    /// # Errors
    /// [`MoeError::Comm`](crate::MoeError::Comm) if a peer fails in a broadcast.
    pub(super) fn weights_with_shadows(&self, shadows: &[usize]) -> Result<ExpertWeights<B>> {
        let own = self.expert_weights();
        if shadows.is_empty() {
            return Ok(own);
        }
        let comm = &self.ctx.comm;
        let n_local = own.n_slots();
        // Experts are numbered owner by owner and the shadows come in increasing index, so
        // each owner's shadows are consecutive and the copies keep the shadows' order.
        let mut copies = Vec::new();
        for group in shadows.chunk_by(|a, b| a / n_local == b / n_local) {
            let root = group[0] / n_local;
            // Selected before flattening, so only the shadows' parameters are copied. A rank
            // that does not own them takes the same slots of its own experts: the broadcast
            // does not read them, but the same ops on every rank put the broadcast at the same
            // depth of every rank's tape, which burn-autodiff 0.21 runs depth by depth
            // (`runtime/server.rs` `execute_steps`), so that the backward's all-reduce comes at
            // the same point on every rank (a fresh leaf there put it first and deadlocked the
            // collectives' order, tried).
            let local: Vec<usize> = group.iter().map(|&e| e % n_local).collect();
            copies.push(broadcast(own.select(&local).flatten(), root, comm)?);
        }
        let copies = Tensor::cat(copies, 0);
        Ok(own.clone().append(own.unflatten_like(copies)))
    }
}

fn broadcast<B: MoeBackend>(
    x: Tensor<B, 2>,
    root: usize,
    comm: &Arc<dyn Communicator>,
) -> Result<Tensor<B, 2>> {
    let prim = x.into_primitive().tensor();
    B::broadcast(prim, root, comm).map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
}
