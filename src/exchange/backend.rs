//! The `MoeBackend` extension trait: the fused exchange op's backend contract.

use std::fmt::Debug;
use std::sync::Arc;

use derive_new::new;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{FloatDType, Shape};

use super::arena::{PartitionArena, SlotMemory};
use super::executor::StepExecutor;
use super::rows;
use super::streams::{SyncStreams, WorkerStreams};
use crate::comm::Communicator;
use crate::decoder::DecoderKernels;
use crate::dispatch::{CombineMap, ExchangePlan, RowMap};
use crate::error::Result;
use crate::experts::{Activation, ActivationKernels, ExpertGrads, ExpertTensors};
use crate::layout::LayoutKernels;
use crate::loss::LossKernels;
use crate::memory::{HostStore, Strategy};
use crate::optim::OptimizerKernels;
use crate::router::RouterKernels;

/// Everything the exchange op needs besides tensors and the plan.
///
/// `ExchangeRun::new(comm, activation, strategy, host)` builds one, for a backend author who
/// calls the op outside the layer.
#[derive(Debug, Clone, new)]
pub struct ExchangeRun {
    /// The expert-parallel group.
    pub comm: Arc<dyn Communicator>,
    /// The experts' activation.
    pub activation: Activation,
    /// How `T_DI` and `T_M` survive until backward.
    pub strategy: Strategy,
    /// Where offloaded partitions wait (S1–S3).
    pub host: HostStore,
    /// How the schedule's steps run; `None` is the backend's
    /// [`step_executor`](MoeBackend::step_executor). Not a constructor argument: set the field.
    #[new(default)]
    pub executor: Option<StepExecutor>,
    /// The partition arena the backend builds its partitions in, where it has one
    /// ([`MoeBackend::slot_memory`]); `None` builds them from fresh tensors. The layer passes
    /// its own. Not a constructor argument: set the field.
    #[new(default)]
    pub arena: Option<PartitionArena>,
    /// The experts shadowed this step (global indices, increasing; experts numbered owner by
    /// owner), empty without shadowing: the plan's expert slots past this rank's own run a
    /// copy of each, which its owner broadcasts inside the op, and the copies' gradients are
    /// summed over the ranks onto the owner's in backward. Every rank passes the same list.
    /// Not a constructor argument: set the field.
    #[new(default)]
    pub shadows: Vec<usize>,
    /// The precision of the experts' products where the communicator offers a device
    /// library's [`ExpertPath`](super::ExpertPath) for the backend (cuBLAS on CUDA); ignored
    /// by the primitive ops. Not a constructor argument: set the field.
    #[new(default)]
    pub precision: super::GemmPrecision,
    /// The expert parts ([`ExpertPart`](crate::experts::ExpertPart) order) whose gradients
    /// nobody reads, such as base weights frozen under low-rank adapters: backward computes
    /// nothing for them and returns `None`. `Autodiff<B>` sets it from which parameters its
    /// graph tracks; every rank must pass the same (the shadows' folds run per part). Not a
    /// constructor argument: set the field.
    #[new(default)]
    pub frozen: [bool; crate::experts::EXPERT_PARTS],
    /// Whether a partition's experts may run on the backend's own
    /// [`ExpertPath`](super::ExpertPath) ([`MoeBackend::expert_path`]; Flex's runs them side by
    /// side over its pool) where the communicator offers none. The layer turns it on: the
    /// implementation's memory model replays the path's route
    /// ([`ExpertPath::route`](super::ExpertPath::route)). Not a constructor argument: set the
    /// field (off by default).
    #[new(default)]
    pub backend_experts: bool,
    /// Whether the primitives may hold a whole partition's transients at once: run the
    /// experts' activation over the whole partition (one kernel where the arena holds `T_M`
    /// in one buffer) instead of expert by expert, and, through a device library, take every
    /// expert's products of a step in one call (one cuBLAS section on CUDA) instead of one
    /// expert a round. Those partition-sized transients are not what the implementation's
    /// memory model replays for the primitives (`memory/implementation`), so the layer turns
    /// this off under a `memory_budget`, whose promise rests on that model. Not a constructor
    /// argument: set the field (off by default).
    #[new(default)]
    pub partition_transients: bool,
}

