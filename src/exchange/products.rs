//! How the experts' primitives multiply: the backend's own expert product, or, where the
//! communicator offers a device library for the backend, that library's dense product at the
//! run's GEMM precision.
//!
//! A library takes whole partitions only for plain experts (`ffn::Library`); experts with
//! low-rank adapters, and runs that freeze a part, go through the primitives. On CUDA the
//! backend's own product is cubecl's, which multiplies f32 in TF32 whatever the config asks:
//! without this, a LoRA run asked for IEEE f32 or bf16 would have multiplied its experts in
//! TF32 without a word. Through the library (cuBLAS) each product is at the precision asked.

use std::sync::Arc;

use burn::tensor::ops::FloatTensor;

use super::expert_path::{ExpertPath, GemmPrecision};
use super::MoeBackend;
use crate::comm::Communicator;
use crate::error::Result;

/// The primitives' product for one pass (see the module docs).
#[derive(Clone)]
pub(crate) struct Products<B: MoeBackend> {
    library: Option<(Arc<dyn ExpertPath<B>>, GemmPrecision)>,
}

impl<B: MoeBackend> Products<B> {
    /// The device library `comm` offers for `B`, at `precision`, where it offers one; the
    /// backend's own product otherwise.
    pub(crate) fn of(comm: &dyn Communicator, precision: GemmPrecision) -> Self {
        Self {
            library: comm
                .row_paths()
                .and_then(|p| p.experts::<B>())
                .map(|path| (path, precision)),
        }
    }

    /// Whether the products go through a device library.
    pub(crate) fn through_library(&self) -> bool {
        self.library.is_some()
    }

    /// `lhs · rhs`. The operands may be transposed views.
    ///
    /// # Shapes
    /// - lhs: `[m, k]`, rhs: `[k, n]` → `[m, n]`
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the library fails.
    pub(crate) fn mm(&self, lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> Result<FloatTensor<B>> {
        match &self.library {
            Some((path, precision)) => path.matmul(lhs, rhs, *precision),
            None => Ok(B::expert_matmul(lhs, rhs)),
        }
    }
}
