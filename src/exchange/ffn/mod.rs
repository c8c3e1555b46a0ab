//! The expert FFNs of one partition, forward and backward (the `C_i` and `C'_i` steps): on
//! backend primitives, one expert after another (here), through a device library's whole-
//! partition job (`library.rs`), and the running sums of the expert weight gradients
//! (`grad_acc.rs`).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::blocks::{block, layout_of, Blocks, Mem};
use super::products::Products;
use super::rows::dims2;
use super::rows::LowRank;
use super::schedule::{Role, Slot};
use super::shadows::ExpertSlots;
use super::MoeBackend;
use crate::dispatch::PartitionPlan;
use crate::error::Result;
use crate::experts::{activation_backward, activation_forward, Activation, ExpertPart as Part};

mod grad_acc;
mod library;

pub(crate) use grad_acc::ExpertGradAcc;
use library::{compute_backward_on, compute_on, Library};

/// How one pass computes its experts, chosen once per pass: a device library's whole-partition
/// job where one takes these experts ([`Library::find`]), else the primitives, one expert after
/// another, multiplying as [`Products`] says (through the communicator's library at the run's
/// precision where it offers one).
pub(crate) enum ExpertCompute<B: MoeBackend> {
    Library(Library<B>),
    Primitives(Products<B>),
}

impl<B: MoeBackend> ExpertCompute<B> {
    /// The pass's choice for `experts` on `comm` (see the type).
    pub(crate) fn find(
        comm: &dyn crate::comm::Communicator,
        experts: &ExpertSlots<B>,
        run: &crate::exchange::ExchangeRun,
    ) -> Self {
        match Library::find(comm, experts, run) {
            Some(library) => Self::Library(library),
            None => Self::Primitives(Products::of(comm, run.precision)),
        }
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
pub(crate) fn compute<B: MoeBackend>(
    x: FloatTensor<B>,
    part: &PartitionPlan,
    i: usize,
    experts: &ExpertSlots<B>,
    act: Activation,
    mem: Mem<'_, B>,
    how: &ExpertCompute<B>,
) -> Result<(FloatTensor<B>, PerExpert<B>)> {
    let products = match how {
        ExpertCompute::Library(library) => return compute_on(library, x, part, i, experts, act, mem),
        ExpertCompute::Primitives(products) => products,
    };
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
    how: &ExpertCompute<B>,
) -> Result<FloatTensor<B>> {
    let products = match how {
        ExpertCompute::Library(library) => {
            return compute_backward_on(library, restored, part, i, act, mem, acc)
        }
        ExpertCompute::Primitives(products) => products,
    };
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
