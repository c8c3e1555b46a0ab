//! Summing gradients over the ranks that hold copies of the same parameters, on the device.
//!
//! After `loss.backward()`, every rank holds the gradient of its own share of the loss. A
//! replicated parameter's gradients are summed over all ranks (so that every replica takes
//! the same step, the gradient of the global-batch loss, as the layer's losses are shares of
//! it); an expert's gradient is complete on the rank that holds the expert, and is summed only
//! over the data-parallel replicas of those experts ([`ParallelGroups`](super::ParallelGroups)).
//!
//! The gradients are summed in buckets: consecutive parameters (in the model's visiting order,
//! the same on every rank) are flattened and concatenated on the device into buckets of about
//! `bucket_bytes`, each bucket is summed by one
//! [`MoeBackend::all_reduce_sum`](crate::MoeBackend::all_reduce_sum) (NCCL's all-reduce on
//! the bucket's device buffer on CUDA; one host copy and an f32 all-reduce in memory on the
//! CPU ranks), and the sums are registered back as views of the summed buckets. A rank on
//! which a parameter got no gradient (none of its tokens reached it) contributes zeros, so
//! every rank issues the same collectives.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorPrimitive};

use super::roles::{param_roles, ParamEntry, ParamRole};
use crate::comm::Communicator;
use crate::error::{MoeError, Result};
use crate::exchange::MoeBackend;

/// The bucket size of [`sync_replicated_grads`]: PyTorch DDP's default, large enough that the
/// per-collective latency is paid a few times per step, small enough that a bucket's copy is
/// a small part of the gradients' memory.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// What one gradient synchronisation did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Parameters whose gradients were summed.
    pub params: usize,
    /// Elements summed.
    pub elements: usize,
    /// All-reduces issued (one per bucket).
    pub buckets: usize,
    /// Parameters this rank had no gradient for (it contributed zeros).
    pub missing: usize,
}

/// Sums the gradients of every replicated parameter of `model` over the ranks of `comm`, in
/// place in `grads`: afterwards every rank holds the same gradients for them, the sum of all
/// ranks' gradients. Expert gradients and buffers are left as they are.
///
/// Every rank of `comm` must call it with the same model structure (it checks: the parameter
/// paths and shapes are compared in one small collective first).
///
/// # Errors
/// [`MoeError::Comm`] if a peer fails or the ranks' models differ.
pub fn sync_replicated_grads<B, M>(
    model: &M,
    grads: &mut GradientsParams,
    comm: &dyn Communicator,
) -> Result<SyncReport>
where
    B: AutodiffBackend,
    B::InnerBackend: MoeBackend,
    M: AutodiffModule<B>,
{
    sync_grads_of(model, grads, comm, ParamRole::Replicated, DEFAULT_BUCKET_BYTES)
}

/// Sums the gradients of the experts of `model` over `comm`, the group of data-parallel
/// replicas that hold the same experts (the expert-data-parallel group of
/// [`ParallelGroups`](super::ParallelGroups)). Without data parallelism that group is one rank
/// and nothing is done.
///
/// # Errors
/// As [`sync_replicated_grads`].
pub fn sync_expert_grads<B, M>(
    model: &M,
    grads: &mut GradientsParams,
    comm: &dyn Communicator,
) -> Result<SyncReport>
where
    B: AutodiffBackend,
    B::InnerBackend: MoeBackend,
    M: AutodiffModule<B>,
{
    sync_grads_of(model, grads, comm, ParamRole::Expert, DEFAULT_BUCKET_BYTES)
}

/// Sums over `comm` the gradients of the parameters of `role`, in buckets of about
/// `bucket_bytes` (at least one parameter each).
///
/// # Errors
/// As [`sync_replicated_grads`].
pub fn sync_grads_of<B, M>(
    model: &M,
    grads: &mut GradientsParams,
    comm: &dyn Communicator,
    role: ParamRole,
    bucket_bytes: usize,
) -> Result<SyncReport>
where
    B: AutodiffBackend,
    B::InnerBackend: MoeBackend,
    M: AutodiffModule<B>,
{
    let entries = param_roles::<B, M>(model);
    let chosen: Vec<&ParamEntry> = entries
        .iter()
        .filter(|e| e.role == role && e.numel() > 0)
        .collect();
    let mut report = SyncReport {
        params: chosen.len(),
        elements: chosen.iter().map(|e| e.numel()).sum(),
        ..SyncReport::default()
    };
    if comm.n_ranks() == 1 || chosen.is_empty() {
        return Ok(report);
    }
    check_same_layout(comm, role, &chosen)?;

    let mut gather = Gather::<B::InnerBackend> {
        grads,
        entries: &entries,
        role,
        next: 0,
        comm,
        limit: bucket_bytes.max(1),
        open: Vec::new(),
        open_bytes: 0,
        open_dtype: None,
        summed: Vec::new(),
        placements: Vec::new(),
        missing: 0,
        error: None,
    };
    model.visit(&mut gather);
    gather.flush();
    if let Some(err) = gather.error {
        return Err(err);
    }
    report.buckets = gather.summed.len();
    report.missing = gather.missing;
    let (summed, placements) = (gather.summed, gather.placements);
    model.visit(&mut Scatter::<B::InnerBackend> {
        grads,
        entries: &entries,
        role,
        next: 0,
        summed: &summed,
        placements: placements.into_iter(),
    });
    Ok(report)
}

