//! The second GEMM's backward around one activation kernel (`Scope::Partition` on the arena):
//! the GEMM's input gradient first, which needs no activation, then the activation's value
//! and derivative from one kernel, then the gradients that need the value. The other order
//! (`backward.rs`) recomputes the value in a kernel of its own before anything else.

use burn::tensor::ops::FloatTensor;

use super::backward::{add_grads, factor_grads, LORA_OUT};
use super::{ExpertGradAcc, Scope};
use crate::error::Result;
use crate::exchange::blocks::Mem;
use crate::exchange::products::Products;
use crate::exchange::rows::LowRank;
use crate::exchange::shadows::ExpertSlots;
use crate::exchange::MoeBackend;
use crate::experts::ExpertPart as Part;

/// Whether the round's activation value and derivative come from one kernel, after the second
/// GEMM's input gradient: under [`Scope::Partition`], where the backend multiplies into the
/// arena (one expert a round, so one expert's value and derivative are all that is held at
/// once, and the extra batches an adapter's gradients then take cost no library call).
/// Elsewhere the value comes first, as the memory model replays it: with both at once an
/// expert's backward holds one more `[rows_e, d_hidden]` tensor.
pub(super) fn value_with_derivative<B: MoeBackend>(
    mem: Mem<'_, B>,
    products: &Products<B>,
    scope: Scope,
) -> bool {
    scope == Scope::Partition && mem.is_some() && !products.through_library()
}

/// An adapter's share of its GEMM's input gradient, kept for the adapter's own gradients:
/// `v = s · g · bᵀ` and the adapter.
type AdapterInput<B> = Option<(FloatTensor<B>, LowRank<B>)>;

/// Each expert's input gradient of its second GEMM, and its adapter's [`AdapterInput`].
type InputGrads<B> = (Vec<FloatTensor<B>>, Vec<AdapterInput<B>>);

/// The second GEMMs' input gradients of a round, before the activation's value exists (see
/// [`value_with_derivative`]): `g · w_outᵀ`, plus `v · a_outᵀ` for `v = s · g · b_outᵀ`
/// where the expert has an adapter there, over two batches; and `b_out`'s gradient where it
/// has one. Returns each expert's input gradient and its adapter's `v`.
///
/// # Shapes
/// - gs `[rows_e, d_model]` → grad_a `[rows_e, d_hidden]`, v `[rows_e, rank]`
pub(super) fn second_gemm_input_grads<B: MoeBackend>(
    round: &[(usize, usize)],
    gs: &[FloatTensor<B>],
    experts: &ExpertSlots<B>,
    acc: &mut ExpertGradAcc<B>,
    products: &Products<B>,
) -> Result<InputGrads<B>> {
    let t = B::float_transpose;
    let mut first = products.batch();
    let queued: Vec<_> = round
        .iter()
        .zip(gs)
        .map(|(&(e, _), g)| {
            if experts.own().b_out.is_some() {
                acc.add_with(Part::BOut, e, || B::float_sum_dim(g.clone(), 0));
            }
            let grad_a = first.push(g.clone(), t(experts.w_out(e)));
            let v = experts
                .lora_out(e)
                .map(|l| (first.push(g.clone(), t(l.b.clone())), l));
            (grad_a, v)
        })
        .collect();
    let mut done = first.run()?;
    let mut second = products.batch();
    let queued: Vec<_> = queued
        .into_iter()
        .map(|(grad_a, v)| {
            let v = v.map(|(v, l)| {
                let v = l.scaled(done.take(v));
                let through_a = second.push(v.clone(), t(l.a.clone()));
                (v, l, through_a)
            });
            (done.take(grad_a), v)
        })
        .collect();
    let mut done = second.run()?;
    Ok(queued
        .into_iter()
        .map(|(grad_a, v)| match v {
            None => (grad_a, None),
            Some((v, l, through_a)) => (B::float_add(grad_a, done.take(through_a)), Some((v, l))),
        })
        .unzip())
}

/// The second GEMMs' weight gradients of a round from the activations `acts`: `w_out`'s
/// `aᵀ · g` (written in place where `mem` allows, [`ExpertGradAcc::product`]), and where an
/// expert has an adapter there, its factors' ([`factor_grads`], after `a · a_out` in a first
/// batch; `adapters` from [`second_gemm_input_grads`]). Frozen parts are never computed.
///
/// # Shapes
/// - acts `[rows_e, d_hidden]`, gs `[rows_e, d_model]`
pub(super) fn second_gemm_weight_grads<B: MoeBackend>(
    round: &[(usize, usize)],
    (acts, gs): (&[FloatTensor<B>], &[FloatTensor<B>]),
    adapters: Vec<AdapterInput<B>>,
    (acc, mem): (&mut ExpertGradAcc<B>, Mem<'_, B>),
    products: &Products<B>,
) -> Result<()> {
    let t = B::float_transpose;
    let mut first = products.batch();
    let mut queued = Vec::with_capacity(round.len());
    for ((&(e, _), (a, g)), adapter) in round.iter().zip(acts.iter().zip(gs)).zip(adapters) {
        let dw = acc.product(Part::WOut, e, (t(a.clone()), g.clone()), mem, &mut first)?;
        let adapter = adapter.map(|(v, l)| {
            let proj = acc.wants(LORA_OUT[1]).then(|| first.push(a.clone(), l.a.clone()));
            (v, l, proj)
        });
        queued.push((e, dw, adapter));
    }
    let mut done = first.run()?;
    let mut second = products.batch();
    let mut pending = Vec::with_capacity(queued.len());
    for ((e, dw, adapter), (a, g)) in queued.into_iter().zip(acts.iter().zip(gs)) {
        add_grads(acc, e, vec![(Part::WOut, dw)], &mut done);
        if let Some((v, l, proj)) = adapter {
            let proj = proj.map(|p| done.take(p));
            let grads = factor_grads(&l, (e, a, g), (&v, proj), (acc, mem), LORA_OUT, &mut second)?;
            pending.push((e, grads));
        }
    }
    let mut done = second.run()?;
    for (e, grads) in pending {
        add_grads(acc, e, grads, &mut done);
    }
    Ok(())
}
