//! The experts without the exchange: a rank's own rows, already in expert order, through its
//! local experts in one block. It is the decode path's step 5 (`layer/decode.rs`: a few
//! tokens at inference on one rank), where there is nothing to send, nothing to overlap and
//! nothing to keep for backward, so the plan's partitions, the schedule, its executor and the
//! partition arena would be machinery that runs for nothing.
//!
//! It is the `C` step of the fused exchange ([`compute`]) on one partition that holds every row,
//! with the same expert compute the exchange would find (the communicator's device library,
//! the backend's own path, or the primitives), so a decode step's rows get the same products,
//! at the same precision, as they would inside the exchange.

use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;

use super::ffn::{compute, ExpertCompute};
use super::shadows::ExpertSlots;
use super::{ExchangeRun, MoeBackend};
use crate::dispatch::PartitionPlan;
use crate::error::{MoeError, Result};
use crate::experts::ExpertTensors;

/// `T_O` for `input`'s rows on this rank's experts, with no exchange: expert `e` takes
/// `rows_per_expert[e]` rows, in order. Forward only; nothing is saved for a backward.
///
/// `run` supplies the communicator (where its device library, if any, is found), the
/// activation and the products' precision; its strategy, executor, arena and shadows are
/// not read.
///
/// # Shapes
/// - input (`T_I`, expert-major): `[n_rows, d_model]`, `n_rows = Σ rows_per_expert`
/// - `rows_per_expert`: `[n_local_experts]`
/// - returns `T_O`: `[n_rows, d_model]`, row `i` the expert output for input row `i`
///
/// # Errors
/// [`MoeError::Input`] if the rows or the experts disagree with `rows_per_expert`.
pub(crate) fn forward<B: MoeBackend>(
    input: FloatTensor<B>,
    experts: ExpertTensors<B>,
    rows_per_expert: &[usize],
    run: &ExchangeRun,
) -> Result<FloatTensor<B>> {
    let n_rows = input.shape().to_vec()[0];
    let n_local = experts.w_in.shape().to_vec()[0];
    let expected: usize = rows_per_expert.iter().sum();
    if rows_per_expert.len() != n_local || n_rows != expected {
        return Err(MoeError::Input(format!(
            "the experts' rows: {n_rows} rows for {n_local} experts, but the counts {rows_per_expert:?} \
             (one per expert) sum to {expected}"
        )));
    }
    // No shadows: nothing is broadcast, so no collective runs.
    let experts = ExpertSlots::new(experts, &[], &run.comm)?;
    // A forward alone (no backward reads the step's store).
    let how = ExpertCompute::find(run.comm.as_ref(), &experts, run, Default::default());
    // One partition of one rank: every group is this rank's own, in expert order.
    let part = PartitionPlan::new(0, rows_per_expert, rows_per_expert, 1, n_local);
    let (out, _hidden) = compute::<B>(input, &part, 0, &experts, run.activation, None, &how)?;
    Ok(out)
}
