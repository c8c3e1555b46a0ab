//! `C'_i` on backend primitives: every local expert's FFN backward on one partition, in the
//! rounds of `mod.rs`, each step's independent products one batch.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use super::{low_rank_terms, rounds, ExpertCompute, ExpertGradAcc};
use crate::dispatch::PartitionPlan;
use crate::error::Result;
use crate::exchange::blocks::{block, layout_of, BlockGemm, Blocks, Mem};
use crate::exchange::products::Products;
use crate::exchange::rows::dims2;
use crate::exchange::schedule::{Role, Slot};
use crate::exchange::shadows::ExpertSlots;
use crate::exchange::MoeBackend;
use crate::experts::{activation_backward, activation_forward, Activation, ExpertPart as Part};

/// A partition's tensors, back for its backward step.
pub(crate) struct Restored<B: Backend> {
    /// Gradient of the expert outputs, expert-major. `[rows, d_model]`
    pub grad: FloatTensor<B>,
    /// `T_DI_i`, expert-major. `[rows, d_model]`
    pub x: FloatTensor<B>,
    /// `T_M_i` per expert where it was kept or offloaded; `None` where it is recomputed.
    pub hidden: Vec<Option<FloatTensor<B>>>,
}

/// `(e, tensor)` for each expert of a round.
type Round<B> = Vec<(usize, FloatTensor<B>)>;

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
            return super::compute_backward_on(library, restored, part, i, act, mem, acc)
        }
        ExpertCompute::Primitives(products) => products,
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
        let of = |t: &FloatTensor<B>| -> Round<B> {
            round
                .iter()
                .map(|&(e, rows)| (e, block::<B>(mem, t, &layout, e, rows)))
                .collect()
        };
        let (xs, gs) = (of(&x), of(&grad));
        // 1. `T_M` where it was not kept (S3, S4): the first GEMMs again.
        let kept = round.iter().map(|&(e, _)| hidden[e].take()).collect();
        let zs = first_gemms(&xs, kept, experts, products)?;
        let acts: Round<B> = zs
            .iter()
            .map(|(e, z)| (*e, activation_forward::<B>(act, z.clone())))
            .collect();
        // 2. The second GEMM's gradients: its weights', its adapter's, and its input's.
        let grad_as = second_gemm_backward(&acts, &gs, experts, acc, products)?;
        // 3. The activation's.
        let grad_zs: Round<B> = zs
            .into_iter()
            .zip(grad_as)
            .map(|((e, z), grad_a)| (e, activation_backward::<B>(act, z, grad_a)))
            .collect();
        // 4. The first GEMM's: its weights', its adapter's, and the partition's input's.
        first_gemm_backward(&round, &xs, grad_zs, experts, acc, &mut grads_x, products)?;
    }
    Ok(grads_x.finish())
}

/// `z = x · w_in (+ scale · (x · a) · b) + b_in` for each expert of a round whose `kept` is
/// `None`; the kept ones as they are.
///
/// # Shapes
/// - xs: `[rows_e, d_model]` each → `[rows_e, d_hidden]` each
fn first_gemms<B: MoeBackend>(
    xs: &Round<B>,
    kept: Vec<Option<FloatTensor<B>>>,
    experts: &ExpertSlots<B>,
    products: &Products<B>,
) -> Result<Round<B>> {
    let missing: Round<B> = xs
        .iter()
        .zip(&kept)
        .filter(|(_, z)| z.is_none())
        .map(|(x, _)| x.clone())
        .collect();
    let adapters = missing.iter().map(|(e, _)| experts.lora_in(*e)).collect();
    let terms = low_rank_terms(&missing, adapters, products)?;
    let mut batch = products.batch();
    let queued: Vec<_> = missing
        .into_iter()
        .zip(terms)
        .map(|((e, x), term)| {
            let extra = term.map(|(u, v)| batch.push(u, v));
            (e, extra, batch.push(x, experts.w_in(e)))
        })
        .collect();
    let mut done = batch.run()?;
    let mut again = queued.into_iter();
    Ok(xs
        .iter()
        .zip(kept)
        .map(|(&(e, _), z)| {
            let z = z.unwrap_or_else(|| {
                let (_, extra, base) = again.next().expect("one recomputed `T_M` per missing one");
                let mut z = done.take(base);
                for term in done.take_some(extra).into_iter().chain(experts.b_in(e)) {
                    z = B::float_add(z, term);
                }
                z
            });
            (e, z)
        })
        .collect())
}

