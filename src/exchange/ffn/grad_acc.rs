//! The running sums of the expert weight gradients over a pass's partitions
//! ([`ExpertGradAcc`]).

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};

use super::in_place::InPlaceSums;
use crate::comm::Communicator;
use crate::error::Result;
use crate::exchange::blocks::Mem;
use crate::exchange::products::{ProductBatch, Queued};
use crate::exchange::rows::float_dtype;
use crate::exchange::shadows::ExpertSlots;
use crate::exchange::MoeBackend;
use crate::experts::{ExpertGrads, ExpertPart as Part, ExpertTensors, EXPERT_PARTS};

/// Expert weight gradients summed over partitions, one running sum per expert slot and
/// [`Part`] (the adds happen in place where the backend owns the sum uniquely), stacked once at
/// the end: a reshape when the rank holds one expert, a single concatenation otherwise.
/// (Accumulating straight into the stacked tensor through slice views measured ~40x slower on
/// Flex.) The slots of shadow copies are summed onto their owners' slots first
/// ([`fold_shadows`](Self::fold_shadows)); what is stacked has the own experts' shape. Parts
/// the run marks frozen are never computed nor summed.
///
/// A device library ([`Library`]) keeps its sums stacked instead (`stacked`, every slot, added
/// to in place by its GEMMs): without shadows they are the gradients as they stand. So do the
/// primitives' weight products where the backend has the partition arena's ops and there are
/// no shadows ([`product`](Self::product), `in_place.rs`).
pub(crate) struct ExpertGradAcc<B: MoeBackend> {
    sums: [Vec<Option<FloatTensor<B>>>; EXPERT_PARTS],
    /// Every slot's running sums, stacked, where a device library adds them.
    pub(super) stacked: Option<ExpertTensors<B>>,
    /// The weights' sums the primitives multiply straight into their stacked gradient.
    in_place: InPlaceSums<B>,
    like: ExpertTensors<B>,
    n_slots: usize,
    frozen: [bool; EXPERT_PARTS],
}

impl<B: MoeBackend> ExpertGradAcc<B> {
    /// Empty sums for `experts`' slots, `frozen` parts never summed. `idle_slot` says whether
    /// some slot gets no rows in the whole pass (its gradients are then zeros).
    pub(crate) fn new(experts: &ExpertSlots<B>, frozen: [bool; EXPERT_PARTS], idle_slot: bool) -> Self {
        let n = experts.n_slots();
        Self {
            sums: std::array::from_fn(|_| (0..n).map(|_| None).collect()),
            stacked: None,
            in_place: InPlaceSums::new(idle_slot),
            like: experts.own().clone(),
            n_slots: n,
            frozen,
        }
    }

    /// The stacked running sums of every slot; before the first partition, uninitialised
    /// tensors that the path writes whole (the job's `fresh`): zero-filling them would cost a
    /// pass over every expert's weights per step.
    pub(super) fn take_stacked(&mut self) -> ExpertTensors<B> {
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
                    crate::exchange::rows::expert_matrix::<B>(&tensor, e)
                } else {
                    crate::exchange::rows::expert_row::<B>(&tensor, e)
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
    pub(super) fn add_with(&mut self, part: Part, e: usize, grad: impl FnOnce() -> FloatTensor<B>) {
        self.try_add_with(part, e, || Ok(grad()))
            .expect("an infallible gradient");
    }

    /// [`add_with`](Self::add_with) for a gradient whose product may fail (a device library's).
    pub(super) fn try_add_with(
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

    /// Expert `e`'s gradient of matrix `part` (a weight, or an adapter's factor),
    /// `lhs · rhs`: multiplied straight into the
    /// stacked gradient where `mem` has the arena's ops, the batch multiplies on the backend,
    /// there are no shadow slots and the weight's matrices can be bound as views
    /// (`in_place.rs`), and queued in `batch` otherwise, for [`add`](Self::add). Returns what
    /// was queued: nothing where the product was written, or where the part is frozen (then
    /// it is never computed).
    ///
    /// # Shapes
    /// - lhs `[rows, m]`, rhs `[m, cols]`: the part's matrix of one expert is `[rows, cols]`
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the backend cannot launch the GEMM.
    pub(super) fn product(
        &mut self,
        part: Part,
        e: usize,
        (lhs, rhs): (FloatTensor<B>, FloatTensor<B>),
        mem: Mem<'_, B>,
        batch: &mut ProductBatch<'_, B>,
    ) -> Result<Option<Queued>> {
        if self.frozen[part as usize] {
            return Ok(None);
        }
        let n_own = self.like.w_in.shape()[0];
        let alone = self.n_slots == n_own && self.stacked.is_none() && !batch.through_library();
        match (mem, self.like.part(part)) {
            (Some(memory), Some(like)) if alone && InPlaceSums::fits(like, memory) => {
                self.in_place.add(part as usize, e, (lhs, rhs), like, memory)?;
                Ok(None)
            }
            _ => Ok(Some(batch.push(lhs, rhs))),
        }
    }

    /// Whether `part`'s gradient is summed (the part is not frozen): where it is not, its
    /// product is never computed.
    pub(super) fn wants(&self, part: Part) -> bool {
        !self.frozen[part as usize]
    }

    /// Adds an already computed `grad` to `part`'s running sum for expert `e` (see
    /// [`wants`](Self::wants)).
    pub(super) fn add(&mut self, part: Part, e: usize, grad: FloatTensor<B>) {
        self.add_with(part, e, || grad);
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
        sums.extend(self.in_place.held());
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
                let mut in_place = self.in_place;
                let mut sums = self.sums.into_iter().zip(frozen).enumerate();
                ExpertGrads {
                    parts: likes.map(|like| {
                        let (part, (sums, frozen)) = sums.next().expect("one table per part");
                        // A frozen part is not stacked: that would be zeros the size of a weight.
                        in_place
                            .take(part)
                            .or_else(|| like.filter(|_| !frozen).map(|like| Self::stack(sums, &like)))
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
