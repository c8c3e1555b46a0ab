//! The expert FFNs of one partition, forward and backward, on backend primitives (the `C_i`
//! and `C'_i` steps), and the running sums of the expert weight gradients.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};

use std::sync::Arc;

use super::blocks::{block, layout_of, BlockLayout, Blocks, Mem};
use super::expert_path::{ExpertBackward, ExpertForward, ExpertGroups, ExpertPath, GemmPrecision};
use super::rows::{dims2, float_dtype};
use super::schedule::{Role, Slot};
use super::shadows::ExpertSlots;
use super::MoeBackend;
use crate::comm::Communicator;
use crate::dispatch::PartitionPlan;
use crate::error::Result;
use crate::experts::{activation_backward, activation_forward, Activation, ExpertTensors};

/// A device library's expert compute for a run, with what it needs besides the partition: the
/// precision, and the experts grouped as the path reads them (built once per pass).
pub(crate) struct Library<B: MoeBackend> {
    path: Arc<dyn ExpertPath<B>>,
    precision: GemmPrecision,
    groups: ExpertGroups<B>,
}

impl<B: MoeBackend> Library<B> {
    /// The communicator's expert path for `B`, if it offers one.
    pub(crate) fn find(
        comm: &dyn Communicator,
        precision: GemmPrecision,
        experts: &ExpertSlots<B>,
    ) -> Option<Self> {
        let path = comm.row_paths()?.experts::<B>()?;
        Some(Self {
            path,
            precision,
            groups: experts.groups(),
        })
    }
}

/// A slot's buffer for blocks laid out by `layout`: the arena's where `mem` is one, a fresh
/// tensor otherwise.
fn slot_buffer<B: MoeBackend>(
    mem: Mem<'_, B>,
    slot: Slot,
    layout: &BlockLayout,
    width: usize,
    like: &FloatTensor<B>,
) -> Result<FloatTensor<B>> {
    match mem {
        Some(m) => m.buffer(slot, layout.total(), width),
        None => Ok(B::float_empty(
            Shape::new([layout.total(), width]),
            &B::float_device(like),
            float_dtype::<B>(like),
        )),
    }
}

/// `x_e · w_in[e] + b_in[e]`: the first GEMM of expert `e`, i.e. `T_M` before activation.
pub(crate) fn first_gemm<B: MoeBackend>(
    x: FloatTensor<B>,
    experts: &ExpertSlots<B>,
    e: usize,
) -> FloatTensor<B> {
    let z = B::expert_matmul(x, experts.w_in(e));
    match experts.b_in(e) {
        Some(b) => B::float_add(z, b),
        None => z,
    }
}

/// One optional block per local expert (`None` for an expert without rows).
pub(crate) type PerExpert<B> = Vec<Option<FloatTensor<B>>>;

/// C_i: every local expert on its rows of the expert-major partition `i`. Returns the
/// outputs (`T_DO`, expert-major) and each expert's pre-activation `T_M` (`None` for an
/// expert without rows), built in the arena's slots where `mem` is one.
///
/// # Shapes
/// - x (`T_DI`): `[rows, d_model]` laid out by [`layout_of`] → `T_DO` the same;
///   `T_M` per expert `[rows_e, d_hidden]`
pub(crate) fn compute<B: MoeBackend>(
    x: FloatTensor<B>,
    part: &PartitionPlan,
    i: usize,
    experts: &ExpertSlots<B>,
    act: Activation,
    mem: Mem<'_, B>,
    library: Option<&Library<B>>,
) -> Result<(FloatTensor<B>, PerExpert<B>)> {
    if let Some(library) = library {
        return compute_on(library, x, part, i, experts, act, mem);
    }
    let [_, d_model] = dims2::<B>(&x);
    let d_hidden = experts.d_inner();
    let rows_per_expert = &part.rows_per_expert;
    let layout = layout_of(mem, rows_per_expert, d_model);
    let hidden_slot = Slot {
        role: Role::Hidden,
        index: i % 2,
    };
    let mut hidden_blocks = Blocks::new(mem, hidden_slot, rows_per_expert, d_hidden, &x)?;
    let mut out_blocks = Blocks::new(mem, Slot::of(Role::Output, i), rows_per_expert, d_model, &x)?;
    let mut hidden = Vec::with_capacity(rows_per_expert.len());
    for (e, &rows) in rows_per_expert.iter().enumerate() {
        if rows == 0 {
            hidden.push(None);
            continue;
        }
        let x_e = block::<B>(mem, &x, &layout, e, rows);
        let z = hidden_blocks.gemm(e, rows, x_e, experts.w_in(e), experts.b_in(e))?;
        let a = activation_forward::<B>(act, z.clone());
        out_blocks.gemm(e, rows, a, experts.w_out(e), experts.b_out(e))?;
        hidden.push(Some(z));
    }
    Ok((out_blocks.finish(), hidden))
}

