//! The expert slots one exchange runs when the layer shadows hot experts: this rank's own
//! experts, then a copy of each shadowed expert, broadcast by its owner inside the op; and, in
//! backward, the copies' gradients summed over the ranks onto the owner's own slot
//! ([`ExpertGradAcc::fold_shadows`](super::ffn::ExpertGradAcc::fold_shadows)).
//!
//! Inside the op, not around it: built from autodiff ops around the exchange, the copies cost
//! a concatenation of every own expert with them each step, a flatten and unflatten of the
//! copies, and in backward the split of the stacked gradients, a zero gradient of the own
//! experts with the copies' sum written into it, and its addition to the own gradient (about
//! 17% of a shadowed GPT3-S step on Flex in a profile, BENCHMARKS §11). Here the own experts
//! are read where they are, the copies are the broadcast's outputs, and the sum lands on the
//! owner's running gradient of that expert before the one stacking every backward does.

use std::sync::Arc;

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Slice, TensorMetadata};

use super::adapter_scales::AdapterScales;
use super::rows::{index, LowRank};
use super::MoeBackend;
use crate::comm::Communicator;
use crate::error::{MoeError, Result};
use crate::experts::{ExpertGrads, ExpertTensors, EXPERT_PARTS};

/// The experts of one exchange, by slot: this rank's own (slots `0..n_own`), then the copies
/// of the shadowed experts in the order of the run's list.
#[derive(Debug, Clone)]
pub(crate) struct ExpertSlots<B: MoeBackend> {
    own: ExpertTensors<B>,
    copies: Option<ExpertTensors<B>>,
    n_own: usize,
    /// The adapters' scales, folded into their `b` factors (`adapter_scales.rs`).
    scales: AdapterScales,
}

impl<B: MoeBackend> ExpertSlots<B> {
    /// This rank's experts `own` and a copy of each expert in `shadows` (global indices,
    /// increasing; experts are numbered owner by owner, `n_own` per rank), each owner's
    /// shadows broadcast by it to every rank: one [`MoeBackend::broadcast`] per owner and
    /// parameter, in owner order, the same on every rank. The adapters' scales are folded into
    /// their `b` factors first ([`AdapterScales::fold`]), so the copies carry them too.
    ///
    /// # Errors
    /// [`MoeError::Input`] if `shadows` is not increasing or names an expert no rank owns;
    /// [`MoeError::Comm`] if a peer fails in a broadcast.
    pub(crate) fn new(
        own: ExpertTensors<B>,
        shadows: &[usize],
        comm: &Arc<dyn Communicator>,
    ) -> Result<Self> {
        let n_own = own.w_in.shape().to_vec()[0];
        let n_experts = n_own * comm.n_ranks();
        if shadows.windows(2).any(|w| w[0] >= w[1]) || shadows.iter().any(|&e| e >= n_experts) {
            return Err(MoeError::Input(format!(
                "exchange run's shadows {shadows:?}: expected distinct experts in increasing \
                 order below {n_experts} ({n_own} per rank over {} ranks)",
                comm.n_ranks()
            )));
        }
        let (own, scales) = AdapterScales::fold(own);
        if shadows.is_empty() {
            return Ok(Self {
                own,
                copies: None,
                n_own,
                scales,
            });
        }
        let mut groups: Vec<ExpertTensors<B>> = Vec::new();
        for group in shadows.chunk_by(|a, b| a / n_own == b / n_own) {
            let root = group[0] / n_own;
            // Every rank passes the same slots of its own experts: the root's are what travels,
            // the others' only give the broadcast its shape and are not read.
            let local: Vec<usize> = group.iter().map(|&e| e % n_own).collect();
            // One broadcast per part in table order (adapters' factors included), the same
            // on every rank.
            let send = |t: FloatTensor<B>| B::broadcast(take_slots::<B>(&t, &local), root, comm);
            groups.push(own.clone().try_map(send)?);
        }
        let copies = if groups.len() == 1 {
            groups.pop().expect("one group")
        } else {
            let mut columns: [Vec<FloatTensor<B>>; EXPERT_PARTS] = Default::default();
            for group in groups {
                for (column, part) in columns.iter_mut().zip(group.into_parts()) {
                    column.extend(part);
                }
            }
            let parts = columns.map(|c| (!c.is_empty()).then(|| B::float_cat(c, 0)));
            ExpertTensors::from_parts(parts, &own)
        };
        Ok(Self {
            own,
            copies: Some(copies),
            n_own,
            scales,
        })
    }

    /// The stacked groups the slots live in, as a device library reads them: the own experts,
    /// then the copies; with the step's store `step` (a backward's: its forward's).
    pub(crate) fn groups(&self, step: super::PassStore) -> super::ExpertGroups<B> {
        super::ExpertGroups::with_step(
            std::iter::once(self.own.clone())
                .chain(self.copies.clone())
                .collect(),
            step,
        )
    }

    /// The gradients of the experts the caller passed from those the exchange summed, which are
    /// of the folded adapters ([`AdapterScales::unfold`]).
    pub(crate) fn unfold_grads(&self, grads: ExpertGrads<B>) -> ExpertGrads<B> {
        self.scales.unfold(grads)
    }

    /// Slots: own experts plus copies.
    pub(crate) fn n_slots(&self) -> usize {
        self.n_own + self.copies.as_ref().map_or(0, |c| c.w_in.shape().to_vec()[0])
    }

    /// This rank's own experts, the shape of the gradients the exchange returns.
    pub(crate) fn own(&self) -> &ExpertTensors<B> {
        &self.own
    }

