//! The experts' weight gradients (and their adapters' factors') multiplied straight into their
//! stacked tensor ([`InPlaceSums`]), where the backend has the partition arena's ops (the
//! CubeCL backends).
//!
//! Without them each expert's `xᵀ · g` is a tensor of its own, summed over the partitions and
//! concatenated into the stacked gradient at the end of the backward (`grad_acc.rs`): a copy of
//! every expert weight's gradient a step, one launch per expert and weight on a GPU, and for
//! a moment two copies of a weight's gradients at the backward's end. Here the first
//! partition's product of an expert is written by the GEMM into that expert's matrix of the
//! stacked gradient ([`SlotMemory::gemm_into`] on a view, as the arena's partition blocks are
//! written), and each later partition's product is added there in place
//! ([`SlotMemory::add_into`]). The backward ends with the gradient stacked.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};

use crate::error::Result;
use crate::exchange::arena::SlotMemory;
use crate::exchange::rows::float_dtype;
use crate::exchange::MoeBackend;
use crate::experts::EXPERT_PARTS;

/// One weight's stacked gradient, written expert by expert.
struct Stacked<B: MoeBackend> {
    /// Every slot's matrix, one after another. `[n_slots · rows, cols]`
    tensor: FloatTensor<B>,
    /// `[n_slots, rows, cols]`: the weight's shape.
    dims: [usize; 3],
    /// Whether each slot's matrix holds a product yet (else it holds zeros, or nothing).
    written: Vec<bool>,
}

/// The stacked weight gradients written in place (see the module docs), by part.
pub(super) struct InPlaceSums<B: MoeBackend> {
    parts: [Option<Stacked<B>>; EXPERT_PARTS],
    /// Whether some slot gets no rows in the whole pass: its matrices must read zero, so each
    /// stacked gradient starts zeroed. Otherwise it starts unwritten, since every matrix is
    /// written whole by its first product (a zero fill would be a pass over every expert
    /// weight's gradient a step).
    zeroed: bool,
}

impl<B: MoeBackend> InPlaceSums<B> {
    /// Nothing written yet; `zeroed` as the field says.
    pub(super) fn new(zeroed: bool) -> Self {
        Self {
            parts: std::array::from_fn(|_| None),
            zeroed,
        }
    }

    /// Whether a weight shaped like `like` (`[n_slots, rows, cols]`) can be written in place
    /// through `memory`: each slot's matrix must start where the arena can bind a view, at a
    /// multiple of its row alignment.
    pub(super) fn fits(like: &FloatTensor<B>, memory: &dyn SlotMemory<B>) -> bool {
        match like.shape().to_vec()[..] {
            [_, rows, cols] => rows > 0 && cols > 0 && rows % memory.row_align(cols) == 0,
            _ => false,
        }
    }

    /// Adds `lhs · rhs` to slot `e`'s matrix of `part`'s stacked gradient (shaped like `like`,
    /// which [`fits`](Self::fits)): the GEMM writes it there if it is the slot's first, else
    /// its product is added there in place.
    ///
    /// # Shapes
    /// - lhs `[rows, m]`, rhs `[m, cols]`, like `[n_slots, rows, cols]`
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the backend cannot launch the GEMM.
    pub(super) fn add(
        &mut self,
        part: usize,
        e: usize,
        (lhs, rhs): (FloatTensor<B>, FloatTensor<B>),
        like: &FloatTensor<B>,
        memory: &dyn SlotMemory<B>,
    ) -> Result<()> {
        let zeroed = self.zeroed;
        let stacked = self.parts[part].get_or_insert_with(|| Stacked::new(like, zeroed));
        let [_, rows, _] = stacked.dims;
        let view = memory.rows(&stacked.tensor, e * rows, rows);
        if stacked.written[e] {
            memory.add_into(&view, B::expert_matmul(lhs, rhs));
        } else {
            memory.gemm_into(&view, lhs, rhs, None)?;
            stacked.written[e] = true;
        }
        Ok(())
    }

    /// `part`'s stacked gradient in the weight's shape, if it was written here.
    pub(super) fn take(&mut self, part: usize) -> Option<FloatTensor<B>> {
        let stacked = self.parts[part].take()?;
        Some(B::float_reshape(
            stacked.tensor,
            Shape::from(stacked.dims.to_vec()),
        ))
    }

    /// The stacked gradients written so far (handles for a caller that must hold them).
    pub(super) fn held(&self) -> impl Iterator<Item = FloatTensor<B>> + '_ {
        self.parts.iter().flatten().map(|s| s.tensor.clone())
    }
}

impl<B: MoeBackend> Stacked<B> {
    /// A stacked gradient shaped like `like`, as rows: zeros where `zeroed`, else unwritten.
    fn new(like: &FloatTensor<B>, zeroed: bool) -> Self {
        let dims: [usize; 3] = like
            .shape()
            .to_vec()
            .try_into()
            .expect("`fits` took a weight of three dimensions");
        let shape = Shape::new([dims[0] * dims[1], dims[2]]);
        let (device, dtype) = (B::float_device(like), float_dtype::<B>(like));
        let tensor = match zeroed {
            true => B::float_zeros(shape, &device, dtype),
            false => B::write_buffer(shape, &device, dtype),
        };
        Self {
            tensor,
            dims,
            written: vec![false; dims[0]],
        }
    }
}
