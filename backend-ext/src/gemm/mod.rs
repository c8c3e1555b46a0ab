//! The experts' compute steps on cuBLAS: [`CublasExperts`], the [`ExpertPath`] of the CUDA
//! backend in f32, which the fused exchange takes for `C_i` and `C'_i` where the communicator
//! offers it ([`CublasExperts::paths`], [`with_cublas`]).
//!
//! One partition step is one section on a lane's own stream (`lane.rs`), ordered against the
//! calling thread's cubecl stream without host waits (`handover.rs`):
//!
//! - forward: `T_M = X·W_in` (one call over the experts: batched where experts have the same
//!   rows, grouped or looped for the rest, `Inner::run`), the input bias and the
//!   activation in one kernel (`T_M` keeps the biased pre-activation, `A` goes to scratch),
//!   `T_DO = A·W_out` (the same), the output bias;
//! - backward: `T_M` recomputed where the strategy dropped it, `dA = dT_DO·W_outᵀ`, one kernel for
//!   `A` and `dT_M`, then `dW_out += Aᵀ·dT_DO`, `dW_in += Xᵀ·dT_M` straight into the stacked running
//!   sums (beta = 1), the bias gradients as products with a ones vector, `dT_DI = dT_M·W_inᵀ`.
//!
//! Precision is the job's ([`GemmPrecision`]): cuBLAS's IEEE f32, TF32 or bf16 compute types.
//! The cubecl path (`cubek`'s GEMMs, burn's element-wise ops) stays as the twin the GPU check
//! compares it with.

mod backward;
mod blas;
mod dense;
mod forward;
mod handover;
mod kernels;
mod lane;
mod operands;
mod stopwatch;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use burn_cubecl::cubecl;
use burn_cubecl::tensor::CubeTensor;
use cubecl::client::ComputeClient;
use cubecl::cuda::CudaRuntime;
use cubecl::stream_id::StreamId;
use cudarc::driver::CudaContext;
use mpipemoe::backend::{
    ExpertBackward, ExpertBackwardOut, ExpertForward, ExpertGroups, ExpertPath, PassStore,
};
use mpipemoe::comm::{RowPaths, WithRowPaths};
use mpipemoe::memory::GemmOperands;
use mpipemoe::{Communicator, GemmPrecision, MoeError, Result};

use crate::batches::Addressing;
use crate::breakdown::Breakdown;
use crate::offload::PinnedOffload;
use crate::CudaMoe;
use blas::Role;
pub use handover::Handover;
use kernels::Kernels;
use lane::{Call, Lane};

/// Products per expert above which one `cublasGemmEx` each beats the grouped call (see
/// `Inner::run`).
const GROUPED_BELOW_FLOPS: f64 = 5e9;

/// How the path runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CublasOptions {
    /// How a lane's stream is ordered against cubecl's (see [`Handover`]).
    pub handover: Handover,
    /// One `cublasGemmGroupedBatchedEx` per role where cuBLAS has it (12.5 and later), accepts
    /// the precision in it and the experts' products are small enough for it to win (under
    /// about 5 GFLOP each, measured); `false`, or where it does not, one `cublasGemmEx` per
    /// expert.
    pub grouped: bool,
    /// The products of each shape that two or more experts of a role share (experts with the
    /// same rows) as one batched call (`cublasGemmStridedBatchedEx`, or `cublasGemmBatchedEx`
    /// where the operands do not step evenly), before the grouped or looped calls take the
    /// rest; `false`: every product by `grouped`'s rule.
    pub batched: bool,
    /// The layer's dense products too (the router's logits, the shared expert, a model's
    /// projections: `MoeBackend::dense_matmul`), at the layer's precision; `false` leaves
    /// them on cubecl's kernels, which multiply f32 in TF32 whatever is asked, without a
    /// section each. A benchmark's twin: at TF32 it says what a router's section costs
    /// against cubecl's small product.
    pub dense: bool,
    /// Make the bf16 precision's copies of the experts' weights once a step, in the forward,
    /// and keep them for the backward (the exchange's step store, `ExpertGroups::step`),
    /// instead of once a pass: one conversion of every expert's weights a step fewer (at
    /// GPT3-XL's 8 experts 268 M floats, some 0.4 ms of an H200's memory traffic), for half
    /// the weights' f32 size held from the forward to the backward, the trade PyTorch's
    /// autocast makes with its saved casts. Off by default: over a whole model it holds every
    /// MoE layer's copies at once.
    pub bf16_weights_per_step: bool,
    /// Mark every section's pieces (the conversions, each GEMM role, the element-wise kernels,
    /// the hand-overs) with a CUDA event and a host instant, for
    /// [`CublasExperts::breakdown`]: where a benchmark's time goes. Off by default: the events
    /// cost a driver call each and the path's own figures are taken without them.
    pub timed: bool,
}