/// One collective that fails on every rank unless all ranks will sum the same parameters:
/// a mismatch would otherwise add unrelated gradients, or hang on bucket sizes that differ.
fn check_same_layout(comm: &dyn Communicator, role: ParamRole, chosen: &[&ParamEntry]) -> Result<()> {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for entry in chosen {
        let shape: Vec<String> = entry.shape.iter().map(|d| d.to_string()).collect();
        for byte in format!("{}:{};", entry.path, shape.join("x")).bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    // The hash travels as counts; folding it to the platform's usize keeps it comparable.
    let hashes = comm.all_gather_counts(&[hash as usize])?;
    match hashes.iter().position(|&h| h != hashes[0]) {
        None => Ok(()),
        Some(rank) => Err(MoeError::comm(
            "sync_grads",
            comm.rank(),
            format!(
                "rank {rank}'s model has other {role:?} parameters (paths or shapes) than rank 0's: \
                 every rank must build the same model"
            ),
        )),
    }
}

/// Pass 1: takes each chosen gradient (zeros where there is none), flattens it into the open
/// bucket, and sums a bucket over the ranks once it is full.
struct Gather<'a, I: MoeBackend> {
    grads: &'a mut GradientsParams,
    entries: &'a [ParamEntry],
    role: ParamRole,
    next: usize,
    comm: &'a dyn Communicator,
    limit: usize,
    open: Vec<Tensor<I, 1>>,
    open_bytes: usize,
    open_dtype: Option<DType>,
    summed: Vec<Tensor<I, 1>>,
    /// (bucket, first element) of every chosen parameter, in visiting order.
    placements: Vec<(usize, usize)>,
    missing: usize,
    error: Option<MoeError>,
}

impl<I: MoeBackend> Gather<'_, I> {
    /// Sums the open bucket over the ranks.
    fn flush(&mut self) {
        if self.open.is_empty() || self.error.is_some() {
            return;
        }
        let bucket = Tensor::cat(std::mem::take(&mut self.open), 0);
        self.open_bytes = 0;
        self.open_dtype = None;
        match I::all_reduce_sum(bucket.into_primitive().tensor(), self.comm) {
            Ok(sum) => self
                .summed
                .push(Tensor::from_primitive(TensorPrimitive::Float(sum))),
            Err(err) => self.error = Some(err),
        }
    }
}

impl<B: AutodiffBackend<InnerBackend = I>, I: MoeBackend> ModuleVisitor<B> for Gather<'_, I> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let entry = &self.entries[self.next];
        self.next += 1;
        debug_assert_eq!(entry.id, param.id, "the two passes visit in one order");
        if entry.role != self.role || entry.numel() == 0 || self.error.is_some() {
            return;
        }
        let grad = match self.grads.remove::<I, D>(param.id) {
            Some(grad) => grad,
            None => {
                self.missing += 1;
                param.val().inner().zeros_like()
            }
        };
        let dtype = grad.dtype();
        let bytes = entry.numel() * dtype.size();
        if self.open_dtype.is_some_and(|d| d != dtype)
            || (!self.open.is_empty() && self.open_bytes + bytes > self.limit)
        {
            self.flush();
        }
        let offset = self.open.iter().map(|t| t.dims()[0]).sum();
        self.placements.push((self.summed.len(), offset));
        self.open.push(grad.reshape([entry.numel()]));
        self.open_bytes += bytes;
        self.open_dtype = Some(dtype);
    }
}

/// Pass 2: registers each chosen parameter's slice of its summed bucket as its gradient.
struct Scatter<'a, I: MoeBackend> {
    grads: &'a mut GradientsParams,
    entries: &'a [ParamEntry],
    role: ParamRole,
    next: usize,
    summed: &'a [Tensor<I, 1>],
    placements: std::vec::IntoIter<(usize, usize)>,
}

impl<B: AutodiffBackend<InnerBackend = I>, I: MoeBackend> ModuleVisitor<B> for Scatter<'_, I> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let entry = &self.entries[self.next];
        self.next += 1;
        if entry.role != self.role || entry.numel() == 0 {
            return;
        }
        let (bucket, offset) = self
            .placements
            .next()
            .expect("one placement per chosen parameter");
        let dims: [usize; D] = entry
            .shape
            .clone()
            .try_into()
            .expect("the shape has D dimensions");
        let grad = self.summed[bucket]
            .clone()
            .slice(offset..offset + entry.numel())
            .reshape(dims);
        self.grads.register::<I, D>(param.id, grad);
    }
}
