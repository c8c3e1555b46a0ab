//! The reference twin of the fused exchange op.

use std::sync::Arc;

use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};

use super::MoeBackend;
use crate::comm::Communicator;
use crate::dispatch::ExchangePlan;
use crate::error::{MoeError, Result};
use crate::experts::ExpertWeights;

/// The exchange computed from ordinary tensor ops: a differentiable all-to-all, per-expert
/// `matmul` and activation, and the reverse all-to-all. Autodiff derives its backward.
///
/// It runs the exchange in one piece: partitioning and memory strategies change how the
/// fused op schedules and stores the work, not the function, so one reference serves all of
/// them. (With several partitions, a reference built from separate autodiff all-to-alls
/// could run their backward collectives in a different order on different ranks.)
///
/// # Shapes
/// - input (`T_I`): `[n_rows, d_model]` in the plan's order → `T_O`, same shape
///
/// # Errors
/// [`MoeError::Config`] if the plan has more than one partition; [`MoeError::Comm`] if a
/// collective fails.
pub fn exchange_reference<B: MoeBackend>(
    input: Tensor<B, 2>,
    experts: &ExpertWeights<B>,
    plan: &ExchangePlan,
    comm: &Arc<dyn Communicator>,
) -> Result<Tensor<B, 2>> {
    if plan.n_partitions() != 1 {
        return Err(MoeError::config(
            "path",
            format!(
                "the reference exchange runs unpartitioned, the plan has {} partitions",
                plan.n_partitions()
            ),
        ));
    }
    let part = &plan.partitions[0];
    let d_model = input.dims()[1];
    let device = input.device();

    let received = all_to_all(input, &part.send_per_rank, &part.recv_per_rank, comm)?;
    let expert_major = permute(received, part.to_expert_major.as_deref(), &device);

    let mut outputs = Vec::with_capacity(part.rows_per_expert.len());
    let mut offset = 0;
    for (e, &rows) in part.rows_per_expert.iter().enumerate() {
        if rows > 0 {
            let x_e = expert_major.clone().slice([offset..offset + rows, 0..d_model]);
            outputs.push(experts.forward_expert(e, x_e));
            offset += rows;
        }
    }
    let computed = if outputs.is_empty() {
        // No rows reached this rank's experts. The result must still depend on the experts,
        // or this rank's combine all-to-all would drop out of the backward pass while its
        // peers wait for it there.
        let anchor = experts.w_out.clone().sum().reshape([1, 1]) * 0.0;
        expert_major + anchor
    } else {
        Tensor::cat(outputs, 0)
    };
    let by_source = permute(computed, part.from_expert_major.as_deref(), &device);
    all_to_all(by_source, &part.recv_per_rank, &part.send_per_rank, comm)
}

fn permute<B: MoeBackend>(x: Tensor<B, 2>, order: Option<&[usize]>, device: &B::Device) -> Tensor<B, 2> {
    match order {
        Some(order) if !order.is_empty() => {
            let idx = TensorData::new(order.iter().map(|&i| i as i64).collect::<Vec<_>>(), [order.len()]);
            x.select(0, Tensor::<B, 1, Int>::from_data(idx, device))
        }
        _ => x,
    }
}

fn all_to_all<B: MoeBackend>(
    x: Tensor<B, 2>,
    send: &[usize],
    recv: &[usize],
    comm: &Arc<dyn Communicator>,
) -> Result<Tensor<B, 2>> {
    let prim = x.into_primitive().tensor();
    B::all_to_all(prim, send, recv, comm).map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
}
