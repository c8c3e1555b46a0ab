//! The expert FFNs of one partition, forward and backward, on backend primitives (the `C_i`
//! and `C'_i` steps), and the running sums of the expert weight gradients.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};

use std::sync::Arc;

use super::blocks::{block, layout_of, BlockLayout, Blocks, Mem};
use super::expert_path::{ExpertBackward, ExpertForward, ExpertGroups, ExpertPath, GemmPrecision};
use super::products::Products;
use super::rows::LowRank;
use super::rows::{dims2, float_dtype};
use super::schedule::{Role, Slot};
use super::shadows::ExpertSlots;
use super::MoeBackend;
use crate::comm::Communicator;
use crate::dispatch::PartitionPlan;
use crate::error::Result;
use crate::experts::{
    activation_backward, activation_forward, Activation, ExpertGrads, ExpertPart as Part, ExpertTensors,
    EXPERT_PARTS,
};

/// A device library's expert compute for a run, with what it needs besides the partition: the
/// precision, and the experts grouped as the path reads them (built once per pass).
pub(crate) struct Library<B: MoeBackend> {
    path: Arc<dyn ExpertPath<B>>,
    precision: GemmPrecision,
    groups: ExpertGroups<B>,
}

impl<B: MoeBackend> Library<B> {
    /// The communicator's expert path for `B` if it offers one, else the backend's own
    /// ([`MoeBackend::expert_path`]) where the run allows it
    /// ([`ExchangeRun::backend_experts`](super::ExchangeRun::backend_experts)) and freezes no
    /// part, if any. Experts with low-rank adapters run on the
    /// primitives: a path's job has no adapter terms.
    pub(crate) fn find(
        comm: &dyn Communicator,
        experts: &ExpertSlots<B>,
        run: &super::ExchangeRun,
    ) -> Option<Self> {
        if experts.own().has_adapters() {
            return None;
        }
        // The backend's own path computes every part's gradient; with frozen parts (base
        // weights under adapters elsewhere in the model) the primitives skip them instead.
        let own = run.backend_experts && !run.frozen.iter().any(|&f| f);
        let path = comm
            .row_paths()
            .and_then(|p| p.experts::<B>())
            .or_else(|| own.then(B::expert_path).flatten())?;
        Some(Self {
            path,
            precision: run.precision,
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
        None => Ok(B::write_buffer(
            Shape::new([layout.total(), width]),
            &B::float_device(like),
            float_dtype::<B>(like),
        )),
    }
}

/// `x_e · w_in[e] (+ scale · (x_e · a[e]) · b[e]) + b_in[e]`: the first GEMM of expert `e`
/// with its adapter's term, i.e. `T_M` before activation.
pub(crate) fn first_gemm<B: MoeBackend>(
    x: FloatTensor<B>,
    experts: &ExpertSlots<B>,
    e: usize,
    products: &Products<B>,
) -> Result<FloatTensor<B>> {
    let extra = match experts.lora_in(e) {
        Some(l) => Some(products.mm(l.project(x.clone(), products)?, l.b)?),
        None => None,
    };
    let mut z = products.mm(x, experts.w_in(e))?;
    for term in extra.into_iter().chain(experts.b_in(e)) {
        z = B::float_add(z, term);
    }
    Ok(z)
}

/// The adapter's term of a block's GEMM on `x`: `(scale · x · a, b)`, for [`Blocks::gemm`].
fn low_rank_term<B: MoeBackend>(
    lora: Option<LowRank<B>>,
    x: &FloatTensor<B>,
    products: &Products<B>,
) -> Result<Option<(FloatTensor<B>, FloatTensor<B>)>> {
    lora.map(|l| Ok((l.project(x.clone(), products)?, l.b)))
        .transpose()
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
#[allow(clippy::too_many_arguments)]
pub(crate) fn compute<B: MoeBackend>(
    x: FloatTensor<B>,
    part: &PartitionPlan,
    i: usize,
    experts: &ExpertSlots<B>,
    act: Activation,
    mem: Mem<'_, B>,
    library: Option<&Library<B>>,
    products: &Products<B>,
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
    let mut hidden_blocks = Blocks::new(mem, hidden_slot, rows_per_expert, d_hidden, &x, products)?;
    let mut out_blocks = Blocks::new(
        mem,
        Slot::of(Role::Output, i),
        rows_per_expert,
        d_model,
        &x,
        products,
    )?;
    let mut hidden = Vec::with_capacity(rows_per_expert.len());
    for (e, &rows) in rows_per_expert.iter().enumerate() {
        if rows == 0 {
            hidden.push(None);
            continue;
        }
        let x_e = block::<B>(mem, &x, &layout, e, rows);
        let extra = low_rank_term(experts.lora_in(e), &x_e, products)?;
        let z = hidden_blocks.gemm(e, rows, x_e, experts.w_in(e), extra, experts.b_in(e))?;
        let a = activation_forward::<B>(act, z.clone());
        let extra = low_rank_term(experts.lora_out(e), &a, products)?;
        out_blocks.gemm(e, rows, a, experts.w_out(e), extra, experts.b_out(e))?;
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
    products: &Products<B>,
) -> Result<FloatTensor<B>> {
    if let Some(library) = library {
        return compute_backward_on(library, restored, part, i, act, mem, acc);
    }
    let Restored { grad, x, hidden } = restored;
    let [_, d_model] = dims2::<B>(&x);
    let rows_per_expert = &part.rows_per_expert;
    let layout = layout_of(mem, rows_per_expert, d_model);
    let mut grads_x = Blocks::new(
        mem,
        Slot::of(Role::GradInput, i),
        rows_per_expert,
        d_model,
        &x,
        products,
    )?;
    for (e, (&rows, z)) in rows_per_expert.iter().zip(hidden).enumerate() {
        if rows == 0 {
            continue;
        }
        let x_e = block::<B>(mem, &x, &layout, e, rows);
        let g_e = block::<B>(mem, &grad, &layout, e, rows);
        let z = match z {
            Some(z) => z,
            None => first_gemm::<B>(x_e.clone(), experts, e, products)?,
        };
        let a = activation_forward::<B>(act, z.clone());
        let t = B::float_transpose;
        let mm = |lhs, rhs| products.mm(lhs, rhs);
        // The second GEMM: `out = a · w_out + s · (a · a_out) · b_out + b_out_bias`.
        acc.try_add_with(Part::WOut, e, || mm(t(a.clone()), g_e.clone()))?;
        if experts.own().b_out.is_some() {
            acc.add_with(Part::BOut, e, || B::float_sum_dim(g_e.clone(), 0));
        }
        let mut grad_a = mm(g_e.clone(), t(experts.w_out(e)))?;
        if let Some(l) = experts.lora_out(e) {
            let v = lora_backward(&l, &a, &g_e, acc, e, [Part::LoraOutA, Part::LoraOutB], products)?;
            grad_a = B::float_add(grad_a, mm(v, t(l.a))?);
        }
        let grad_z = activation_backward::<B>(act, z, grad_a);
        // The first: `z = x · w_in + s · (x · a_in) · b_in + b_in_bias`.
        acc.try_add_with(Part::WIn, e, || mm(t(x_e.clone()), grad_z.clone()))?;
        if experts.own().b_in.is_some() {
            acc.add_with(Part::BIn, e, || B::float_sum_dim(grad_z.clone(), 0));
        }
        let extra = match experts.lora_in(e) {
            Some(l) => {
                let v = lora_backward(
                    &l,
                    &x_e,
                    &grad_z,
                    acc,
                    e,
                    [Part::LoraInA, Part::LoraInB],
                    products,
                )?;
                Some((v, t(l.a)))
            }
            None => None,
        };
        grads_x.gemm(e, rows, grad_z, t(experts.w_in(e)), extra, None)?;
    }
    Ok(grads_x.finish())
}

/// The backward of one expert's adapter term `s · (x · a) · b` given the gradient `g` of its
/// GEMM's output: adds `d a = x^T · v` and `d b = (s · x · a)^T · g` to `acc` (for the parts
/// `[a, b]`), and returns `v = s · g · b^T`, whose product with `a^T` is the term's share of
/// the gradient of `x`. Nothing here is as large as a weight: every product has the rank as a
/// dimension.
///
/// # Shapes
/// - x `[rows, rows_w]`, g `[rows, cols_w]` → v `[rows, rank]`
fn lora_backward<B: MoeBackend>(
    l: &LowRank<B>,
    x: &FloatTensor<B>,
    g: &FloatTensor<B>,
    acc: &mut ExpertGradAcc<B>,
    e: usize,
    [part_a, part_b]: [Part; 2],
    products: &Products<B>,
) -> Result<FloatTensor<B>> {
    let t = B::float_transpose;
    let v = B::float_mul_scalar(products.mm(g.clone(), t(l.b.clone()))?, (l.scale as f32).into());
    acc.try_add_with(part_a, e, || products.mm(t(x.clone()), v.clone()))?;
    acc.try_add_with(part_b, e, || {
        products.mm(t(l.project(x.clone(), products)?), g.clone())
    })?;
    Ok(v)
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

/// Expert weight gradients summed over partitions, one running sum per expert slot and
/// [`Part`] (the adds happen in place where the backend owns the sum uniquely), stacked once at
/// the end: a reshape when the rank holds one expert, a single concatenation otherwise.
/// (Accumulating straight into the stacked tensor through slice views measured ~40x slower on
/// Flex.) The slots of shadow copies are summed onto their owners' slots first
/// ([`fold_shadows`](Self::fold_shadows)); what is stacked has the own experts' shape. Parts
/// the run marks frozen are never computed nor summed.
///
/// A device library ([`Library`]) keeps its sums stacked instead (`stacked`, every slot, added
/// to in place by its GEMMs): without shadows they are the gradients as they stand.
pub(crate) struct ExpertGradAcc<B: MoeBackend> {
    sums: [Vec<Option<FloatTensor<B>>>; EXPERT_PARTS],
    /// Every slot's running sums, stacked, where a device library adds them.
    stacked: Option<ExpertTensors<B>>,
    like: ExpertTensors<B>,
    n_slots: usize,
    frozen: [bool; EXPERT_PARTS],
}

impl<B: MoeBackend> ExpertGradAcc<B> {
    pub(crate) fn new(experts: &ExpertSlots<B>, frozen: [bool; EXPERT_PARTS]) -> Self {
        let n = experts.n_slots();
        Self {
            sums: std::array::from_fn(|_| (0..n).map(|_| None).collect()),
            stacked: None,
            like: experts.own().clone(),
            n_slots: n,
            frozen,
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
            B::write_buffer(
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
        for (part, tensor) in stacked.into_parts().into_iter().enumerate() {
            let Some(tensor) = tensor else { continue };
            let dims = tensor.shape().to_vec();
            for e in 0..self.n_slots {
                let slot = if dims.len() == 3 {
                    super::rows::expert_matrix::<B>(&tensor, e)
                } else {
                    super::rows::expert_row::<B>(&tensor, e)
                };
                let sum = &mut self.sums[part][e];
                *sum = Some(match sum.take() {
                    Some(acc) => B::float_add(acc, slot),
                    None => slot,
                });
            }
        }
    }

    /// The stacked sums as the gradients, where they are all there is (no shadow slots, no
    /// per-slot sums).
    fn stacked_as_is(&mut self) -> Option<ExpertGrads<B>> {
        let alone = self.sums.iter().flatten().all(Option::is_none);
        let n_own = self.like.w_in.shape().to_vec()[0];
        match (alone, self.n_slots == n_own) {
            (true, true) => self.stacked.take().map(ExpertGrads::from),
            _ => None,
        }
    }

    /// Sums the gradients of the copy of each expert in `shadows` (slots past the own
    /// experts, in that order) over the ranks of `comm` onto the owner's slot of that expert,
    /// then drops the copies' slots. Every rank runs the same all-reduces in the same order
    /// (shadow by shadow, part by part), with zeros where it computed no rows of a shadow, so
    /// the collectives match whatever each rank received.
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
        for (part, like) in likes.iter().enumerate() {
            let Some(like) = like else { continue };
            if self.frozen[part] {
                continue;
            }
            let mut one = like.shape().to_vec();
            one[0] = 1;
            // A matrix's running sum is `[rows, cols]`, a bias's `[1, cols]`.
            let one: Vec<usize> = if one.len() == 3 { one[1..].to_vec() } else { one };
            for (j, &e) in shadows.iter().enumerate() {
                let grad = self.sums[part][n_own + j].take().unwrap_or_else(|| {
                    B::float_zeros(
                        Shape::from(one.clone()),
                        &B::float_device(like),
                        float_dtype::<B>(like),
                    )
                });
                let sum = B::all_reduce_sum(grad, comm)?;
                if e / n_own == comm.rank() {
                    let slot = &mut self.sums[part][e % n_own];
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

    /// Adds `grad()` (expert `e`'s `[rows, cols]` matrix, or `[1, cols]` bias row) to the
    /// running sum of `part`, where the part is not frozen: `grad` is not called for a frozen
    /// one, so its product is never computed.
    fn add_with(&mut self, part: Part, e: usize, grad: impl FnOnce() -> FloatTensor<B>) {
        self.try_add_with(part, e, || Ok(grad()))
            .expect("an infallible gradient");
    }

    /// [`add_with`](Self::add_with) for a gradient whose product may fail (a device library's).
    fn try_add_with(
        &mut self,
        part: Part,
        e: usize,
        grad: impl FnOnce() -> Result<FloatTensor<B>>,
    ) -> Result<()> {
        if self.frozen[part as usize] {
            return Ok(());
        }
        let grad = grad()?;
        let slot = &mut self.sums[part as usize][e];
        *slot = Some(match slot.take() {
            Some(acc) => B::float_add(acc, grad),
            None => grad,
        });
        Ok(())
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
    ) -> Result<(ExpertGrads<B>, Vec<FloatTensor<B>>)> {
        let mut sums: Vec<FloatTensor<B>> = self.sums.iter().flatten().flatten().cloned().collect();
        if let Some(s) = &self.stacked {
            sums.extend(s.clone().into_parts().into_iter().flatten());
        }
        self.fold_shadows(shadows, comm)?;
        // A copy on this thread's stream; with the sums still held, the add cannot run in
        // place (and a concatenation of several experts is a new tensor already).
        let grads = self.stack_all().map(|t| B::float_add_scalar(t, 0f32.into()));
        Ok((grads, sums))
    }

    /// The own experts' gradients, stacked, with the shadow copies' folded in.
    pub(crate) fn finish(mut self, shadows: &[usize], comm: &dyn Communicator) -> Result<ExpertGrads<B>> {
        self.fold_shadows(shadows, comm)?;
        Ok(self.stack_all())
    }

    /// Every running sum stacked into the own experts' shapes (after the fold), frozen parts
    /// left out.
    fn stack_all(mut self) -> ExpertGrads<B> {
        let frozen = self.frozen;
        let mut grads = match self.stacked_as_is() {
            Some(stacked) => stacked,
            None => {
                self.unstack();
                let likes = self.like.clone().into_parts();
                let mut sums = self.sums.into_iter().zip(frozen);
                ExpertGrads {
                    parts: likes.map(|like| {
                        let (sums, frozen) = sums.next().expect("one table per part");
                        // A frozen part is not stacked: that would be zeros the size of a weight.
                        like.filter(|_| !frozen).map(|like| Self::stack(sums, &like))
                    }),
                }
            }
        };
        for (part, frozen) in grads.parts.iter_mut().zip(frozen) {
            if frozen {
                *part = None;
            }
        }
        grads
    }
}