/// [`compute`] through a device library: the same slots, one call for the partition.
fn compute_on<B: MoeBackend>(
    library: &Library<B>,
    x: FloatTensor<B>,
    part: &PartitionPlan,
    i: usize,
    experts: &ExpertSlots<B>,
    act: Activation,
    mem: Mem<'_, B>,
) -> Result<(FloatTensor<B>, PerExpert<B>)> {
    let [_, d_model] = dims2::<B>(&x);
    let d_inner = experts.d_inner();
    let rows_per_expert = &part.rows_per_expert;
    let layout = layout_of(mem, rows_per_expert, d_model);
    let hidden_layout = layout_of(mem, rows_per_expert, d_inner);
    let hidden_slot = Slot {
        role: Role::Hidden,
        index: i % 2,
    };
    let hidden = slot_buffer(mem, hidden_slot, &hidden_layout, d_inner, &x)?;
    let out = slot_buffer(mem, Slot::of(Role::Output, i), &layout, d_model, &x)?;
    let (out, hidden) = library.path.forward(ExpertForward {
        x,
        rows_per_expert,
        layout: &layout,
        hidden_layout: &hidden_layout,
        experts: &library.groups,
        activation: act,
        precision: library.precision,
        hidden,
        out,
    })?;
    let per_expert = rows_per_expert
        .iter()
        .enumerate()
        .map(|(e, &rows)| (rows > 0).then(|| block::<B>(mem, &hidden, &hidden_layout, e, rows)))
        .collect();
    Ok((out, per_expert))
}

/// A partition's tensors, back for its backward step.
pub(crate) struct Restored<B: Backend> {
    /// Gradient of the expert outputs, expert-major. `[rows, d_model]`
    pub grad: FloatTensor<B>,
    /// `T_DI_i`, expert-major. `[rows, d_model]`
    pub x: FloatTensor<B>,
    /// `T_M_i` per expert where it was kept or offloaded; `None` where it is recomputed.
    pub hidden: Vec<Option<FloatTensor<B>>>,
}

/// C'_i: the FFN backward of every local expert on partition `i`. Returns the gradient of
/// the partition's expert-major inputs (in the arena's `dT_DI` slot where `mem` is one) and
/// adds the weight gradients to `acc`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn compute_backward<B: MoeBackend>(
    restored: Restored<B>,
    part: &PartitionPlan,
    i: usize,
    experts: &ExpertSlots<B>,
    act: Activation,
    mem: Mem<'_, B>,
    acc: &mut ExpertGradAcc<B>,
    library: Option<&Library<B>>,
) -> Result<FloatTensor<B>> {
    if let Some(library) = library {
        return compute_backward_on(library, restored, part, i, act, mem, acc);
    }
    let Restored { grad, x, hidden } = restored;
    let [_, d_model] = dims2::<B>(&x);
    let rows_per_expert = &part.rows_per_expert;
    let layout = layout_of(mem, rows_per_expert, d_model);
    let mut grads_x = Blocks::new(mem, Slot::of(Role::GradInput, i), rows_per_expert, d_model, &x)?;
    for (e, (&rows, z)) in rows_per_expert.iter().zip(hidden).enumerate() {
        if rows == 0 {
            continue;
        }
        let x_e = block::<B>(mem, &x, &layout, e, rows);
        let g_e = block::<B>(mem, &grad, &layout, e, rows);
        let z = z.unwrap_or_else(|| first_gemm::<B>(x_e.clone(), experts, e));
        let a = activation_forward::<B>(act, z.clone());
        acc.add(
            Param::WOut,
            e,
            B::expert_matmul(B::float_transpose(a), g_e.clone()),
        );
        if experts.own().b_out.is_some() {
            acc.add(Param::BOut, e, B::float_sum_dim(g_e.clone(), 0));
        }
        let grad_a = B::expert_matmul(g_e, B::float_transpose(experts.w_out(e)));
        let grad_z = activation_backward::<B>(act, z, grad_a);
        acc.add(
            Param::WIn,
            e,
            B::expert_matmul(B::float_transpose(x_e), grad_z.clone()),
        );
        if experts.own().b_in.is_some() {
            acc.add(Param::BIn, e, B::float_sum_dim(grad_z.clone(), 0));
        }
        grads_x.gemm(e, rows, grad_z, B::float_transpose(experts.w_in(e)), None)?;
    }
    Ok(grads_x.finish())
}

