//! The fused exchange op for any backend, written with primitive ops (the CPU implementation).
//!
//! The schedule is DESIGN §3's: forward issues S_0, then for each partition i: S_{i+1}, C_i,
//! R_i; backward mirrors it on gradients. On the CPU the steps run in that order on the rank's
//! thread, which keeps exactly the buffers the paper's schedule keeps live: two dispatched
//! partitions (the one being computed and the next one received), one hidden activation, and
//! the output being returned. What survives into backward is the strategy's choice.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Slice, TensorMetadata};

use super::rows::{
    all_to_all_rows, cat_rows, dims2, expert_matrix, expert_row, float_dtype, gather_rows, narrow_rows,
    to_data, zeros_like_rows,
};
use super::{ExchangeGrads, ExchangeRun, MoeBackend};
use crate::comm::Communicator;
use crate::dispatch::{ExchangePlan, PartitionPlan};
use crate::error::{MoeError, Result};
use crate::experts::{activation_backward, activation_forward, Activation, ExpertTensors};
use crate::memory::{HostBlock, HostStore, Restore};

/// What the fused forward keeps for backward.
#[derive(Debug, Clone)]
pub struct Saved<B: Backend> {
    experts: ExpertTensors<B>,
    /// `T_I`, kept only when `T_DI` is re-communicated (S2, S4).
    input: Option<FloatTensor<B>>,
    partitions: Vec<SavedPartition<B>>,
    device: B::Device,
}

#[derive(Debug, Clone)]
struct SavedPartition<B: Backend> {
    /// `T_DI_i` in expert-major order.
    dispatched: Stash<B>,
    /// `T_M_i` (pre-activation) per local expert; `None` for experts without rows.
    hidden: Vec<Option<Stash<B>>>,
}

/// One activation between forward and backward.
#[derive(Debug, Clone)]
enum Stash<B: Backend> {
    Device(FloatTensor<B>),
    Host(HostBlock),
    /// Restored by re-communication or recomputation.
    Dropped,
}

impl<B: Backend> Stash<B> {
    fn new(tensor: FloatTensor<B>, restore: Restore, host: &HostStore) -> Result<Self> {
        Ok(match restore {
            Restore::Keep => Stash::Device(tensor),
            Restore::Offload => Stash::Host(host.offload(to_data::<B, 2>(tensor))?),
            Restore::Recommunicate | Restore::Recompute => Stash::Dropped,
        })
    }

    /// The tensor, if it was kept or offloaded.
    fn restore(self, device: &B::Device) -> Option<FloatTensor<B>> {
        match self {
            Stash::Device(t) => Some(t),
            Stash::Host(block) => {
                let data = block.take().expect("an offloaded partition is prefetched once");
                Some(B::float_from_data(data, device))
            }
            Stash::Dropped => None,
        }
    }
}

/// The generic fused forward: `T_O` from `T_I` over the plan's partitions, on any backend,
/// with burn's primitive ops and the run's communicator. Backends without a faster exchange
/// of their own implement [`MoeBackend::exchange_forward`] with it.
///
/// # Shapes
/// - input (`T_I`): `[n_rows, d_model]` in plan order → `T_O`, the same shape
///
/// # Errors
/// [`MoeError::Input`] if `T_I` or the experts disagree with the plan; [`MoeError::Comm`] if a
/// collective fails; [`MoeError::Memory`] if the host store refuses an offload.
pub fn forward<B: MoeBackend>(
    input: FloatTensor<B>,
    experts: ExpertTensors<B>,
    plan: &ExchangePlan,
    run: &ExchangeRun,
) -> Result<(FloatTensor<B>, Saved<B>)> {
    check_input::<B>(&input, &experts, plan)?;
    let comm = run.comm.as_ref();
    let strategy = run.strategy;
    let mut saved = Saved {
        experts,
        input: strategy.keeps_input().then(|| input.clone()),
        partitions: Vec::with_capacity(plan.n_partitions()),
        device: B::float_device(&input),
    };
    let mut output = RowAssembler::<B>::new(&input, plan);

    // S_0
    let mut next = Some(dispatch::<B>(&input, &plan.partitions[0], comm)?);
    for (i, part) in plan.partitions.iter().enumerate() {
        let dispatched = next.take().expect("dispatched one partition ahead");
        // S_{i+1} before C_i: the next partition is received while this one is computed.
        if let Some(following) = plan.partitions.get(i + 1) {
            next = Some(dispatch::<B>(&input, following, comm)?);
        }
        // C_i
        let (out, hidden) = compute::<B>(dispatched.clone(), part, &saved.experts, run.activation);
        saved.partitions.push(SavedPartition {
            dispatched: Stash::new(dispatched, strategy.dispatched(), &run.host)?,
            hidden: hidden
                .into_iter()
                .map(|z| z.map(|z| Stash::new(z, strategy.hidden(), &run.host)).transpose())
                .collect::<Result<_>>()?,
        });
        // R_i
        output.place(part, combine::<B>(out, part, comm)?);
    }
    Ok((output.finish(), saved))
}