impl Default for CublasOptions {
    fn default() -> Self {
        Self {
            handover: Handover::Device,
            grouped: true,
            batched: true,
            dense: true,
            bf16_weights_per_step: false,
            timed: false,
        }
    }
}

/// How many cuBLAS calls of each kind the path has made for its roles since it was created (a
/// role is one product of every expert: `X·W_in`, say), so that a check can see which calls a
/// job took and a benchmark can explain a step's launches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CublasCalls {
    /// `cublasGemmStridedBatchedEx`: experts with the same rows whose operands step evenly.
    pub strided_batched: u64,
    /// `cublasGemmBatchedEx`: experts with the same rows, through pointer tables.
    pub pointer_batched: u64,
    /// `cublasGemmGroupedBatchedEx`.
    pub grouped: u64,
    /// `cublasGemmEx`, one per expert product.
    pub looped: u64,
    /// Conversions of the experts' weights to bf16 (the bf16 precision): one per lane and pass,
    /// not one per partition (`PassHalves`); one per lane and step with
    /// [`CublasOptions::bf16_weights_per_step`].
    pub weight_conversions: u64,
    /// Sections: the path's trips to cubecl's device thread with a hand-over between the
    /// streams, each holding any number of the calls above (and the dense products' own).
    pub sections: u64,
}

/// [`CublasCalls`] as the path counts them.
#[derive(Debug, Default)]
pub(crate) struct CallCounters([AtomicU64; 6]);

impl CallCounters {
    pub(crate) const STRIDED: usize = 0;
    pub(crate) const POINTERS: usize = 1;
    pub(crate) const GROUPED: usize = 2;
    pub(crate) const LOOPED: usize = 3;
    pub(crate) const CONVERSIONS: usize = 4;
    pub(crate) const SECTIONS: usize = 5;

    pub(crate) fn add(&self, which: usize, n: usize) {
        self.0[which].fetch_add(n as u64, Ordering::Relaxed);
    }

    fn read(&self) -> CublasCalls {
        let [strided_batched, pointer_batched, grouped, looped, weight_conversions, sections] =
            std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed));
        CublasCalls {
            strided_batched,
            pointer_batched,
            grouped,
            looped,
            weight_conversions,
            sections,
        }
    }
}

/// The CUDA expert path of one GPU (see the module docs). Cloning shares it.
#[derive(Clone)]
pub struct CublasExperts {
    inner: Arc<Inner>,
}

struct Inner {
    ordinal: usize,
    context: Arc<CudaContext>,
    kernels: Kernels,
    options: CublasOptions,
    grouped: bool,
    lanes: Mutex<HashMap<u64, Arc<Mutex<Lane>>>>,
    calls: CallCounters,
    /// The copy stream and page-locked pool of [`CublasExperts::host_paths`].
    host: Arc<PinnedOffload>,
}

impl std::fmt::Debug for CublasExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CublasExperts")
            .field("gpu", &self.inner.ordinal)
            .field("options", &self.inner.options)
            .field("grouped", &self.inner.grouped)
            .finish_non_exhaustive()
    }
}