    /// The stacked tensors slot `e` lives in, and its index there.
    fn at(&self, e: usize) -> (&ExpertTensors<B>, usize) {
        match &self.copies {
            Some(copies) if e >= self.n_own => (copies, e - self.n_own),
            _ => (&self.own, e),
        }
    }

    /// Slot `e`'s first matrix. `[d_model, d_inner]`
    pub(crate) fn w_in(&self, e: usize) -> FloatTensor<B> {
        let (t, i) = self.at(e);
        t.w_in_of(i)
    }

    /// Slot `e`'s second matrix. `[d_hidden, d_model]`
    pub(crate) fn w_out(&self, e: usize) -> FloatTensor<B> {
        let (t, i) = self.at(e);
        t.w_out_of(i)
    }

    /// Slot `e`'s first bias, where the experts have one. `[1, d_inner]`
    pub(crate) fn b_in(&self, e: usize) -> Option<FloatTensor<B>> {
        let (t, i) = self.at(e);
        t.b_in_of(i)
    }

    /// Slot `e`'s second bias, where the experts have one. `[1, d_model]`
    pub(crate) fn b_out(&self, e: usize) -> Option<FloatTensor<B>> {
        let (t, i) = self.at(e);
        t.b_out_of(i)
    }

    /// Slot `e`'s adapter on its first matrix, where the experts have adapters.
    pub(crate) fn lora_in(&self, e: usize) -> Option<LowRank<B>> {
        let (t, i) = self.at(e);
        t.lora_in_of(i)
    }

    /// Slot `e`'s adapter on its second matrix, where the experts have adapters.
    pub(crate) fn lora_out(&self, e: usize) -> Option<LowRank<B>> {
        let (t, i) = self.at(e);
        t.lora_out_of(i)
    }

    /// `d_inner`, the width of the first GEMM's output.
    pub(crate) fn d_inner(&self) -> usize {
        self.own.w_in.shape().to_vec()[2]
    }
}

/// Rows `slots` (local indices, increasing) of a stacked expert tensor: a slice where they are
/// consecutive (a view, nothing copied), a gather otherwise.
fn take_slots<B: MoeBackend>(t: &FloatTensor<B>, slots: &[usize]) -> FloatTensor<B> {
    let dims = t.shape().to_vec();
    let (first, last) = (slots[0], slots[slots.len() - 1]);
    if last - first + 1 == slots.len() {
        let mut ranges: Vec<Slice> = dims.iter().map(|&d| Slice::from(0..d)).collect();
        ranges[0] = Slice::from(first..last + 1);
        return B::float_slice(t.clone(), &ranges);
    }
    B::float_select(t.clone(), 0, index::<B>(slots, &B::float_device(t)))
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::ops::FloatTensor;
    use burn::tensor::{Tensor, TensorData, TensorPrimitive};

    use super::ExpertSlots;
    use crate::comm::LocalGroup;
    use crate::error::MoeError;
    use crate::experts::ExpertTensors;

    type B = NdArray;

    /// `[n, rows, cols]` whose every element names its rank and slot: `100·rank + slot`.
    fn stacked(rank: usize, n: usize, rows: usize, cols: usize) -> FloatTensor<B> {
        let values: Vec<f32> = (0..n * rows * cols)
            .map(|i| (100 * rank + i / (rows * cols)) as f32)
            .collect();
        Tensor::<B, 3>::from_data(TensorData::new(values, [n, rows, cols]), &Default::default())
            .into_primitive()
            .tensor()
    }

    /// Rank `rank`'s three experts, `[3, 2, 4]` and `[3, 4, 2]`, without biases.
    fn own(rank: usize) -> ExpertTensors<B> {
        ExpertTensors::plain(stacked(rank, 3, 2, 4), None, stacked(rank, 3, 4, 2), None)
    }

    /// Three experts per rank over two ranks, shadows 0 and 2 (rank 0's, not consecutive: a
    /// gather) and 4 (rank 1's slot 1, a slice): every rank's copies are the owners' experts,
    /// in the list's order, and its own slots stay its own. A copy taken from the wrong
    /// owner, slot or rank fails it.
    #[test]
    fn copies_are_the_owners_experts_in_the_lists_order() {
        let seen = LocalGroup::run(2, |ctx| {
            let slots = ExpertSlots::new(own(ctx.rank), &[0, 2, 4], &ctx.comm)?;
            assert_eq!(slots.n_slots(), 6);
            Ok((0..6)
                .map(|e| {
                    let w_in = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(slots.w_in(e)));
                    let w_out = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(slots.w_out(e)));
                    let value = |t: Tensor<B, 2>| t.into_data().to_vec::<f32>().expect("f32")[0];
                    (value(w_in), value(w_out))
                })
                .collect::<Vec<_>>())
        })
        .expect("two ranks");
        for (rank, slots) in seen.iter().enumerate() {
            let own = (0..3).map(|s| (100 * rank + s) as f32);
            let want: Vec<(f32, f32)> = own.chain([0.0, 2.0, 101.0]).map(|v| (v, v)).collect();
            assert_eq!(slots, &want, "rank {rank}");
        }
    }

    /// A list out of order, repeated, or past the last expert is the caller's error, named.
    #[test]
    fn a_bad_shadow_list_is_an_input_error() {
        for bad in [vec![2, 1], vec![1, 1], vec![6]] {
            let errors = LocalGroup::run(
                2,
                |ctx| Ok(ExpertSlots::new(own(ctx.rank), &bad, &ctx.comm).err()),
            )
            .expect("no collective ran");
            for err in errors {
                assert!(
                    matches!(&err, Some(MoeError::Input(m)) if m.contains("shadows")),
                    "{bad:?}: {err:?}"
                );
            }
        }
    }
}
