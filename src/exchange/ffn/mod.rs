//! The expert FFNs of one partition, forward and backward (the `C_i` and `C'_i` steps): on
//! backend primitives, the forward here and the backward in `backward.rs`, through a device
//! library's whole-partition job (`library.rs`), and the running sums of the expert weight
//! gradients (`grad_acc.rs`).
//!
//! The primitives go through the experts in rounds: one expert a round where the backend
//! multiplies, every expert in one round where a device library does. Within a round each
//! step's independent products (every expert's first GEMM, say, with its adapter's term) are
//! one batch, which a library runs in one call: on CUDA a section costs a trip to cubecl's
//! device thread and a stream hand-over, so a LoRA partition of 8 experts takes 4 sections
//! forward instead of 48.

use burn::tensor::ops::FloatTensor;

use super::blocks::{block, layout_of, shared_layout, BlockGemm, Blocks, Mem};
use super::products::Products;
use super::rows::dims2;
use super::rows::LowRank;
use super::schedule::{Role, Slot};
use super::shadows::ExpertSlots;
use super::{MoeBackend, PassStore};
use crate::dispatch::PartitionPlan;
use crate::error::Result;
use crate::experts::{activation_forward, Activation};

mod backward;
mod grad_acc;
mod in_place;
mod library;
mod value_first;

pub(crate) use backward::{compute_backward, Restored};
pub(crate) use grad_acc::ExpertGradAcc;
pub(crate) use library::path_for;
use library::{compute_backward_on, compute_on, Library};

/// How one pass computes its experts, chosen once per pass: a device library's whole-partition
/// job where one takes these experts ([`Library::find`]), else the primitives, one expert after
/// another, multiplying as [`Products`] says (through the communicator's library at the run's
/// precision where it offers one), with the activation over the scope [`Scope`] says.
pub(crate) enum ExpertCompute<B: MoeBackend> {
    Library(Library<B>),
    Primitives(Products<B>, Scope),
}

/// What the primitives' activation kernels run over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Each expert's rows in turn, between its two GEMMs: no transient larger than one
    /// expert's, the order the implementation's memory model replays (`memory/implementation`).
    ExpertByExpert,
    /// The whole partition where the arena holds `T_M` in one buffer: one kernel forward over
    /// the partition (its output a partition-sized transient, as on a device library), and
    /// backward each expert's value and derivative from one kernel (both held at once). Taken
    /// only where the run allows it
    /// ([`ExchangeRun::partition_transients`](crate::exchange::ExchangeRun::partition_transients):
    /// no memory budget, whose promise rests on the model).
    Partition,
}

impl<B: MoeBackend> ExpertCompute<B> {
    /// The pass's choice for `experts` on `comm` (see the type). `step` is the step's store a
    /// library's groups carry: a fresh one in a forward, the forward's in its backward.
    pub(crate) fn find(
        comm: &dyn crate::comm::Communicator,
        experts: &ExpertSlots<B>,
        run: &crate::exchange::ExchangeRun,
        step: PassStore,
    ) -> Self {
        match Library::find(comm, experts, run, step) {
            Some(library) => Self::Library(library),
            None => {
                let scope = match run.partition_transients {
                    true => Scope::Partition,
                    false => Scope::ExpertByExpert,
                };
                let products = Products::of(comm, run.precision, run.partition_transients);
                Self::Primitives(products, scope)
            }
        }
    }

    /// The step's store, where a library computes the experts: what the forward hands to its
    /// backward (nothing for the primitives, which keep nothing).
    pub(crate) fn step(&self) -> Option<PassStore> {
        match self {
            Self::Library(library) => Some(library.step().clone()),
            Self::Primitives(..) => None,
        }
    }
}

/// One optional block per local expert (`None` for an expert without rows).
pub(crate) type PerExpert<B> = Vec<Option<FloatTensor<B>>>;

/// The experts with rows, `(e, rows)`, in rounds that take their products together
/// ([`Products::experts_per_round`]): all of them in one round through a device library where
/// the run allows a partition's transients, one expert a round otherwise.
fn rounds<B: MoeBackend>(rows_per_expert: &[usize], products: &Products<B>) -> Vec<Vec<(usize, usize)>> {
    let with_rows: Vec<(usize, usize)> = rows_per_expert
        .iter()
        .enumerate()
        .filter(|(_, &rows)| rows > 0)
        .map(|(e, &rows)| (e, rows))
        .collect();
    with_rows
        .chunks(products.experts_per_round(with_rows.len()))
        .map(<[_]>::to_vec)
        .collect()
}

/// An adapter's term `u · v` of a block's GEMM, as `(u, v)` ([`BlockGemm::low_rank`]).
type LowRankTerm<B> = (FloatTensor<B>, FloatTensor<B>);

/// The adapters' terms of one round's GEMMs on `inputs`: `(scale · x · a, b)` for each input
/// whose entry in `adapters` has one, for [`BlockGemm::low_rank`]; the projections `x · a` in
/// one batch. Nothing here is as large as a weight: the rank is a dimension of every product.
fn low_rank_terms<B: MoeBackend>(
    inputs: &[FloatTensor<B>],
    adapters: Vec<Option<LowRank<B>>>,
    products: &Products<B>,
) -> Result<Vec<Option<LowRankTerm<B>>>> {
    let mut batch = products.batch();
    let queued: Vec<_> = inputs
        .iter()
        .zip(adapters)
        .map(|(x, lora)| lora.map(|l| (batch.push(x.clone(), l.a.clone()), l)))
        .collect();
    let mut done = batch.run()?;
    Ok(queued
        .into_iter()
        .map(|q| q.map(|(q, l)| (l.scaled(done.take(q)), l.b)))
        .collect())
}