/// [`compute_backward`] through a device library, adding into the stacked running sums.
fn compute_backward_on<B: MoeBackend>(
    library: &Library<B>,
    restored: Restored<B>,
    part: &PartitionPlan,
    i: usize,
    act: Activation,
    mem: Mem<'_, B>,
    acc: &mut ExpertGradAcc<B>,
) -> Result<FloatTensor<B>> {
    let Restored { grad, x, hidden } = restored;
    let [_, d_model] = dims2::<B>(&x);
    let rows_per_expert = &part.rows_per_expert;
    let layout = layout_of(mem, rows_per_expert, d_model);
    let grad_x = slot_buffer(mem, Slot::of(Role::GradInput, i), &layout, d_model, &x)?;
    if rows_per_expert.iter().all(|&r| r == 0) {
        // Nothing to add: the running sums stay as they are (or unmade, then zeros).
        return Ok(grad_x);
    }
    let out = library.path.backward(ExpertBackward {
        grad,
        x,
        hidden,
        rows_per_expert,
        layout: &layout,
        experts: &library.groups,
        activation: act,
        precision: library.precision,
        grad_x,
        fresh: acc.stacked.is_none(),
        grads: acc.take_stacked(),
    })?;
    acc.stacked = Some(out.grads);
    Ok(out.grad_x)
}

/// Which expert parameter a gradient belongs to (an index into `ExpertGradAcc::sums`).
#[derive(Clone, Copy)]
enum Param {
    WIn = 0,
    BIn = 1,
    WOut = 2,
    BOut = 3,
}

/// Expert weight gradients summed over partitions, one running sum per expert slot (the adds
/// happen in place where the backend owns the sum uniquely), stacked once at the end: a
/// reshape when the rank holds one expert, a single concatenation otherwise. (Accumulating
/// straight into the stacked tensor through slice views measured ~40x slower on Flex.) The
/// slots of shadow copies are summed onto their owners' slots first
/// ([`fold_shadows`](Self::fold_shadows)); what is stacked has the own experts' shape.
///
/// A device library ([`Library`]) keeps its sums stacked instead (`stacked`, every slot, added
/// to in place by its GEMMs): without shadows they are the gradients as they stand.
pub(crate) struct ExpertGradAcc<B: MoeBackend> {
    sums: [Vec<Option<FloatTensor<B>>>; 4],
    /// Every slot's running sums, stacked, where a device library adds them.
    stacked: Option<ExpertTensors<B>>,
    like: ExpertTensors<B>,
    n_slots: usize,
}

impl<B: MoeBackend> ExpertGradAcc<B> {
    pub(crate) fn new(experts: &ExpertSlots<B>) -> Self {
        let n = experts.n_slots();
        let empty = || (0..n).map(|_| None).collect::<Vec<_>>();
        Self {
            sums: [empty(), empty(), empty(), empty()],
            stacked: None,
            like: experts.own().clone(),
            n_slots: n,
        }
    }

    /// The stacked running sums of every slot; before the first partition, uninitialised
    /// tensors that the path writes whole (the job's `fresh`): zero-filling them would cost a
    /// pass over every expert's weights per step.
    fn take_stacked(&mut self) -> ExpertTensors<B> {
        if let Some(stacked) = self.stacked.take() {
            return stacked;
        }
        let n_slots = self.n_slots;
        self.like.clone().map(|like| {
            let mut dims = like.shape().to_vec();
            dims[0] = n_slots;
            B::float_empty(
                Shape::from(dims),
                &B::float_device(&like),
                float_dtype::<B>(&like),
            )
        })
    }

    /// Moves the stacked sums into the per-slot ones (views of them), for the fold of the
    /// shadows' copies and the stacking that follows it.
    fn unstack(&mut self) {
        let Some(stacked) = self.stacked.take() else {
            return;
        };
        for (param, tensor) in stacked.into_parts().into_iter().enumerate() {
            let Some(tensor) = tensor else { continue };
            let dims = tensor.shape().to_vec();
            for e in 0..self.n_slots {
                let slot = if dims.len() == 3 {
                    super::rows::expert_matrix::<B>(&tensor, e)
                } else {
                    super::rows::expert_row::<B>(&tensor, e)
                };
                let sum = &mut self.sums[param][e];
                *sum = Some(match sum.take() {
                    Some(acc) => B::float_add(acc, slot),
                    None => slot,
                });
            }
        }
    }