impl ExchangeRun {
    /// The executor this run uses on backend `B` for tensors on `device`.
    pub fn executor_for<B: MoeBackend>(&self, device: &B::Device) -> StepExecutor {
        self.executor.unwrap_or_else(|| B::step_executor(device))
    }
}

/// Gradients of the exchange op's inputs.
#[derive(Debug, Clone)]
pub struct ExchangeGrads<B: Backend> {
    /// `[n_rows, d_model]`, the gradient of `T_I`.
    pub input: FloatTensor<B>,
    /// Gradients of the expert tensors, shaped like them (`None` for absent and frozen parts).
    pub experts: ExpertGrads<B>,
}

/// A backend that can run the fused exchange op (step 4 of the forward recipe): dispatch all-to-all,
/// local expert FFNs, combine all-to-all, over `n` partitions, with the memory strategy's
/// restore in backward.
///
/// Backends implement [`exchange_forward`](MoeBackend::exchange_forward) and
/// [`exchange_backward`](MoeBackend::exchange_backward); the layer calls
/// [`exchange`](MoeBackend::exchange), which `Autodiff<B>` overrides to record one backward
/// node. CPU backends share one generic implementation written with primitive ops
/// ([`fused_forward`](crate::backend::fused_forward) and
/// [`fused_backward`](crate::backend::fused_backward)); the expert FFN's activation kernels
/// come from the supertrait [`ActivationKernels`], and the fused optimizer's update
/// ([`mpipemoe::optim::AdamW`](crate::optim::AdamW)) from [`OptimizerKernels`], so that a
/// training loop generic over `MoeBackend` can step it.
pub trait MoeBackend:
    ActivationKernels + OptimizerKernels + LossKernels + LayoutKernels + DecoderKernels + RouterKernels
{
    /// What the forward pass keeps for backward under the run's strategy.
    type Saved: Clone + Send + Sync + Debug + 'static;

    /// Forward of the exchange: returns `T_O` and what backward needs.
    ///
    /// # Precondition on device backends with streams
    /// `input` and the expert tensors have no writes pending on another thread's stream. The
    /// threaded executor fences the calling thread's stream before its workers read them
    /// ([`execute_on`](crate::backend::execute_on)), and nothing else: a weight that an
    /// optimizer on another thread updated in place must be synchronised on that thread
    /// (`B::sync`) before this thread runs the layer. It cannot be checked here, because
    /// cubecl records only the stream that *allocated* a buffer (`Handle::stream`), not the
    /// last one that wrote it. Training loops that step the optimizer on the thread that runs
    /// the layer (every example and burn's `Learner`) meet it.
    ///
    /// # Shapes
    /// - input (`T_I`): `[n_rows, d_model]`, rows in the plan's order
    /// - returns `T_O`: `[n_rows, d_model]`, row `i` the expert output for input row `i`
    fn exchange_forward(
        input: FloatTensor<Self>,
        experts: ExpertTensors<Self>,
        plan: &ExchangePlan,
        run: &ExchangeRun,
    ) -> Result<(FloatTensor<Self>, Self::Saved)>;

    /// Backward of the exchange: gradients of `T_I` and of every expert tensor.
    ///
    /// Runs the same collectives on every rank whether or not this rank's input needs a
    /// gradient, because its peers are waiting for its rows.
    fn exchange_backward(
        grad_out: FloatTensor<Self>,
        saved: Self::Saved,
        plan: &ExchangePlan,
        run: &ExchangeRun,
    ) -> Result<ExchangeGrads<Self>>;

    /// The layer's entry point: the forward, with a backward node where the backend tracks
    /// gradients. Plain backends drop `Saved` at once.
    fn exchange(
        input: FloatTensor<Self>,
        experts: ExpertTensors<Self>,
        plan: Arc<ExchangePlan>,
        run: &ExchangeRun,
    ) -> Result<FloatTensor<Self>> {
        Self::exchange_forward(input, experts, &plan, run).map(|(out, _)| out)
    }

    /// This rank's experts on rows already in expert order, with nothing to exchange: the
    /// layer's decode path (a few tokens at inference on one rank) calls it in place of
    /// [`exchange`](Self::exchange). Forward only, with no backward node: the layer takes it
    /// only where the backend tracks no gradients. The default runs the exchange's `C` step on
    /// one block of every row, with the expert compute the exchange would find
    /// (`exchange/direct.rs`); `Fusion<B>` runs it on `B`, as it runs the exchange.
    ///
    /// # Shapes
    /// - input (`T_I`, expert-major): `[n_rows, d_model]`, `n_rows = Σ rows_per_expert`
    /// - `rows_per_expert`: `[n_local_experts]`
    /// - returns `T_O`: `[n_rows, d_model]`
    ///
    /// # Errors
    /// [`MoeError::Input`](crate::MoeError::Input) if the rows or the experts disagree with
    /// `rows_per_expert`.
    fn experts_forward(
        input: FloatTensor<Self>,
        experts: ExpertTensors<Self>,
        rows_per_expert: &[usize],
        run: &ExchangeRun,
    ) -> Result<FloatTensor<Self>> {
        super::direct::forward::<Self>(input, experts, rows_per_expert, run)
    }

    /// How the generic fused exchange runs its schedule on this backend (on `device`) when the
    /// layer's config does not say: in issue order on the calling thread (the default), or one
    /// thread per stream (see [`StepExecutor`]).
    ///
    /// In order is the default because it is correct on every backend and costs nothing
    /// where streams do not run concurrently. On the CPU backends the streams' threads share
    /// the cores the GEMMs already fill: the toy GPT-MoE trained 11–19% faster in order (two
    /// runs), and the paper's expert shapes at n ∈ {1, 2, 4} were within the machine's noise
    /// (BENCHMARKS.md §7). The threaded executor is for backends whose streams overlap (CUDA),
    /// and the tests run it on the CPU through `MoeLayerConfig::executor`, where a missing
    /// dependency between streams shows up as a wrong result or a reported hazard.
    fn step_executor(device: &Self::Device) -> StepExecutor {
        let _ = device;
        StepExecutor::InOrder
    }

    /// The device streams the threaded executor's workers issue on, built on the calling
    /// thread once per pass. The default issues on each worker thread as it is and fences with
    /// the backend's `sync` ([`SyncStreams`]); the CubeCL backends give each schedule stream a
    /// device stream of its own, the same for every pass the calling thread runs.
    fn worker_streams(device: &Self::Device) -> Box<dyn WorkerStreams> {
        Box::new(SyncStreams::<Self>::new(device))
    }

    /// Whether `tensor` was allocated on the stream the calling thread issues on: the debug
    /// check at every in-place write of the exchange (a tensor written on a stream is created
    /// there, see [`WorkerStreams`]). Backends without streams: always.
    fn allocated_on_current_stream(tensor: &FloatTensor<Self>) -> bool {
        let _ = tensor;
        true
    }

    /// Whether every op on this backend that writes a tensor launches a device kernel, even
    /// over zero elements: the CubeCL backends do, and CUDA refuses such a launch (see
    /// `exchange/rows.rs`, "No kernel on zero elements"). The exchange's row helpers make
    /// empty tensors without an op, and in debug builds assert that no op they issue on such
    /// a backend covers zero elements. The default is `false` (host backends).
    fn issues_kernels() -> bool {
        false
    }

    /// The partition arena's buffers for this backend on the device and dtype of `like`,
    /// where the backend has them and `run` carries an arena; `None` (the default) builds
    /// each partition from fresh tensors. The CubeCL backends have them.
    fn slot_memory(run: &ExchangeRun, like: &FloatTensor<Self>) -> Option<Arc<dyn SlotMemory<Self>>> {
        let _ = (run, like);
        None
    }

    /// The backend's own [`ExpertPath`](super::ExpertPath), which a partition's experts run
    /// on where the communicator offers no path for this backend and the run allows it
    /// ([`ExchangeRun::backend_experts`]: the layer always does): the exchange hands each
    /// partition's `C_i` and `C'_i` to it whole. `None` (the default) runs each expert on the
    /// primitives, one after another. Flex runs the experts side by side over its pool
    /// (`exchange/flex_experts.rs`).
    fn expert_path() -> Option<Arc<dyn super::ExpertPath<Self>>> {
        None
    }

    /// A `[shape]` buffer that the exchange writes whole before anything reads it (a
    /// partition's slot without an arena, the stacked sums of the experts' weight gradients):
    /// its values on return are unspecified. The default is `float_empty`; Flex's zero-fills a
    /// byte vector and copies it to re-align it (burn-flex 0.21 `FlexTensor::empty`), two passes
    /// over 150 MB of stacked gradients per layer and step in a 163 M Qwen3-MoE, so Flex
    /// allocates an `f32` vector zeroed once.
    fn write_buffer(shape: Shape, device: &Self::Device, dtype: FloatDType) -> FloatTensor<Self> {
        Self::float_empty(shape, device, dtype)
    }

    /// Writes `rows` into `dst` from row `start` on, returning `dst`: how the exchange
    /// assembles `T_O` and `dT_I` from their partitions. The default is burn's
    /// `slice_assign`; a backend whose `slice_assign` copies the destination overrides it
    /// with an in-place write (Flex does), so the assembled tensor is never copied.
    ///
    /// # Shapes
    /// - dst: `[n_rows, width]`, rows: `[len, width]` with `start + len <= n_rows`
    fn assign_rows(dst: FloatTensor<Self>, start: usize, rows: FloatTensor<Self>) -> FloatTensor<Self> {
        super::assemble::slice_assign_rows::<Self>(dst, start, rows)
    }

    /// Writes `value` into `dst` from index `start` on along dimension `dim` (every other
    /// dimension whole), returning `dst`: how a generation's key/value cache appends a step's
    /// entries to the room it keeps. The default is burn's `slice_assign`; Flex, whose
    /// `slice_assign` copies the whole destination, writes in place where it owns `dst` alone
    /// (`exchange/flex_rows.rs`), so a decode step copies only its own entries.
    ///
    /// # Shapes
    /// - dst: `[.., n, ..]`, value: the same dims but `len` at `dim`, `start + len <= n`
    fn assign_along(
        dst: FloatTensor<Self>,
        dim: usize,
        start: usize,
        value: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        super::assemble::slice_assign_along::<Self>(dst, dim, start, value)
    }

    /// `lhs · rhs` over matching batch dimensions: attention's products of every head (the
    /// scores against the cached keys, the weights against the cached values). The default is
    /// the backend's matmul; Flex runs each head's product of a few rows (a decode step's) on
    /// the kernels of its few-row products, reading the cache where it lies
    /// (`exchange/flex_heads.rs`), where its matmul packed it first.
    ///
    /// # Shapes
    /// - lhs: `[.., m, k]`, rhs: `[.., k, n]` → `[.., m, n]`
    fn heads_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(lhs, rhs)
    }

    /// `lhs · rhs` for the experts' GEMMs (the fused op's forward and backward products) and
    /// for the dense products around the layer that have no device library to go through (a
    /// model's projections and head, the router's logits and the shared expert on the CPU).
    /// The default is the backend's matmul; Flex writes into an output it allocates once,
    /// where its matmul zero-fills and then copies every output before the GEMM, reads
    /// transposed operands in place, and splits a product of a few rows (a decode step's) by
    /// columns over the threads (`exchange/flex_gemm.rs`). `Autodiff<B>` records the inner
    /// backend's product as one node whose backward products are the inner's too.
    ///
    /// # Shapes
    /// - lhs: `[m, k]`, rhs: `[k, n]` → `[m, n]`
    fn expert_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(lhs, rhs)
    }

    /// Expert `e`'s matrix of a stacked `[n_experts, rows, cols]` weight, as `[rows, cols]`:
    /// what each expert's GEMMs read. The default slices and reshapes with burn's ops; Flex
    /// returns a view, because its reshape copies every view that does not start at offset 0
    /// (burn-flex 0.21 `Layout::reshape`), which copied each expert's matrices at every GEMM.
    ///
    /// # Shapes
    /// - w: `[n_experts, rows, cols]` → `[rows, cols]`
    fn expert_matrix(w: &FloatTensor<Self>, e: usize) -> FloatTensor<Self> {
        rows::expert_matrix::<Self>(w, e)
    }

    /// `lhs · rhs` for the layer's dense products outside the exchange (the router's logits,
    /// the shared expert) at the config's GEMM precision: through the communicator's device
    /// library for this backend where it offers one ([`ExpertPath::matmul`](super::ExpertPath::matmul)),
    /// the backend's matmul otherwise; differentiable where the backend tracks gradients, the
    /// backward's products going the same way (`exchange/dense.rs`).
    ///
    /// # Shapes
    /// - lhs: `[m, k]`, rhs: `[k, n]` → `[m, n]`
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the device library fails.
    fn dense_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        comm: &Arc<dyn Communicator>,
        precision: super::GemmPrecision,
    ) -> Result<FloatTensor<Self>> {
        super::dense::through_path::<Self>(lhs, rhs, comm, precision)
    }

    /// Independent [`dense_matmul`](Self::dense_matmul)s in one call: a dense product's two
    /// backward products, a model's projections of one input, which a device library runs
    /// together ([`ExpertPath::matmuls`](super::ExpertPath::matmuls): on CUDA one section, not
    /// one each). Differentiable where the backend's `dense_matmul` is: under `Autodiff` one
    /// inner call, each output a node of its own.
    ///
    /// # Shapes
    /// - each pair: lhs `[m, k]`, rhs `[k, n]` → `[m, n]`, in the pairs' order
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the device library fails.
    fn dense_matmuls(
        pairs: Vec<(FloatTensor<Self>, FloatTensor<Self>)>,
        comm: &Arc<dyn Communicator>,
        precision: super::GemmPrecision,
    ) -> Result<Vec<FloatTensor<Self>>> {
        super::dense::through_path_many::<Self>(pairs, comm, precision)
    }

    /// Attention's per-head products (`lhs · rhs` over matching leading dimensions) at
    /// `precision`, through the communicator's device library for this backend where it takes
    /// dense products ([`ExpertPath::heads_matmul`](super::ExpertPath::heads_matmul): on CUDA
    /// batched cuBLAS calls, where cubecl multiplies f32 in TF32 whatever is asked), else the
    /// backend's [`heads_matmul`](Self::heads_matmul). Differentiable where the backend is:
    /// under `Autodiff` one node whose two backward products go the same way
    /// (`exchange/dense_heads.rs`).
    ///
    /// # Shapes
    /// - lhs: `[.., m, k]`, rhs: `[.., k, n]` → `[.., m, n]`
    ///
    /// # Errors
    /// [`MoeError::Backend`](crate::MoeError::Backend) if the device library fails.
    fn dense_heads_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        comm: &Arc<dyn Communicator>,
        precision: super::GemmPrecision,
    ) -> Result<FloatTensor<Self>> {
        super::dense_heads::through_path::<Self>(lhs, rhs, comm, precision)
    }

    /// Whether [`dense_matmul`](Self::dense_matmul) goes through a device library here: the
    /// communicator offers one for this backend that takes dense products
    /// ([`ExpertPath::multiplies_dense`](super::ExpertPath::multiplies_dense)), or, for a
    /// wrapper (`Autodiff<B>`, `Fusion<B>`), for the backend it wraps.
    fn dense_library(comm: &dyn Communicator) -> bool {
        super::dense::dense_path::<Self>(comm).is_some()
    }

    /// The route a partition's experts without adapters take in the exchange on `comm` at
    /// `precision` ([`ExpertRoute`](crate::memory::ExpertRoute), for the memory model): the
    /// path the exchange would find (the communicator's for this backend, else, where `own`,
    /// the backend's own), as it says its route; the primitives' without one. A wrapper
    /// (`Autodiff<B>`, `Fusion<B>`) answers for the backend it wraps, whose exchange runs the
    /// experts.
    fn expert_route(
        comm: &dyn Communicator,
        own: bool,
        precision: crate::GemmPrecision,
    ) -> crate::memory::ExpertRoute {
        super::ffn::path_for::<Self>(comm, own).map_or(crate::memory::ExpertRoute::ExpertByExpert, |path| {
            path.route(precision)
        })
    }

    /// Step 4's gather: row `i` of the result is row `map.targets()[i]` of `x`, differentiable
    /// where the backend tracks gradients (the backward is
    /// [`combine_rows`](Self::combine_rows)). The default is burn's `select`.
    ///
    /// # Shapes
    /// - x: `[n_targets, width]` → `[n_rows, width]`
    fn gather_rows(x: FloatTensor<Self>, map: &Arc<RowMap>) -> FloatTensor<Self> {
        super::row_moves::select_rows::<Self>(x, map)
    }

    /// Step 6's combine: row `t` of the result is the sum of the rows of `rows` whose target is
    /// `t`, added in ascending row order onto zero (zero where it has none); differentiable
    /// where the backend tracks gradients (the backward is [`gather_rows`](Self::gather_rows)).
    /// The default is burn's `select_assign` with `Add` onto zeros; the CubeCL backends sum
    /// each target's rows in a kernel of their own, with the same bits
    /// (`exchange/row_moves.rs` says why).
    ///
    /// # Shapes
    /// - rows: `[n_rows, width]` → `[n_targets, width]`
    fn combine_rows(rows: FloatTensor<Self>, map: &Arc<RowMap>) -> FloatTensor<Self> {
        super::row_moves::add_rows::<Self>(rows, map)
    }

    /// Step 6 with its combine weights: row `t` of the result is the sum over token `t`'s rows
    /// `r` (ascending) of `weights[slot(r)] · rows[r]` (zero where it has none), differentiable
    /// where the backend tracks gradients (the backward is
    /// [`combine_weighted_backward`](Self::combine_weighted_backward)). The default is the
    /// weights gathered into row order, a product and [`combine_rows`](Self::combine_rows)
    /// ([`combine_weighted_composed`](crate::backend::combine_weighted_composed)); the CubeCL
    /// backends run one kernel (`exchange/weighted_combine.rs` says why).
    ///
    /// # Shapes
    /// - rows: `[n_rows, d_model]`, weights: `[n_tokens, top_k]` → `[n_tokens, d_model]`
    fn combine_weighted(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        map: &Arc<CombineMap>,
    ) -> FloatTensor<Self> {
        super::weighted_combine::combine_weighted_composed::<Self>(rows, weights, map)
    }

    /// The backward of [`combine_weighted`](Self::combine_weighted): the rows' gradient
    /// `weights[slot(r)] · grad[token(r)]` and the weights' gradient, each slot's row dotted
    /// with its token's gradient (zero for a slot without a row). The default is composed
    /// ([`combine_weighted_backward_composed`](crate::backend::combine_weighted_backward_composed));
    /// the CubeCL backends run one kernel.
    ///
    /// # Shapes
    /// - grad: `[n_tokens, d_model]`, rows: `[n_rows, d_model]`, weights: `[n_tokens, top_k]`
    /// - returns `([n_rows, d_model], [n_tokens, top_k])`
    fn combine_weighted_backward(
        grad: FloatTensor<Self>,
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        map: &Arc<CombineMap>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        super::weighted_combine::combine_weighted_backward_composed::<Self>(grad, rows, weights, map)
    }

    /// The uneven all-to-all of rows, differentiable where the backend tracks gradients (its
    /// backward is the reverse all-to-all). Used by the reference twin.
    ///
    /// # Shapes
    /// - x: `[sum(send_per_rank), width]` → `[sum(recv_per_rank), width]`
    fn all_to_all(
        x: FloatTensor<Self>,
        send_per_rank: &[usize],
        recv_per_rank: &[usize],
        comm: &Arc<dyn Communicator>,
    ) -> Result<FloatTensor<Self>> {
        rows::all_to_all_rows::<Self>(comm.as_ref(), x, send_per_rank, recv_per_rank)
    }

    /// The element-wise sum of `x` over the ranks of `comm`, on every rank, not tracked by
    /// autodiff: how [`sync_replicated_grads`](crate::parallel::sync_replicated_grads) sums a
    /// bucket of gradients. The communicator's device path for this backend where it has one
    /// (NCCL's all-reduce on CUDA), the host path otherwise
    /// ([`all_reduce_tensor`](crate::comm::all_reduce_tensor)); `Fusion<B>` hands the bucket
    /// to its inner backend so that it finds the inner backend's path.
    ///
    /// # Shapes
    /// - x: `[n]` → `[n]`
    fn all_reduce_sum(x: FloatTensor<Self>, comm: &dyn Communicator) -> Result<FloatTensor<Self>> {
        crate::comm::all_reduce_tensor::<Self>(comm, x)
    }

    /// Whether [`broadcast`](MoeBackend::broadcast) and
    /// [`all_reduce_sum`](MoeBackend::all_reduce_sum) run on the communicator's device path
    /// for this backend (NCCL's ring on CUDA) rather than through the host: what the
    /// shadowing cost model prices a shadow's broadcast by. Wrappers that hand those calls to
    /// their inner backend (`Autodiff<B>`, `Fusion<B>`) answer for it, as the paths are
    /// registered per backend type and a wrapper is another type.
    fn has_device_reduce(comm: &dyn Communicator) -> bool {
        comm.row_paths()
            .and_then(crate::comm::RowPaths::reduce::<Self>)
            .is_some()
    }

    /// Rank `root`'s `x` on every rank of `comm`, differentiable where the backend tracks
    /// gradients: the backward sums the gradient over the ranks
    /// ([`all_reduce_sum`](MoeBackend::all_reduce_sum)) and hands it to the root's `x` alone
    /// (zeros on the other ranks, whose `x` was not read). How a shadowed expert's weights
    /// reach every rank and their copies' gradients return to the owner. The communicator's
    /// device path for this backend where it has one (NCCL's broadcast on CUDA), the host
    /// path otherwise ([`broadcast_tensor`](crate::comm::broadcast_tensor)).
    ///
    /// Every rank must pass a tensor of the same shape, tracked on every rank or on none, so
    /// that every rank runs the backward's all-reduce.
    ///
    /// # Shapes
    /// - x: any, the same on every rank; returns that shape
    fn broadcast(
        x: FloatTensor<Self>,
        root: usize,
        comm: &Arc<dyn Communicator>,
    ) -> Result<FloatTensor<Self>> {
        crate::comm::broadcast_tensor::<Self>(comm.as_ref(), x, root)
    }
}