/// The generic fused backward: gradients of `T_I` and the experts from the gradient of `T_O`,
/// restoring each partition's `T_DI` and `T_M` as the run's strategy says.
///
/// # Errors
/// [`MoeError::Comm`] if a collective fails.
pub fn backward<B: MoeBackend>(
    grad_out: FloatTensor<B>,
    saved: Saved<B>,
    plan: &ExchangePlan,
    run: &ExchangeRun,
) -> Result<ExchangeGrads<B>> {
    let comm = run.comm.as_ref();
    let Saved {
        experts,
        input,
        partitions,
        device,
    } = saved;
    let mut acc = ExpertGradAcc::<B>::new(&experts);
    let mut input_grad = RowAssembler::<B>::new(&grad_out, plan);

    let mut stashes = partitions.into_iter();
    let mut restore = |part: &PartitionPlan| -> Result<Restored<B>> {
        let stash = stashes.next().expect("one saved partition per planned one");
        // S'_i: the gradient of T_O's partition goes to the experts' ranks ...
        let grad = dispatch::<B>(&grad_out, part, comm)?;
        // ... and T_DI_i comes back: kept, prefetched from the host, or dispatched again.
        let x = match stash.dispatched.restore(&device) {
            Some(x) => x,
            None => {
                let input = input.as_ref().ok_or_else(|| {
                    MoeError::Memory("re-communication needs T_I, which was not kept".into())
                })?;
                dispatch::<B>(input, part, comm)?
            }
        };
        let hidden = stash
            .hidden
            .into_iter()
            .map(|z| z.and_then(|z| z.restore(&device)))
            .collect();
        Ok(Restored { grad, x, hidden })
    };

    let mut next = Some(restore(&plan.partitions[0])?);
    for (i, part) in plan.partitions.iter().enumerate() {
        let current = next.take().expect("restored one partition ahead");
        if let Some(following) = plan.partitions.get(i + 1) {
            next = Some(restore(following)?);
        }
        // C'_i
        let grad_x = compute_backward::<B>(current, part, &experts, run.activation, &mut acc);
        // R'_i
        input_grad.place(part, combine::<B>(grad_x, part, comm)?);
    }
    Ok(ExchangeGrads {
        input: input_grad.finish(),
        experts: acc.finish(),
    })
}

fn check_input<B: Backend>(
    input: &FloatTensor<B>,
    experts: &ExpertTensors<B>,
    plan: &ExchangePlan,
) -> Result<()> {
    let [rows, width] = dims2::<B>(input);
    let w = experts.w_in.shape().to_vec();
    if rows != plan.send_rows() || width != w[1] || w[0] != plan.n_local_experts || plan.partitions.is_empty()
    {
        return Err(MoeError::Input(format!(
            "exchange: T_I is [{rows}, {width}], the plan sends {} rows over {} partitions, \
             the experts are [{}, {}, {}] for {} local experts",
            plan.send_rows(),
            plan.n_partitions(),
            w[0],
            w[1],
            w[2],
            plan.n_local_experts
        )));
    }
    Ok(())
}

/// S_i: sends partition `i` of `rows` (a `[n_rows, width]` tensor in plan order) to the
/// experts' ranks and returns what this rank receives, in expert-major order.
fn dispatch<B: Backend>(
    rows: &FloatTensor<B>,
    part: &PartitionPlan,
    comm: &dyn Communicator,
) -> Result<FloatTensor<B>> {
    let send = narrow_rows::<B>(rows.clone(), part.send_offset, part.send_rows());
    let recv = all_to_all_rows::<B>(comm, send, &part.send_per_rank, &part.recv_per_rank)?;
    Ok(match &part.to_expert_major {
        Some(perm) => gather_rows::<B>(recv, perm),
        None => recv,
    })
}