    /// The stacked sums as the gradients, where they are all there is (no shadow slots, no
    /// per-slot sums).
    fn stacked_as_is(&mut self) -> Option<ExpertTensors<B>> {
        let alone = self.sums.iter().flatten().all(Option::is_none);
        let n_own = self.like.w_in.shape().to_vec()[0];
        match (alone, self.n_slots == n_own) {
            (true, true) => self.stacked.take(),
            _ => None,
        }
    }

    /// Sums the gradients of the copy of each expert in `shadows` (slots past the own
    /// experts, in that order) over the ranks of `comm` onto the owner's slot of that expert,
    /// then drops the copies' slots. Every rank runs the same all-reduces in the same order
    /// (shadow by shadow, parameter by parameter), with zeros where it computed no rows of a
    /// shadow, so the collectives match whatever each rank received.
    ///
    /// # Errors
    /// [`MoeError::Comm`](crate::MoeError::Comm) if a peer fails in an all-reduce.
    pub(crate) fn fold_shadows(&mut self, shadows: &[usize], comm: &dyn Communicator) -> Result<()> {
        let n_own = self.like.w_in.shape().to_vec()[0];
        if shadows.is_empty() {
            return Ok(());
        }
        self.unstack();
        let likes = self.like.clone().into_parts();
        for (param, like) in likes.iter().enumerate() {
            let Some(like) = like else { continue };
            let mut one = like.shape().to_vec();
            one[0] = 1;
            // A weight's running sum is `[rows, cols]`, a bias's `[1, cols]`.
            let one: Vec<usize> = if one.len() == 3 { one[1..].to_vec() } else { one };
            for (j, &e) in shadows.iter().enumerate() {
                let grad = self.sums[param][n_own + j].take().unwrap_or_else(|| {
                    B::float_zeros(
                        Shape::from(one.clone()),
                        &B::float_device(like),
                        float_dtype::<B>(like),
                    )
                });
                let sum = B::all_reduce_sum(grad, comm)?;
                if e / n_own == comm.rank() {
                    let slot = &mut self.sums[param][e % n_own];
                    *slot = Some(match slot.take() {
                        Some(acc) => B::float_add(acc, sum),
                        None => sum,
                    });
                }
            }
        }
        for sums in &mut self.sums {
            sums.truncate(n_own);
        }
        Ok(())
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

    /// [`finish`](Self::finish) into tensors allocated by the calling thread: the stacked
    /// gradients, and the per-slot sums they were read from (which the caller keeps until its
    /// stream has run those reads: the shadow slots' too, which the fold's all-reduces and
    /// adds read).
    pub(crate) fn finish_on_caller(
        mut self,
        shadows: &[usize],
        comm: &dyn Communicator,
    ) -> Result<(ExpertTensors<B>, Vec<FloatTensor<B>>)> {
        let mut sums: Vec<FloatTensor<B>> = self.sums.iter().flatten().flatten().cloned().collect();
        if let Some(s) = &self.stacked {
            sums.extend(s.clone().into_parts().into_iter().flatten());
        }
        self.fold_shadows(shadows, comm)?;
        let stacked = self.stack_all();
        // A copy on this thread's stream; with the sums still held, the add cannot run in
        // place (and a concatenation of several experts is a new tensor already).
        let copy = |t: FloatTensor<B>| B::float_add_scalar(t, 0f32.into());
        let grads = ExpertTensors {
            w_in: copy(stacked.w_in),
            b_in: stacked.b_in.map(copy),
            w_out: copy(stacked.w_out),
            b_out: stacked.b_out.map(copy),
        };
        Ok((grads, sums))
    }

    /// The own experts' gradients, stacked, with the shadow copies' folded in.
    pub(crate) fn finish(mut self, shadows: &[usize], comm: &dyn Communicator) -> Result<ExpertTensors<B>> {
        self.fold_shadows(shadows, comm)?;
        Ok(self.stack_all())
    }

    /// Every running sum stacked into the own experts' shapes (after the fold).
    fn stack_all(mut self) -> ExpertTensors<B> {
        if let Some(stacked) = self.stacked_as_is() {
            return stacked;
        }
        self.unstack();
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
