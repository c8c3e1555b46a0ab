//! `C'_i` on backend primitives: every local expert's FFN backward on one partition, in the
//! rounds of `mod.rs`, each step's independent products one batch. The second GEMM's backward
//! runs in one of two orders: here the activation's value is recomputed first, as the memory
//! model replays it; under `Scope::Partition` on the arena its input gradient comes first and
//! one kernel gives the value with the derivative (`value_first.rs`).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::value_first::{second_gemm_input_grads, second_gemm_weight_grads, value_with_derivative};
use super::{adapted_gemms, rounds, ExpertCompute, ExpertGradAcc, LowRankTerm};
use crate::dispatch::PartitionPlan;
use crate::error::Result;
use crate::exchange::blocks::{block, layout_of, BlockGemm, Blocks, Mem};
use crate::exchange::products::{Done, ProductBatch, Products, Queued};
use crate::exchange::rows::{dims2, LowRank};
use crate::exchange::schedule::{Role, Slot};
use crate::exchange::shadows::ExpertSlots;
use crate::exchange::MoeBackend;
use crate::experts::{
    activation_backward, activation_forward, activation_with_backward, Activation, ExpertPart as Part,
};

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
    let (products, scope) = match how {
        ExpertCompute::Library(library) => {
            return super::compute_backward_on(library, restored, part, i, act, mem, acc)
        }
        ExpertCompute::Primitives(products, scope) => (products, *scope),
    };
    let Restored { grad, x, mut hidden } = restored;
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
    for round in rounds(rows_per_expert, products) {
        let of = |t: &FloatTensor<B>| -> Vec<FloatTensor<B>> {
            round
                .iter()
                .map(|&(e, rows)| block::<B>(mem, t, &layout, e, rows))
                .collect()
        };
        let (xs, gs) = (of(&x), of(&grad));
        // 1. `T_M` where it was not kept (S3, S4): the first GEMMs again.
        let kept = round.iter().map(|&(e, _)| hidden[e].take()).collect();
        let zs = first_gemms(&round, &xs, kept, experts, products)?;
        let grad_zs = if value_with_derivative(mem, products, scope) {
            // 2. The second GEMM's input gradient, which needs no activation value; then
            //    3. the activation's value and derivative from one kernel; then the rest of
            //    step 2, the second GEMM's weight and adapter gradients, from that value.
            let (grad_as, adapters) = second_gemm_input_grads(&round, &gs, experts, acc, products)?;
            let (acts, grad_zs): (Vec<_>, Vec<_>) = zs
                .into_iter()
                .zip(grad_as)
                .map(|(z, grad_a)| activation_with_backward::<B>(act, z, grad_a))
                .unzip();
            second_gemm_weight_grads(&round, (&acts, &gs), adapters, (acc, mem), products)?;
            grad_zs
        } else {
            let acts: Vec<_> = zs
                .iter()
                .map(|z| activation_forward::<B>(act, z.clone()))
                .collect();
            // 2. The second GEMM's gradients: its weights', its adapter's, and its input's.
            let grad_as = second_gemm_backward(&round, &acts, &gs, experts, (acc, mem), products)?;
            // 3. The activation's.
            zs.into_iter()
                .zip(grad_as)
                .map(|(z, grad_a)| activation_backward::<B>(act, z, grad_a))
                .collect()
        };
        // 4. The first GEMM's: its weights', its adapter's, and the partition's input's.
        first_gemm_backward(&round, &xs, grad_zs, experts, (acc, mem), &mut grads_x, products)?;
    }
    Ok(grads_x.finish())
}