pub(crate) fn err(what: &str, e: impl std::fmt::Debug) -> MoeError {
    MoeError::Backend(format!("CUDA expert path: {what}: {e:?}"))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CublasExperts {
    /// The path of GPU `ordinal` with the default options.
    ///
    /// # Errors
    /// [`MoeError::Backend`] if the GPU, cuBLAS or NVRTC (which compiles the path's four
    /// element-wise kernels, once per process) cannot be used.
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_options(ordinal, CublasOptions::default())
    }

    /// The path of GPU `ordinal` with `options`.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_options(ordinal: usize, options: CublasOptions) -> Result<Self> {
        crate::cuda_available().map_err(|e| err("driver", e))?;
        // SAFETY: only loads the library to see whether it is there.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(MoeError::Backend(
                "CUDA expert path: no cuBLAS library found (libcublas.so); put its folder on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let context = CudaContext::new(ordinal).map_err(|e| err("context", e))?;
        let kernels = Kernels::load(&context)?;
        let host = Arc::new(PinnedOffload::new(context.clone())?);
        Ok(Self {
            inner: Arc::new(Inner {
                ordinal,
                context,
                kernels,
                options,
                grouped: options.grouped && blas::has_grouped(),
                lanes: Mutex::new(HashMap::new()),
                calls: CallCounters::default(),
                host,
            }),
        })
    }

    /// Whether the GEMMs go through cuBLAS's grouped call (asked for, and in the library).
    pub fn grouped(&self) -> bool {
        self.inner.grouped
    }

    /// The cuBLAS calls the path has made so far, by kind (all lanes together).
    pub fn calls(&self) -> CublasCalls {
        self.inner.calls.read()
    }

    /// Where the path's sections spent their time since the last call, piece by piece, every
    /// lane together: empty unless the path was made with [`CublasOptions::timed`]. Waits for
    /// the marked work to finish (for benchmarks, not the training loop).
    ///
    /// # Errors
    /// [`MoeError::Backend`] if an event cannot be read.
    pub fn breakdown(&self) -> Result<Breakdown> {
        let lanes: Vec<_> = lock(&self.inner.lanes).values().cloned().collect();
        let mut all = Breakdown::default();
        for lane in lanes {
            all.merge(&lock(&lane).take_breakdown()?);
        }
        Ok(all)
    }

    /// The path as a communicator offers it, for the CUDA backend in f32.
    pub fn paths(&self) -> RowPaths {
        RowPaths::new().with_experts::<CudaMoe<f32>>(Arc::new(self.clone()))
    }

    /// What a rank of this GPU falls back on where its communicator has no path of the kind:
    /// the rows' all-to-all through host bytes, uploaded from page-locked memory on a copy
    /// stream instead of through cubecl's device thread, and the S1–S3 offload to page-locked
    /// memory (`host_rows.rs`), for the CUDA backend in f32, bf16 and f16. One copy stream and
    /// pool for every rank of the path.
    pub fn host_paths(&self) -> RowPaths {
        crate::host_rows::host_paths(&self.inner.host)
    }

    /// `communicator` with this path's experts ([`paths`](Self::paths)) and, for every kind it
    /// has none of, its host paths ([`host_paths`](Self::host_paths)): NCCL's ranks keep their
    /// device rows and offload, a group of thread ranks (or the emulated exchange) gets the
    /// page-locked ones. What [`with_cublas`] returns.
    pub fn adding_to(&self, communicator: Arc<dyn Communicator>) -> Arc<dyn Communicator> {
        let own = communicator.row_paths().cloned().unwrap_or_default();
        let added = self.paths().merged(&self.host_paths().absent_from(&own));
        Arc::new(WithRowPaths::adding(communicator, added))
    }

    /// Whether any lane's spinning kernel gave up waiting for its stream (a host read per lane:
    /// for checks and benchmarks, not the training loop).
    ///
    /// # Errors
    /// [`MoeError::Backend`] naming the section, or if the flags cannot be read.
    pub fn check(&self, client: &ComputeClient<CudaRuntime>) -> Result<()> {
        let lanes: Vec<_> = lock(&self.inner.lanes).values().cloned().collect();
        for lane in lanes {
            if let Some(seq) = lock(&lane).gave_up(client)? {
                return Err(MoeError::Backend(format!(
                    "CUDA expert path: the cubecl stream stopped waiting for section {seq} of a lane \
                     after {} turns: its results are not to be trusted",
                    handover::SPIN_BOUND
                )));
            }
        }
        Ok(())
    }

    /// Runs `task` (a section with everything it prepares) with the calling thread's lane on
    /// cubecl's device thread, whose every client call then runs inline instead of as a
    /// blocking round trip to that thread.
    ///
    /// cubecl-cuda's client hands each call to a device thread through a channel; a call that
    /// returns something (`get_resource`, `flush`) waits for the thread to drain its queue and
    /// answer (cubecl-common 0.10 `device/handle/channel.rs`, `run_scoped`), and a call made on
    /// that thread runs at once (`send`: `is_device_runner_thread`). A section took about ten
    /// such round trips (an address per operand and scratch buffer, the hand-over's flush); the
    /// device sat idle through them wherever the queue ran dry (one H200: the GPU busy 1.9 ms of
    /// a 3.3 ms layer step at GPT3-S, BENCHMARKS §14b). `ComputeClient::exclusive`
    /// (cubecl-runtime `client.rs`) runs a closure there with the caller's stream id, so the
    /// section costs one.
    ///
    /// The lane is found here, before the hop: creating one makes client calls while holding
    /// the lane table's lock, and a task on the device thread that waited for that lock would
    /// never let them answer. Nothing in a task reads device memory.
    fn on_device_thread<T: Send + 'static>(
        &self,
        client: &ComputeClient<CudaRuntime>,
        task: impl FnOnce(Arc<Mutex<Lane>>) -> Result<T> + Send,
    ) -> Result<T> {
        let lane = self.lane()?;
        client
            .exclusive(move || task(lane))
            .map_err(|e| err("cubecl's device thread", e))?
    }

    /// The calling thread's lane (its cubecl stream's).
    fn lane(&self) -> Result<Arc<Mutex<Lane>>> {
        let key = StreamId::current().value;
        let mut lanes = lock(&self.inner.lanes);
        if let Some(lane) = lanes.get(&key) {
            return Ok(lane.clone());
        }
        let lane = Arc::new(Mutex::new(Lane::new(
            &self.inner.context,
            self.inner.options.handover,
            self.inner.options.timed,
        )?));
        lanes.insert(key, lane.clone());
        Ok(lane)
    }
}

