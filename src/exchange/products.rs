//! How the experts' primitives multiply: the backend's own expert product, or, where the
//! communicator offers a device library for the backend, that library's dense product at the
//! run's GEMM precision.
//!
//! A library takes whole partitions only for plain experts (`ffn::Library`); experts with
//! low-rank adapters, and runs that freeze a part, go through the primitives. On CUDA the
//! backend's own product is cubecl's, which multiplies f32 in TF32 whatever the config asks:
//! without this, a LoRA run asked for IEEE f32 or bf16 would have multiplied its experts in
//! TF32 without a word. Through the library (cuBLAS) each product is at the precision asked.
//!
//! The primitives queue each step's independent products in a [`ProductBatch`], which a
//! library runs in one call ([`ExpertPath::matmuls`]), and the backend's product one by one.

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
    /// A library may take every expert of a partition in one round (see
    /// [`experts_per_round`](Self::experts_per_round)).
    whole_rounds: bool,
}

impl<B: MoeBackend> Products<B> {
    /// The device library `comm` offers for `B`, at `precision`, where it offers one; the
    /// backend's own product otherwise. `whole_rounds`: a library may take every expert's
    /// products of a step in one round (the run's
    /// [`partition_transients`](crate::exchange::ExchangeRun::partition_transients)).
    pub(crate) fn of(comm: &dyn Communicator, precision: GemmPrecision, whole_rounds: bool) -> Self {
        Self {
            library: comm
                .row_paths()
                .and_then(|p| p.experts::<B>())
                .map(|path| (path, precision)),
            whole_rounds,
        }
    }

    /// Whether the products go through a device library.
    pub(crate) fn through_library(&self) -> bool {
        self.library.is_some()
    }

    /// How many experts the primitives take through one round of products: every expert of
    /// the partition where a device library multiplies and the run allows a partition's
    /// transients at once (each library call is a section with a hand-over and a trip to the
    /// device thread, so the products of all experts go in one), one at a time otherwise (the
    /// backend's products cost a launch each, and one expert's temporaries at a time keep the
    /// peak where the memory model puts it: a round of every expert holds every expert's
    /// activation at once, which a memory budget's model does not replay).
    pub(crate) fn experts_per_round(&self, n_experts: usize) -> usize {
        match (&self.library, self.whole_rounds) {
            (Some(_), true) => n_experts.max(1),
            _ => 1,
        }
    }

    /// An empty batch of independent products, run together by [`ProductBatch::run`].
    pub(crate) fn batch(&self) -> ProductBatch<'_, B> {
        ProductBatch {
            products: self,
            pairs: Vec::new(),
        }
    }
}

/// Independent products: `path`'s [`ExpertPath::matmuls`] where there is a path (one result per
/// pair, or an error), the backend's [`expert_matmul`](MoeBackend::expert_matmul) each
/// otherwise.
///
/// # Errors
/// [`MoeError::Backend`](crate::MoeError::Backend) if the library fails or returns another
/// number of results.
pub(crate) fn matmuls<B: MoeBackend>(
    path: Option<&dyn ExpertPath<B>>,
    pairs: Vec<(FloatTensor<B>, FloatTensor<B>)>,
    precision: GemmPrecision,
) -> Result<Vec<FloatTensor<B>>> {
    let Some(path) = path else {
        return Ok(pairs
            .into_iter()
            .map(|(lhs, rhs)| B::expert_matmul(lhs, rhs))
            .collect());
    };
    let n = pairs.len();
    let out = path.matmuls(pairs, precision)?;
    match out.len() == n {
        true => Ok(out),
        false => Err(crate::MoeError::Backend(format!(
            "a device library returned {} products for {n} asked",
            out.len()
        ))),
    }
}

/// A product queued in a [`ProductBatch`]: where its result is in the batch's [`Done`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a queued product's result is taken with Done::take"]
pub(crate) struct Queued(usize);

/// Independent products queued to run together: through a device library, in one call
/// ([`ExpertPath::matmuls`]: one section on CUDA); otherwise one backend product each, in the
/// order queued.
pub(crate) struct ProductBatch<'a, B: MoeBackend> {
    products: &'a Products<B>,
    pairs: Vec<(FloatTensor<B>, FloatTensor<B>)>,
}

impl<B: MoeBackend> ProductBatch<'_, B> {
    /// Queues `lhs · rhs`. The operands may be transposed views.
    ///
    /// # Shapes
    /// - lhs: `[m, k]`, rhs: `[k, n]` → `[m, n]`
    pub(crate) fn push(&mut self, lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> Queued {
        self.pairs.push((lhs, rhs));
        Queued(self.pairs.len() - 1)
    }

    /// Whether the batch runs through a device library (else each product is the backend's).
    pub(crate) fn through_library(&self) -> bool {
        self.products.through_library()
    }

    /// Runs every queued product (none: no call at all).
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the library fails.
    pub(crate) fn run(self) -> Result<Done<B>> {
        let results = match (&self.products.library, self.pairs.is_empty()) {
            (_, true) => Vec::new(),
            (Some((path, precision)), false) => matmuls(Some(path.as_ref()), self.pairs, *precision)?,
            // Without a path the backend multiplies as it always does: no precision to pass.
            (None, false) => matmuls::<B>(None, self.pairs, GemmPrecision::default())?,
        };
        Ok(Done(results.into_iter().map(Some).collect()))
    }
}

/// The results of a [`ProductBatch`], each taken once by its [`Queued`].
pub(crate) struct Done<B: MoeBackend>(Vec<Option<FloatTensor<B>>>);

impl<B: MoeBackend> Done<B> {
    /// The result of `q`.
    ///
    /// # Panics
    /// If `q` is not of this batch or was taken before (a caller's bug).
    pub(crate) fn take(&mut self, q: Queued) -> FloatTensor<B> {
        self.0[q.0].take().expect("each queued product is taken once")
    }

    /// [`take`](Self::take) where a product was queued.
    pub(crate) fn take_some(&mut self, q: Option<Queued>) -> Option<FloatTensor<B>> {
        q.map(|q| self.take(q))
    }
}