/// `z = x · w_in (+ scale · (x · a) · b) + b_in` for each expert of `round` whose `kept` is
/// `None` (the forward's [`adapted_gemms`], into tensors of their own); the kept ones as they
/// are.
///
/// # Shapes
/// - xs: `[rows_e, d_model]` each → `[rows_e, d_hidden]` each
fn first_gemms<B: MoeBackend>(
    round: &[(usize, usize)],
    xs: &[FloatTensor<B>],
    kept: Vec<Option<FloatTensor<B>>>,
    experts: &ExpertSlots<B>,
    products: &Products<B>,
) -> Result<Vec<FloatTensor<B>>> {
    let (missing, inputs): (Vec<(usize, usize)>, Vec<FloatTensor<B>>) = round
        .iter()
        .zip(xs)
        .zip(&kept)
        .filter(|(_, z)| z.is_none())
        .map(|((&at, x), _)| (at, x.clone()))
        .unzip();
    let Some(like) = inputs.first().cloned() else {
        return Ok(kept.into_iter().flatten().collect());
    };
    let mut fresh = Blocks::loose(experts.d_inner(), &like, products);
    let in_proj = |e| (experts.w_in(e), experts.lora_in(e), experts.b_in(e));
    let mut again = adapted_gemms(&mut fresh, &missing, inputs, in_proj, products)?.into_iter();
    Ok(kept
        .into_iter()
        .map(|z| z.unwrap_or_else(|| again.next().expect("one recomputed `T_M` per missing one")))
        .collect())
}

/// One expert's adapter `s · (x · a) · b` in the backward of its GEMM, given the GEMM's input
/// `x` and output gradient `g`, over two batches: the first makes `g · bᵀ` (and `x · a` where
/// `b` is trained), the second `d a = xᵀ · v` and `d b = (s · x · a)ᵀ · g` for
/// `v = s · g · bᵀ`. Nothing here is as large as a weight: the rank is a dimension of every
/// product.
struct AdapterBackward<B: MoeBackend> {
    lora: LowRank<B>,
    v: Queued,
    proj: Option<Queued>,
}

impl<B: MoeBackend> AdapterBackward<B> {
    /// Queues the first batch's products; `[part_a, part_b]` are the adapter's parts.
    fn queue(
        lora: LowRank<B>,
        (x, g): (&FloatTensor<B>, &FloatTensor<B>),
        acc: &ExpertGradAcc<B>,
        [_, part_b]: [Part; 2],
        batch: &mut ProductBatch<'_, B>,
    ) -> Self {
        let v = batch.push(g.clone(), B::float_transpose(lora.b.clone()));
        let proj = acc.wants(part_b).then(|| batch.push(x.clone(), lora.a.clone()));
        Self { lora, v, proj }
    }