/// R_i: returns expert-major rows to the ranks they came from.
fn combine<B: Backend>(
    rows: FloatTensor<B>,
    part: &PartitionPlan,
    comm: &dyn Communicator,
) -> Result<FloatTensor<B>> {
    let by_source = match &part.from_expert_major {
        Some(perm) => gather_rows::<B>(rows, perm),
        None => rows,
    };
    all_to_all_rows::<B>(comm, by_source, &part.recv_per_rank, &part.send_per_rank)
}

/// `x_e · w_in[e] + b_in[e]`: the first GEMM of expert `e`, i.e. `T_M` before activation.
fn first_gemm<B: Backend>(x: FloatTensor<B>, experts: &ExpertTensors<B>, e: usize) -> FloatTensor<B> {
    let z = B::float_matmul(x, expert_matrix::<B>(&experts.w_in, e));
    match &experts.b_in {
        Some(b) => B::float_add(z, expert_row::<B>(b, e)),
        None => z,
    }
}

/// C_i: every local expert on its rows of the expert-major partition. Returns the outputs
/// (expert-major, `[rows, d_model]`) and each expert's pre-activation `T_M`.
fn compute<B: MoeBackend>(
    x: FloatTensor<B>,
    part: &PartitionPlan,
    experts: &ExpertTensors<B>,
    act: Activation,
) -> (FloatTensor<B>, Vec<Option<FloatTensor<B>>>) {
    let [_, d_model] = dims2::<B>(&x);
    let mut outs = Vec::with_capacity(part.rows_per_expert.len());
    let mut hidden = Vec::with_capacity(part.rows_per_expert.len());
    let mut offset = 0;
    for (e, &rows) in part.rows_per_expert.iter().enumerate() {
        if rows == 0 {
            hidden.push(None);
            continue;
        }
        let z = first_gemm::<B>(narrow_rows::<B>(x.clone(), offset, rows), experts, e);
        let a = activation_forward::<B>(act, z.clone());
        let mut out = B::float_matmul(a, expert_matrix::<B>(&experts.w_out, e));
        if let Some(b) = &experts.b_out {
            out = B::float_add(out, expert_row::<B>(b, e));
        }
        outs.push(out);
        hidden.push(Some(z));
        offset += rows;
    }
    (cat_rows::<B>(outs, &x, d_model), hidden)
}

/// A partition's tensors, back for its backward step.
struct Restored<B: Backend> {
    /// Gradient of the expert outputs, expert-major. `[rows, d_model]`
    grad: FloatTensor<B>,
    /// `T_DI_i`, expert-major. `[rows, d_model]`
    x: FloatTensor<B>,
    /// `T_M_i` per expert where it was kept or offloaded; `None` where it is recomputed.
    hidden: Vec<Option<FloatTensor<B>>>,
}

/// C'_i: the FFN backward of every local expert on one partition. Returns the gradient of
/// the partition's expert-major inputs and adds the weight gradients to `acc`.
fn compute_backward<B: MoeBackend>(
    restored: Restored<B>,
    part: &PartitionPlan,
    experts: &ExpertTensors<B>,
    act: Activation,
    acc: &mut ExpertGradAcc<B>,
) -> FloatTensor<B> {
    let Restored { grad, x, hidden } = restored;
    let [_, d_model] = dims2::<B>(&x);
    let mut grads_x = Vec::with_capacity(part.rows_per_expert.len());
    let mut offset = 0;
    for (e, (&rows, z)) in part.rows_per_expert.iter().zip(hidden).enumerate() {
        if rows == 0 {
            continue;
        }
        let x_e = narrow_rows::<B>(x.clone(), offset, rows);
        let g_e = narrow_rows::<B>(grad.clone(), offset, rows);
        offset += rows;
        let z = z.unwrap_or_else(|| first_gemm::<B>(x_e.clone(), experts, e));
        let a = activation_forward::<B>(act, z.clone());
        acc.add(
            Param::WOut,
            e,
            B::float_matmul(B::float_transpose(a), g_e.clone()),
        );
        if experts.b_out.is_some() {
            acc.add(Param::BOut, e, B::float_sum_dim(g_e.clone(), 0));
        }
        let grad_a = B::float_matmul(g_e, B::float_transpose(expert_matrix::<B>(&experts.w_out, e)));
        let grad_z = activation_backward::<B>(act, z, grad_a);
        acc.add(
            Param::WIn,
            e,
            B::float_matmul(B::float_transpose(x_e), grad_z.clone()),
        );
        if experts.b_in.is_some() {
            acc.add(Param::BIn, e, B::float_sum_dim(grad_z.clone(), 0));
        }
        grads_x.push(B::float_matmul(
            grad_z,
            B::float_transpose(expert_matrix::<B>(&experts.w_in, e)),
        ));
    }
    cat_rows::<B>(grads_x, &x, d_model)
}