/// The two required methods of [`MoeBackend`] for a backend that runs the generic fused
/// implementation written with primitive ops.
#[cfg(any(feature = "ndarray", feature = "flex", feature = "cubecl"))]
macro_rules! fused_exchange {
    () => {
        type Saved = $crate::exchange::fused::Saved<Self>;

        fn exchange_forward(
            input: burn::tensor::ops::FloatTensor<Self>,
            experts: $crate::experts::ExpertTensors<Self>,
            plan: &$crate::dispatch::ExchangePlan,
            run: &$crate::exchange::ExchangeRun,
        ) -> $crate::error::Result<(burn::tensor::ops::FloatTensor<Self>, Self::Saved)> {
            $crate::exchange::fused::forward::<Self>(input, experts, plan, run)
        }

        fn exchange_backward(
            grad_out: burn::tensor::ops::FloatTensor<Self>,
            saved: Self::Saved,
            plan: &$crate::dispatch::ExchangePlan,
            run: &$crate::exchange::ExchangeRun,
        ) -> $crate::error::Result<$crate::exchange::ExchangeGrads<Self>> {
            $crate::exchange::fused::backward::<Self>(grad_out, saved, plan, run)
        }
    };
}
// The CubeCL backends' impl (feature `cubecl`) uses it from another module.
#[cfg(feature = "cubecl")]
pub(crate) use fused_exchange;

