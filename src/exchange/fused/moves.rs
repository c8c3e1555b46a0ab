//! The steps of a pass that move rows: `S_i` (dispatch) and `R_i` (combine) over the
//! communicator, each laid out as the arena places it, and the check of the pass's input
//! against the plan.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;

use crate::comm::Communicator;
use crate::dispatch::{ExchangePlan, PartitionPlan};
use crate::error::{MoeError, Result};
use crate::exchange::blocks::{layout_of, Mem};
use crate::exchange::rows::{all_to_all_rows, dims2, gather_rows, narrow_rows};
use crate::exchange::schedule::Slot;
use crate::exchange::MoeBackend;
use crate::experts::ExpertTensors;

pub(super) fn check_input<B: Backend>(
    input: &FloatTensor<B>,
    experts: &ExpertTensors<B>,
    plan: &ExchangePlan,
    shadows: &[usize],
) -> Result<()> {
    let [rows, width] = dims2::<B>(input);
    let w = experts.w_in.shape().to_vec();
    if rows != plan.send_rows()
        || width != w[1]
        || w[0] + shadows.len() != plan.n_local_experts
        || plan.partitions.is_empty()
    {
        return Err(MoeError::Input(format!(
            "exchange: T_I is [{rows}, {width}], the plan sends {} rows over {} partitions, \
             the experts are [{}, {}, {}] and {} shadows for {} expert slots",
            plan.send_rows(),
            plan.n_partitions(),
            w[0],
            w[1],
            w[2],
            shadows.len(),
            plan.n_local_experts
        )));
    }
    let w_out = experts.w_out.shape().to_vec();
    for (name, lora, rows, cols) in [
        ("lora_in", &experts.lora_in, w[1], w[2]),
        ("lora_out", &experts.lora_out, w_out[1], w_out[2]),
    ] {
        let Some(lora) = lora else { continue };
        let (a, b) = (lora.a.shape().to_vec(), lora.b.shape().to_vec());
        let fits = a.len() == 3
            && b.len() == 3
            && a[..2] == [w[0], rows]
            && b[0] == w[0]
            && b[1] == a[2]
            && b[2] == cols
            && a[2] > 0;
        if !fits || !lora.scale.is_finite() {
            return Err(MoeError::Input(format!(
                "exchange: the adapter {name} is a {a:?}, b {b:?}, scale {}: expected a [{}, {rows}, r], \
                 b [{}, r, {cols}] with r ≥ 1 and a finite scale",
                lora.scale, w[0], w[0]
            )));
        }
    }
    Ok(())
}

/// S_i: sends partition `i` of `rows` (a `[n_rows, width]` tensor in plan order) to the
/// experts' ranks and returns what this rank receives, in expert-major order: in the arena's
/// buffer of `target` where `mem` is one (each expert's block at its aligned start), as a
/// fresh tensor otherwise.
pub(super) fn dispatch<B: MoeBackend>(
    rows: &FloatTensor<B>,
    part: &PartitionPlan,
    comm: &dyn Communicator,
    mem: Mem<'_, B>,
    target: Slot,
) -> Result<FloatTensor<B>> {
    let send = narrow_rows::<B>(rows.clone(), part.send_offset, part.send_rows());
    let recv = all_to_all_rows::<B>(comm, send, &part.send_per_rank, &part.recv_per_rank)?;
    let Some(m) = mem else {
        return Ok(match &part.to_expert_major {
            Some(perm) => gather_rows::<B>(recv, perm),
            None => recv,
        });
    };
    let [received, width] = dims2::<B>(&recv);
    let layout = layout_of(mem, &part.rows_per_expert, width);
    // Expert-major row r is received row `to_expert_major[r]` (row r without a permutation).
    // The arena's copy replaces the gather that a permutation needs; rows that arrive in
    // expert-major order at aligned blocks (one rank, or one expert per rank) are used as
    // they arrived, without a copy.
    let from: Vec<usize> = match &part.to_expert_major {
        Some(perm) => perm.clone(),
        None if layout.is_dense() => return Ok(recv),
        None => (0..received).collect(),
    };
    let into = layout.buffer_rows();
    if from.len() != into.len() {
        return Err(MoeError::Backend(format!(
            "dispatch: {} rows received for {} expert rows",
            from.len(),
            into.len()
        )));
    }
    let buffer = m.buffer(target, layout.total(), width)?;
    m.copy_rows(&buffer, &into, recv, &from);
    Ok(buffer)
}

/// R_i: returns expert-major rows (laid out as `mem` places them) to the ranks they came
/// from.
pub(super) fn combine<B: MoeBackend>(
    rows: FloatTensor<B>,
    part: &PartitionPlan,
    comm: &dyn Communicator,
    mem: Mem<'_, B>,
) -> Result<FloatTensor<B>> {
    let [_, width] = dims2::<B>(&rows);
    let layout = layout_of(mem, &part.rows_per_expert, width);
    let by_source = match (&part.from_expert_major, layout.is_dense()) {
        (None, true) => rows,
        (Some(perm), true) => gather_rows::<B>(rows, perm),
        // Row k for the sources is expert-major row `from_expert_major[k]`, which the
        // buffer holds at its padded position.
        (perm, false) => {
            let at = layout.buffer_rows();
            let idx: Vec<usize> = match perm {
                Some(perm) => perm.iter().map(|&r| at[r]).collect(),
                None => at,
            };
            gather_rows::<B>(rows, &idx)
        }
    };
    all_to_all_rows::<B>(comm, by_source, &part.recv_per_rank, &part.send_per_rank)
}