/// `communicator` with the CUDA expert path of GPU `ordinal` added to the paths it offers:
/// the layers built with it run their experts' GEMMs on cuBLAS at their config's
/// `gemm_precision` (a group of thread ranks, a single rank, or NCCL's ranks, whose row paths
/// stay), and where the communicator has no rows' all-to-all or offload of its own, the
/// page-locked host ones ([`CublasExperts::adding_to`]).
///
/// # Errors
/// As [`CublasExperts::new`].
pub fn with_cublas(communicator: Arc<dyn Communicator>, ordinal: usize) -> Result<Arc<dyn Communicator>> {
    Ok(CublasExperts::new(ordinal)?.adding_to(communicator))
}

impl Inner {
    /// Where the bf16 copies of `experts`' weights are kept: the step's store or the pass's
    /// (see [`CublasOptions::bf16_weights_per_step`]).
    fn halves_store<'g>(&self, experts: &'g ExpertGroups<CudaMoe<f32>>) -> &'g PassStore {
        match self.options.bf16_weights_per_step {
            true => &experts.step,
            false => &experts.pass,
        }
    }

    /// Runs `role`'s products on the lane: the products of each shape that several experts
    /// share as one batched call (where the options ask for it and cuBLAS accepts the
    /// precision), the rest grouped where they may and where they are small, looped otherwise.
    ///
    /// Every call of the role gets its own part of the lane's pointer table, so that no call
    /// depends on stream order to keep its pointers from the next call's.
    fn run(&self, lane: &mut Lane, role: &Role, precision: GemmPrecision) -> Result<()> {
        if role.products.is_empty() {
            return Ok(());
        }
        let table = lane.table(3 * role.products.len())?;
        let mut rest: Vec<usize> = (0..role.products.len()).collect();
        let mut used = 0;
        if self.options.batched && !lane.refused(Call::Batched, precision) {
            let split = role.batches();
            if !split.batches.is_empty() {
                rest = split.rest;
                let stream = lane.stream.clone();
                for (i, batch) in split.batches.iter().enumerate() {
                    let at = table + (24 * used) as u64;
                    if !role.run_batched(lane.handle(), &stream, &self.kernels, at, precision, batch)? {
                        lane.refuse(Call::Batched, precision);
                        rest.extend(split.batches[i..].iter().flat_map(|b| b.products.iter().copied()));
                        rest.sort_unstable();
                        break;
                    }
                    let kind = match batch.addressing {
                        Addressing::Strided { .. } => CallCounters::STRIDED,
                        Addressing::Pointers => CallCounters::POINTERS,
                    };
                    self.calls.add(kind, 1);
                    used += batch.products.len();
                }
            }
        }
        match rest.len() {
            0 => Ok(()),
            n if n == role.products.len() => self.run_unbatched(lane, role, precision, table),
            _ => self.run_unbatched(lane, &role.subset(&rest), precision, table + (24 * used) as u64),
        }
    }

    /// Runs `role`'s products grouped where it may and where the products are small, looped
    /// otherwise; a grouped call's pointers go to `table`.
    ///
    /// cuBLAS's grouped call won where each expert's product was under about 5 GFLOP (GPT3-S
    /// and BERT-L at 512 rows an expert: 1.34 against 1.76 ms, 1.80 against 2.09 ms at TF32 on
    /// the H100) and lost above it (BERT-L at 1024 rows: 3.35 against 2.60 ms; GPT3-XL at 512
    /// rows: 6.20 against 4.84 ms), where one `cublasGemmEx` per expert gets cuBLAS's best
    /// kernel for its shape (BENCHMARKS §14).
    fn run_unbatched(
        &self,
        lane: &mut Lane,
        role: &Role,
        precision: GemmPrecision,
        table: u64,
    ) -> Result<()> {
        let flops: f64 = role.products.iter().map(|p| 2.0 * (p.m * p.n * p.k) as f64).sum();
        let small = flops / (role.products.len() as f64) < GROUPED_BELOW_FLOPS;
        if self.grouped && small && !lane.refused(Call::Grouped, precision) {
            let stream = lane.stream.clone();
            if role.run_grouped(lane.handle(), &stream, &self.kernels, table, precision)? {
                self.calls.add(CallCounters::GROUPED, 1);
                return Ok(());
            }
            lane.refuse(Call::Grouped, precision);
        }
        role.run_looped(lane.handle(), precision)?;
        self.calls.add(CallCounters::LOOPED, role.products.len());
        Ok(())
    }

    /// Runs `work` as one section of the calling thread's lane: hands over in, runs, and hands
    /// back out whether `work` succeeded or not (so the cubecl stream is never left waiting).
    fn section(
        &self,
        client: &ComputeClient<CudaRuntime>,
        work: impl FnOnce(&Self, &mut Lane) -> Result<()>,
        lane: &Arc<Mutex<Lane>>,
    ) -> Result<()> {
        let mut lane = lock(lane);
        self.calls.add(CallCounters::SECTIONS, 1);
        self.context.bind_to_thread().map_err(|e| err("context", e))?;
        // A timed lane's marks (nothing otherwise): the hand-over in is the lane's wait for
        // cubecl's stream, the hand-over out cubecl's order after the lane's work.
        lane.open_marks()?;
        let section = lane.enter(client, &self.kernels)?;
        let result = lane.mark("hand-over in").and_then(|()| work(self, &mut lane));
        let left = lane.leave(client, &self.kernels, section);
        let marked = lane.mark("hand-over out").and(lane.close_marks());
        result.and(left).and(marked)
    }
}