#[cfg(feature = "ndarray")]
impl<E, I, Q> MoeBackend for burn::backend::NdArray<E, I, Q>
where
    E: burn::backend::ndarray::FloatNdArrayElement,
    I: burn::backend::ndarray::IntNdArrayElement,
    Q: burn::backend::ndarray::QuantElement,
    burn::backend::ndarray::NdArrayTensor:
        From<burn::backend::ndarray::SharedArray<E>> + From<burn::backend::ndarray::SharedArray<I>>,
{
    fused_exchange!();
}

#[cfg(feature = "flex")]
impl MoeBackend for burn::backend::Flex {
    fused_exchange!();

    /// In place where Flex owns the destination alone (its `slice_assign` copies it whole).
    fn assign_rows(dst: FloatTensor<Self>, start: usize, rows: FloatTensor<Self>) -> FloatTensor<Self> {
        super::flex_rows::assign_rows(dst, start, rows)
    }

    /// In place where Flex owns the destination alone (its `slice_assign` copies it whole).
    fn assign_along(
        dst: FloatTensor<Self>,
        dim: usize,
        start: usize,
        value: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        super::flex_rows::assign_along(dst, dim, start, value)
    }

    /// A view of the weight's storage, not a copy.
    fn expert_matrix(w: &FloatTensor<Self>, e: usize) -> FloatTensor<Self> {
        super::flex_rows::expert_matrix(w, e)
    }

    /// The experts side by side over the pool (`exchange/flex_experts.rs`).
    fn expert_path() -> Option<Arc<dyn super::ExpertPath<Self>>> {
        Some(Arc::new(super::flex_experts::FlexExperts))
    }

    /// An `f32` vector zeroed once, over the pool (see the trait's docs); other dtypes as
    /// Flex allocates them.
    fn write_buffer(shape: Shape, device: &Self::Device, dtype: FloatDType) -> FloatTensor<Self> {
        match dtype {
            FloatDType::F32 => {
                let values = super::flex_rows::zeros(shape.num_elements());
                burn::backend::flex::FlexTensor::from_data(burn::tensor::TensorData::new(values, shape))
            }
            _ => <Self as burn::tensor::ops::FloatTensorOps<Self>>::float_empty(shape, device, dtype),
        }
    }

    /// Each head's few rows on the few-row kernels (`exchange/flex_heads.rs`).
    fn heads_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        super::flex_heads::heads_matmul(lhs, rhs)
    }

    /// Into an output zeroed once, not zeroed and copied (`exchange/flex_gemm.rs`).
    fn expert_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        super::flex_gemm::matmul(lhs, rhs)
    }
}