/// Expert `e`'s weight, adapter and bias on one of its matrices.
type Projection<B> = (FloatTensor<B>, Option<LowRank<B>>, Option<FloatTensor<B>>);

/// One step of a round: each expert's `x · w (+ scale · (x · a) · b) (+ bias)` into `blocks`,
/// for `(w, adapter, bias) = projection(e)`: the adapters' projections in one batch, then the
/// blocks' products in another. `inputs` and the result are in the round's order.
fn adapted_gemms<B: MoeBackend>(
    blocks: &mut Blocks<'_, B>,
    round: &[(usize, usize)],
    inputs: Vec<FloatTensor<B>>,
    projection: impl Fn(usize) -> Projection<B>,
    products: &Products<B>,
) -> Result<Vec<FloatTensor<B>>> {
    let (weights, adapters): (Vec<_>, Vec<_>) = round
        .iter()
        .map(|&(e, _)| {
            let (w, adapter, bias) = projection(e);
            ((w, bias), adapter)
        })
        .unzip();
    let terms = low_rank_terms(&inputs, adapters, products)?;
    let jobs = round
        .iter()
        .zip(inputs)
        .zip(terms)
        .zip(weights)
        .map(|(((&(e, rows), lhs), low_rank), (rhs, bias))| BlockGemm {
            e,
            rows,
            lhs,
            rhs,
            low_rank,
            bias,
        })
        .collect();
    Ok(blocks.gemm_round(products.batch(), jobs)?.0)
}

/// C_i: every local expert on its rows of the expert-major partition `i`. Returns the
/// outputs (`T_DO`, expert-major) and each expert's pre-activation `T_M` (`None` for an
/// expert without rows), built in the arena's slots where `mem` is one.
///
/// The activation runs over the whole partition after every expert's first GEMM, or expert by
/// expert between each expert's two GEMMs, as [`Scope`] says.
///
/// # Shapes
/// - x (`T_DI`): `[rows, d_model]` laid out by [`layout_of`] → `T_DO` the same;
///   `T_M` per expert `[rows_e, d_inner]`
pub(crate) fn compute<B: MoeBackend>(
    x: FloatTensor<B>,
    part: &PartitionPlan,
    i: usize,
    experts: &ExpertSlots<B>,
    act: Activation,
    mem: Mem<'_, B>,
    how: &ExpertCompute<B>,
) -> Result<(FloatTensor<B>, PerExpert<B>)> {
    let (products, scope) = match how {
        ExpertCompute::Library(library) => return compute_on(library, x, part, i, experts, act, mem),
        ExpertCompute::Primitives(products, scope) => (products, *scope),
    };
    let [_, d_model] = dims2::<B>(&x);
    let rows_per_expert = &part.rows_per_expert;
    let layout = layout_of(mem, rows_per_expert, d_model);
    let hidden_slot = Slot {
        role: Role::Hidden,
        index: i % 2,
    };
    let d_inner = experts.d_inner();
    // `T_M`'s blocks start where the activation's output, row for row, can be cut into views.
    let hidden_layout = shared_layout(mem, rows_per_expert, &[d_inner, act.d_hidden(d_inner)]);
    let mut hidden_blocks = Blocks::with_layout(mem, hidden_slot, hidden_layout, d_inner, &x, products)?;
    let mut out_blocks = Blocks::new(
        mem,
        Slot::of(Role::Output, i),
        rows_per_expert,
        d_model,
        &x,
        products,
    )?;
    let out_proj = |e| (experts.w_out(e), experts.lora_out(e), experts.b_out(e));
    let in_proj = |e| (experts.w_in(e), experts.lora_in(e), experts.b_in(e));
    let rounds = rounds(rows_per_expert, products);
    // The arena and `T_M`'s buffer where the activation runs over the whole partition.
    let whole = match (scope, mem, hidden_blocks.buffer()) {
        (Scope::Partition, Some(m), Some(buffer)) if !rounds.is_empty() => Some((m, buffer.clone())),
        _ => None,
    };
    let mut hidden: PerExpert<B> = vec![None; rows_per_expert.len()];
    for round in &rounds {
        // 1. The first GEMMs, with their adapters' terms, into the hidden slot (`T_M`).
        let xs: Vec<_> = round
            .iter()
            .map(|&(e, rows)| block::<B>(mem, &x, &layout, e, rows))
            .collect();
        let zs = adapted_gemms(&mut hidden_blocks, round, xs, in_proj, products)?;
        if whole.is_none() {
            // 2. The activation, expert by expert (see `Scope`).
            let acts = zs
                .iter()
                .map(|z| activation_forward::<B>(act, z.clone()))
                .collect();
            // 3. The second GEMMs, with their adapters' terms, into the output slot (`T_DO`).
            adapted_gemms(&mut out_blocks, round, acts, out_proj, products)?;
        }
        for (&(e, _), z) in round.iter().zip(zs) {
            hidden[e] = Some(z);
        }
    }
    if let Some((m, buffer)) = whole {
        // 2. The activation over the whole partition: the padding rows between blocks hold
        //    stale values, whose images nothing reads.
        let acts = activation_forward::<B>(act, buffer);
        for round in &rounds {
            // 3. The second GEMMs on the activation's blocks, as above.
            let blocks = round
                .iter()
                .map(|&(e, rows)| m.rows(&acts, hidden_blocks.layout().start(e), rows))
                .collect();
            adapted_gemms(&mut out_blocks, round, blocks, out_proj, products)?;
        }
    }
    Ok((out_blocks.finish(), hidden))
}