/// Collects per-partition row blocks into one `[n_rows, width]` tensor in `T_I` order.
///
/// With one partition the block is the result. With several, each block is written into a
/// preallocated output (in place where the backend owns it uniquely, as NdArray and Flex do),
/// so the full-size tensor never exists twice.
struct RowAssembler<B: Backend> {
    out: Option<FloatTensor<B>>,
    single: bool,
}

impl<B: Backend> RowAssembler<B> {
    fn new(like: &FloatTensor<B>, plan: &ExchangePlan) -> Self {
        let [_, width] = dims2::<B>(like);
        let single = plan.n_partitions() == 1;
        Self {
            out: (!single).then(|| zeros_like_rows::<B>(like, plan.send_rows(), width)),
            single,
        }
    }

    fn place(&mut self, part: &PartitionPlan, rows: FloatTensor<B>) {
        if self.single {
            self.out = Some(rows);
            return;
        }
        let [n, width] = dims2::<B>(&rows);
        if n == 0 {
            return;
        }
        let out = self.out.take().expect("preallocated");
        let range = part.send_offset..part.send_offset + n;
        self.out = Some(B::float_slice_assign(
            out,
            &[Slice::from(range), Slice::from(0..width)],
            rows,
        ));
    }

    fn finish(self) -> FloatTensor<B> {
        self.out.expect("every partition placed")
    }
}

/// Which expert parameter a gradient belongs to (an index into `ExpertGradAcc::sums`).
#[derive(Clone, Copy)]
enum Param {
    WIn = 0,
    BIn = 1,
    WOut = 2,
    BOut = 3,
}

/// Expert weight gradients summed over partitions, one running sum per expert (the adds
/// happen in place where the backend owns the sum uniquely), stacked once at the end: a
/// reshape when the rank holds one expert, a single concatenation otherwise. (Accumulating
/// straight into the stacked tensor through slice views measured ~40x slower on Flex.)
struct ExpertGradAcc<B: Backend> {
    sums: [Vec<Option<FloatTensor<B>>>; 4],
    like: ExpertTensors<B>,
}

impl<B: Backend> ExpertGradAcc<B> {
    fn new(experts: &ExpertTensors<B>) -> Self {
        let n = experts.w_in.shape().to_vec()[0];
        let empty = || (0..n).map(|_| None).collect::<Vec<_>>();
        Self {
            sums: [empty(), empty(), empty(), empty()],
            like: experts.clone(),
        }
    }

    /// Adds `grad` (expert `e`'s `[rows, cols]` matrix, or `[1, cols]` bias row).
    fn add(&mut self, param: Param, e: usize, grad: FloatTensor<B>) {
        let slot = &mut self.sums[param as usize][e];
        *slot = Some(match slot.take() {
            Some(acc) => B::float_add(acc, grad),
            None => grad,
        });
    }

    /// Stacks per-expert sums (zeros where an expert had no rows) into `like`'s shape.
    fn stack(sums: Vec<Option<FloatTensor<B>>>, like: &FloatTensor<B>) -> FloatTensor<B> {
        let dims = like.shape().to_vec();
        let mut one = dims.clone();
        one[0] = 1;
        let parts: Vec<FloatTensor<B>> = sums
            .into_iter()
            .map(|s| {
                let s = s.unwrap_or_else(|| {
                    B::float_zeros(
                        Shape::from(one.clone()),
                        &B::float_device(like),
                        float_dtype::<B>(like),
                    )
                });
                B::float_reshape(s, Shape::from(one.clone()))
            })
            .collect();
        if parts.len() == 1 {
            parts.into_iter().next().expect("one part")
        } else {
            B::float_cat(parts, 0)
        }
    }

    fn finish(self) -> ExpertTensors<B> {
        let [w_in, b_in, w_out, b_out] = self.sums;
        let like = self.like;
        ExpertTensors {
            w_in: Self::stack(w_in, &like.w_in),
            b_in: like.b_in.as_ref().map(|b| Self::stack(b_in, b)),
            w_out: Self::stack(w_out, &like.w_out),
            b_out: like.b_out.as_ref().map(|b| Self::stack(b_out, b)),
        }
    }
}