    /// Queues the second batch's gradients of expert `e`'s `a` and `b` (where trained), from
    /// the first batch's results `done`, or writes them into their stacked gradients where
    /// `mem` allows ([`ExpertGradAcc::product`]). Returns what was queued, as
    /// `[part_a, part_b]`'s, and `(v, aᵀ)`: the term's share of `x`'s gradient, as a low-rank
    /// pair.
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the backend cannot launch a GEMM.
    fn queue_grads(
        self,
        (e, x, g): (usize, &FloatTensor<B>, &FloatTensor<B>),
        (acc, mem): (&mut ExpertGradAcc<B>, Mem<'_, B>),
        [part_a, part_b]: [Part; 2],
        done: &mut Done<B>,
        batch: &mut ProductBatch<'_, B>,
    ) -> Result<(Grads, LowRankTerm<B>)> {
        let Self { lora, v, proj } = self;
        let v = lora.scaled(done.take(v));
        let proj = proj.map(|p| done.take(p));
        let grads = factor_grads(&lora, (e, x, g), (&v, proj), (acc, mem), [part_a, part_b], batch)?;
        Ok((grads, (v, B::float_transpose(lora.a))))
    }
}

/// Expert `e`'s adapter factors' gradients, given its GEMM's input `x` and output gradient
/// `g`, `v = s · g · bᵀ` and, where `b` is trained, `proj = x · a`: `d a = xᵀ · v` and
/// `d b = (s · proj)ᵀ · g`, queued in `batch` or written into their stacked gradients where
/// `mem` allows ([`ExpertGradAcc::product`]). Both orders of the backward take them here.
///
/// # Errors
/// [`MoeError::Backend`](crate::MoeError::Backend) if the backend cannot launch a GEMM.
pub(super) fn factor_grads<B: MoeBackend>(
    lora: &LowRank<B>,
    (e, x, g): (usize, &FloatTensor<B>, &FloatTensor<B>),
    (v, proj): (&FloatTensor<B>, Option<FloatTensor<B>>),
    (acc, mem): (&mut ExpertGradAcc<B>, Mem<'_, B>),
    [part_a, part_b]: [Part; 2],
    batch: &mut ProductBatch<'_, B>,
) -> Result<Grads> {
    let t = B::float_transpose;
    let da = acc.product(part_a, e, (t(x.clone()), v.clone()), mem, batch)?;
    let db = match proj {
        Some(p) => acc.product(part_b, e, (t(lora.scaled(p)), g.clone()), mem, batch)?,
        None => None,
    };
    Ok(vec![(part_a, da), (part_b, db)])
}

/// Gradients queued for one expert: each part's product, where it is computed.
pub(super) type Grads = Vec<(Part, Option<Queued>)>;

/// Adds each of `grads` that was queued to expert `e`'s running sums, from `done`.
pub(super) fn add_grads<B: MoeBackend>(
    acc: &mut ExpertGradAcc<B>,
    e: usize,
    grads: Grads,
    done: &mut Done<B>,
) {
    for (part, q) in grads {
        if let Some(grad) = done.take_some(q) {
            acc.add(part, e, grad);
        }
    }
}

pub(super) const LORA_OUT: [Part; 2] = [Part::LoraOutA, Part::LoraOutB];
const LORA_IN: [Part; 2] = [Part::LoraInA, Part::LoraInB];

/// The backward of a round's second GEMMs `out = a · w_out + s · (a · a_out) · b_out + b_out`,
/// given the activations `acts` and the output gradients `gs`: adds the gradients of `w_out`,
/// `b_out` and the adapter to `acc` (frozen parts never computed; `w_out`'s written in place
/// where `mem` allows, [`ExpertGradAcc::product`]) and returns each expert's `grad_a`. Two
/// batches: what needs only `a` and `g`, then the adapter's products that need
/// `v = s · g · b_outᵀ`.
///
/// # Shapes
/// - acts `[rows_e, d_hidden]`, gs `[rows_e, d_model]` → grad_a `[rows_e, d_hidden]`
fn second_gemm_backward<B: MoeBackend>(
    round: &[(usize, usize)],
    acts: &[FloatTensor<B>],
    gs: &[FloatTensor<B>],
    experts: &ExpertSlots<B>,
    (acc, mem): (&mut ExpertGradAcc<B>, Mem<'_, B>),
    products: &Products<B>,
) -> Result<Vec<FloatTensor<B>>> {
    let t = B::float_transpose;
    let mut first = products.batch();
    let queued: Vec<_> = round
        .iter()
        .zip(acts.iter().zip(gs))
        .map(|(&(e, _), (a, g))| {
            let dw = acc.product(Part::WOut, e, (t(a.clone()), g.clone()), mem, &mut first)?;
            if experts.own().b_out.is_some() {
                acc.add_with(Part::BOut, e, || B::float_sum_dim(g.clone(), 0));
            }
            let grad_a = first.push(g.clone(), t(experts.w_out(e)));
            let adapter = experts
                .lora_out(e)
                .map(|l| AdapterBackward::queue(l, (a, g), acc, LORA_OUT, &mut first));
            Ok((dw, grad_a, adapter))
        })
        .collect::<Result<_>>()?;
    let mut done = first.run()?;
    let mut second = products.batch();
    let queued: Vec<_> = queued
        .into_iter()
        .zip(round.iter().zip(acts.iter().zip(gs)))
        .map(|((dw, grad_a, adapter), (&(e, _), (a, g)))| {
            add_grads(acc, e, vec![(Part::WOut, dw)], &mut done);
            let adapter = match adapter {
                Some(adapter) => {
                    let (grads, (v, a_t)) =
                        adapter.queue_grads((e, a, g), (acc, mem), LORA_OUT, &mut done, &mut second)?;
                    Some((grads, second.push(v, a_t)))
                }
                None => None,
            };
            Ok((e, done.take(grad_a), adapter))
        })
        .collect::<Result<_>>()?;
    let mut done = second.run()?;
    Ok(queued
        .into_iter()
        .map(|(e, grad_a, adapter)| match adapter {
            None => grad_a,
            Some((grads, through_a)) => {
                add_grads(acc, e, grads, &mut done);
                B::float_add(grad_a, done.take(through_a))
            }
        })
        .collect())
}

/// The backward of a round's first GEMMs `z = x · w_in + s · (x · a_in) · b_in + b_in`, given
/// the inputs `xs` and the gradients `grad_zs` of `z`: adds the gradients of `w_in`, `b_in`
/// and the adapter to `acc` (`w_in`'s in place where `mem` allows) and writes each expert's
/// `grad_x` block into `grads_x`. Two
/// batches: the adapter's products that `v = s · grad_z · b_inᵀ` needs, then everything else
/// with the blocks.
///
/// # Shapes
/// - xs `[rows_e, d_model]`, grad_zs `[rows_e, d_hidden]` → grad_x blocks `[rows_e, d_model]`
fn first_gemm_backward<B: MoeBackend>(
    round: &[(usize, usize)],
    xs: &[FloatTensor<B>],
    grad_zs: Vec<FloatTensor<B>>,
    experts: &ExpertSlots<B>,
    (acc, mem): (&mut ExpertGradAcc<B>, Mem<'_, B>),
    grads_x: &mut Blocks<'_, B>,
    products: &Products<B>,
) -> Result<()> {
    let t = B::float_transpose;
    let mut first = products.batch();
    let adapters: Vec<_> = round
        .iter()
        .zip(xs.iter().zip(&grad_zs))
        .map(|(&(e, _), (x, grad_z))| {
            experts
                .lora_in(e)
                .map(|l| AdapterBackward::queue(l, (x, grad_z), acc, LORA_IN, &mut first))
        })
        .collect();
    let mut done = first.run()?;
    let mut second = products.batch();
    let mut jobs = Vec::with_capacity(round.len());
    let mut grads = Vec::with_capacity(round.len());
    for ((&(e, rows), (x, grad_z)), adapter) in round.iter().zip(xs.iter().zip(grad_zs)).zip(adapters) {
        let dw = acc.product(Part::WIn, e, (t(x.clone()), grad_z.clone()), mem, &mut second)?;
        if experts.own().b_in.is_some() {
            acc.add_with(Part::BIn, e, || B::float_sum_dim(grad_z.clone(), 0));
        }
        let mut expert_grads = vec![(Part::WIn, dw)];
        let low_rank = match adapter {
            Some(adapter) => {
                let (more, term) =
                    adapter.queue_grads((e, x, &grad_z), (acc, mem), LORA_IN, &mut done, &mut second)?;
                expert_grads.extend(more);
                Some(term)
            }
            None => None,
        };
        grads.push((e, expert_grads));
        jobs.push(BlockGemm {
            e,
            rows,
            lhs: grad_z,
            rhs: t(experts.w_in(e)),
            low_rank,
            bias: None,
        });
    }
    let (_, mut done) = grads_x.gemm_round(second, jobs)?;
    for (e, expert_grads) in grads {
        add_grads(acc, e, expert_grads, &mut done);
    }
    Ok(())
}