impl ExpertPath<CudaMoe<f32>> for CublasExperts {
    /// Scratch for every row of the partition (`forward.rs`'s activation; `backward.rs`'s
    /// `dA`, activation, `dT_M` and recomputed `T_M`); at bf16, the operands' copies
    /// (`operands.rs`), the weights' kept for the pass or, with
    /// [`CublasOptions::bf16_weights_per_step`], for the step.
    fn route(&self, precision: GemmPrecision) -> mpipemoe::memory::ExpertRoute {
        let operands = GemmOperands::at(precision, self.inner.options.bf16_weights_per_step);
        mpipemoe::memory::ExpertRoute::PartitionScratch { operands }
    }

    /// One `cublasGemmEx` at `precision` into a new tensor (`dense.rs`).
    fn matmul(
        &self,
        lhs: CubeTensor<CudaRuntime>,
        rhs: CubeTensor<CudaRuntime>,
        precision: GemmPrecision,
    ) -> Result<CubeTensor<CudaRuntime>> {
        dense::matmul(self, lhs, rhs, precision)
    }

    /// Every pair in one section (`dense.rs`): the products of one step of the primitives'
    /// experts (those with adapters) cost one trip to cubecl's device thread and one hand-over,
    /// not one each.
    fn matmuls(
        &self,
        pairs: Vec<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)>,
        precision: GemmPrecision,
    ) -> Result<Vec<CubeTensor<CudaRuntime>>> {
        dense::matmuls(self, pairs, precision)
    }

    /// Every head's product in one section, one strided batched call where cuBLAS takes it
    /// (`dense.rs`).
    fn heads_matmul(
        &self,
        lhs: CubeTensor<CudaRuntime>,
        rhs: CubeTensor<CudaRuntime>,
        precision: GemmPrecision,
    ) -> Result<CubeTensor<CudaRuntime>> {
        dense::heads_matmul(self, lhs, rhs, precision)
    }

    fn forward(
        &self,
        job: ExpertForward<'_, CudaMoe<f32>>,
    ) -> Result<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)> {
        forward::forward(self, job)
    }

    fn backward(&self, job: ExpertBackward<'_, CudaMoe<f32>>) -> Result<ExpertBackwardOut<CudaMoe<f32>>> {
        backward::backward(self, job)
    }

    fn multiplies_dense(&self) -> bool {
        self.inner.options.dense
    }
}