/// The backward of a round's second GEMMs `out = a · w_out + s · (a · a_out) · b_out + b_out`,
/// given the activations `acts` and the output gradients `gs`: adds the gradients of `w_out`,
/// `b_out` and the adapter to `acc` (frozen parts never computed) and returns each expert's
/// `grad_a`. Two batches: what needs only `a` and `g`, then the adapter's products that need
/// `v = s · g · b_outᵀ`.
///
/// # Shapes
/// - acts `[rows_e, d_hidden]`, gs `[rows_e, d_model]` → grad_a `[rows_e, d_hidden]`
fn second_gemm_backward<B: MoeBackend>(
    acts: &Round<B>,
    gs: &Round<B>,
    experts: &ExpertSlots<B>,
    acc: &mut ExpertGradAcc<B>,
    products: &Products<B>,
) -> Result<Vec<FloatTensor<B>>> {
    let t = B::float_transpose;
    let mut first = products.batch();
    let queued: Vec<_> = acts
        .iter()
        .zip(gs)
        .map(|((e, a), (_, g))| {
            let e = *e;
            let dw = acc.wants(Part::WOut).then(|| first.push(t(a.clone()), g.clone()));
            if experts.own().b_out.is_some() {
                acc.add_with(Part::BOut, e, || B::float_sum_dim(g.clone(), 0));
            }
            let grad_a = first.push(g.clone(), t(experts.w_out(e)));
            let lora = experts.lora_out(e).map(|l| {
                let v = first.push(g.clone(), t(l.b.clone()));
                let proj = acc
                    .wants(Part::LoraOutB)
                    .then(|| first.push(a.clone(), l.a.clone()));
                (l, v, proj)
            });
            (e, dw, grad_a, lora)
        })
        .collect();
    let mut done = first.run()?;
    let mut second = products.batch();
    let queued: Vec<_> = queued
        .into_iter()
        .zip(acts.iter().zip(gs))
        .map(|((e, dw, grad_a, lora), ((_, a), (_, g)))| {
            if let Some(dw) = dw {
                acc.add(Part::WOut, e, done.take(dw));
            }
            let lora = lora.map(|(l, v, proj)| {
                let v = l.scaled(done.take(v));
                let da = acc
                    .wants(Part::LoraOutA)
                    .then(|| second.push(t(a.clone()), v.clone()));
                let db = proj.map(|p| second.push(t(l.scaled(done.take(p))), g.clone()));
                (da, db, second.push(v, t(l.a)))
            });
            (e, done.take(grad_a), lora)
        })
        .collect();
    let mut done = second.run()?;
    Ok(queued
        .into_iter()
        .map(|(e, grad_a, lora)| match lora {
            None => grad_a,
            Some((da, db, through_a)) => {
                if let Some(da) = da {
                    acc.add(Part::LoraOutA, e, done.take(da));
                }
                if let Some(db) = db {
                    acc.add(Part::LoraOutB, e, done.take(db));
                }
                B::float_add(grad_a, done.take(through_a))
            }
        })
        .collect())
}

/// The backward of a round's first GEMMs `z = x · w_in + s · (x · a_in) · b_in + b_in`, given
/// the inputs `xs` and the gradients `grad_zs` of `z`: adds the gradients of `w_in`, `b_in`
/// and the adapter to `acc` and writes each expert's `grad_x` block into `grads_x`. Two
/// batches: the adapter's products that `v = s · grad_z · b_inᵀ` needs, then everything else
/// with the blocks.
///
/// # Shapes
/// - xs `[rows_e, d_model]`, grad_zs `[rows_e, d_hidden]` → grad_x blocks `[rows_e, d_model]`
fn first_gemm_backward<B: MoeBackend>(
    round: &[(usize, usize)],
    xs: &Round<B>,
    grad_zs: Round<B>,
    experts: &ExpertSlots<B>,
    acc: &mut ExpertGradAcc<B>,
    grads_x: &mut Blocks<'_, B>,
    products: &Products<B>,
) -> Result<()> {
    let t = B::float_transpose;
    let mut first = products.batch();
    let adapters: Vec<_> = xs
        .iter()
        .zip(&grad_zs)
        .map(|((e, x), (_, grad_z))| {
            experts.lora_in(*e).map(|l| {
                let v = first.push(grad_z.clone(), t(l.b.clone()));
                let proj = acc
                    .wants(Part::LoraInB)
                    .then(|| first.push(x.clone(), l.a.clone()));
                (l, v, proj)
            })
        })
        .collect();
    let mut done = first.run()?;
    let mut second = products.batch();
    let mut jobs = Vec::with_capacity(round.len());
    let mut grads = Vec::with_capacity(round.len());
    for (((&(e, rows), (_, x)), (_, grad_z)), lora) in round.iter().zip(xs).zip(grad_zs).zip(adapters) {
        let dw = acc
            .wants(Part::WIn)
            .then(|| second.push(t(x.clone()), grad_z.clone()));
        if experts.own().b_in.is_some() {
            acc.add_with(Part::BIn, e, || B::float_sum_dim(grad_z.clone(), 0));
        }
        let (mut da, mut db, mut low_rank) = (None, None, None);
        if let Some((l, v, proj)) = lora {
            let v = l.scaled(done.take(v));
            da = acc
                .wants(Part::LoraInA)
                .then(|| second.push(t(x.clone()), v.clone()));
            db = proj.map(|p| second.push(t(l.scaled(done.take(p))), grad_z.clone()));
            low_rank = Some((v, t(l.a)));
        }
        grads.push((e, dw, da, db));
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
    for (e, dw, da, db) in grads {
        for (part, q) in [(Part::WIn, dw), (Part::LoraInA, da), (Part::LoraInB, db)] {
            if let Some(q) = q {
                acc.add(part, e, done.take(q));
            }
        }
    }
    Ok(())
}
