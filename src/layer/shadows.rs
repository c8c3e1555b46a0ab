//! Step 5's experts when the layer shadows: this rank's own, then a copy of each shadowed
//! expert, sent by its owner to every rank through the differentiable all-to-all, so that
//! the copies' gradients flow back to the owner's parameters.

use std::sync::Arc;

use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use super::MoeLayer;
use crate::comm::Communicator;
use crate::error::Result;
use crate::exchange::MoeBackend;
use crate::experts::ExpertWeights;

impl<B: MoeBackend> MoeLayer<B> {
    /// The experts the exchange runs this step: [`Experts::weights`](crate::Experts::weights)
    /// with a copy of every expert in `shadows` (increasing index) appended.
    ///
    /// Every rank sends each shadowed expert's parameters (one row per expert) to every rank,
    /// itself included: the owner its parameters, the others zeros; each rank sums what it
    /// receives over the senders. The copies are therefore exact, every rank builds the same
    /// graph whatever it owns (so the reverse all-to-all of the backward runs on every rank at
    /// the same point), and no tensor is empty. In backward the reverse all-to-all returns
    /// each copy's gradient to every sender, and the owner's mask keeps them for the owner
    /// alone: the sum over ranks lands on the owner's parameters.
    ///
    /// # Errors
    /// [`MoeError::Comm`](crate::MoeError::Comm) if a peer fails in the all-to-all.
    pub(super) fn weights_with_shadows(&self, shadows: &[usize]) -> Result<ExpertWeights<B>> {
        let own = self.experts.weights();
        if shadows.is_empty() {
            return Ok(own);
        }
        let comm = &self.ctx.comm;
        let (rank, n_ranks) = (comm.rank(), comm.n_ranks());
        let n_local = own.n_slots();
        let s = shadows.len();
        let device = own.w_in.device();

        // Each shadow's row of this rank's parameters: its own expert's where it owns it, any
        // local expert's (masked to zero) where it does not. Selected before flattening, so
        // only the shadows' parameters are copied.
        let local: Vec<usize> = shadows.iter().map(|&e| e % n_local).collect();
        let mask: Vec<f32> = shadows
            .iter()
            .map(|&e| f32::from(u8::from(e / n_local == rank)))
            .collect();
        let rows = own.select(&local).flatten()
            * Tensor::<B, 1>::from_data(TensorData::new(mask, [s]), &device).unsqueeze_dim(1);

        // To every rank, itself included; from every rank, summed over the senders.
        let send = Tensor::cat(vec![rows; n_ranks], 0);
        let per_rank = vec![s; n_ranks];
        let received = all_to_all(send, &per_rank, comm)?;
        let width = received.dims()[1];
        let copies = received
            .reshape([n_ranks, s, width])
            .sum_dim(0)
            .reshape([s, width]);
        Ok(own.clone().append(own.unflatten_like(copies)))
    }
}

fn all_to_all<B: MoeBackend>(
    x: Tensor<B, 2>,
    per_rank: &[usize],
    comm: &Arc<dyn Communicator>,
) -> Result<Tensor<B, 2>> {
    let prim = x.into_primitive().tensor();
    B::all_to_all(prim, per_rank, per_rank, comm).map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
}
