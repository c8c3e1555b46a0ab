//! `Nccl`: expert-parallel ranks over NCCL, one GPU each, as processes (torchrun-style) or as
//! threads of one process driving several GPUs.
//!
//! Every transfer is one NCCL group of sends and receives posted by mpipemoe's
//! [`post_all_to_all_v`] through [`NcclTransport`], the device twin of the host transport the
//! CPU tests run. The rows' all-to-all of the layer stays on the device ([`crate::rows`]); the
//! counts and the other small collectives go through the host-bytes [`Communicator`] contract,
//! copied to the device and back.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use mpipemoe::comm::{post_all_to_all_v, Payload, PeerLayout, PeerTransport, RowPaths};
use mpipemoe::{Communicator, MoeError, RankContext, Result};

use crate::bootstrap::{env_usize, rank_from_env, rendezvous_from_env};
use crate::group::{NcclOps, Poll, Wait};
use crate::payload::{decode, encode, MAX_PAYLOAD_BYTES};

/// One rank of an NCCL group.
#[derive(Debug, Clone)]
pub struct Nccl {
    pub(crate) shared: Arc<NcclShared>,
    paths: RowPaths,
    emulate_network: bool,
}

/// What a rank's communicator and its device row path share.
#[derive(Debug)]
pub(crate) struct NcclShared {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    comm: Mutex<RawComm>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) context: Arc<CudaContext>,
    /// How long one transfer may take before the group is declared failed, in milliseconds
    /// (atomic: the row paths share this struct, and the timeout may be set afterwards).
    timeout_ms: AtomicU64,
    /// How long [`Communicator::arrival_barrier`] waits, in milliseconds.
    arrival_ms: AtomicU64,
    /// The one-process group's record of a failed rank thread ([`Nccl::run_local`]); unset
    /// for a rank per process.
    watch: OnceLock<Arc<GroupWatch>>,
}

/// The first failure of a rank thread of a one-process group, which the peers' waits read
/// ([`NcclOps::peer_failure`]) so that they stop at once: a rank that errs before its first
/// collective (out of memory while building its model, a bad checkpoint) never posts its
/// half, and its peers would otherwise wait out the whole timeout.
#[derive(Debug, Default)]
pub(crate) struct GroupWatch {
    failed: Mutex<Option<(usize, String)>>,
}

impl GroupWatch {
    /// Records rank `rank`'s failure, unless one came first.
    fn fail(&self, rank: usize, reason: String) {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        failed.get_or_insert((rank, reason));
    }

    /// The failure of a rank other than `me`, as a wait's reason to stop.
    fn failure_for(&self, me: usize) -> Option<String> {
        let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        match &*failed {
            Some((rank, reason)) if *rank != me => {
                Some(format!("rank {rank} of this process failed: {reason}"))
            }
            _ => None,
        }
    }
}

/// An NCCL communicator handle: closed with `ncclCommFinalize` + `ncclCommDestroy` when its
/// rank is done with it ([`RawComm::close`]), aborted on every error path and on a drop that
/// was not preceded by a close.
#[derive(Debug)]
struct RawComm {
    handle: nccl_sys::ncclComm_t,
    /// Aborted or destroyed: the handle must not be used again.
    aborted: bool,
}

impl RawComm {
    fn new(handle: nccl_sys::ncclComm_t) -> Self {
        Self {
            handle,
            aborted: false,
        }
    }

    /// Aborts the communicator, which stops its kernels that wait for a peer.
    fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            // SAFETY: the handle is live (not aborted or destroyed before).
            unsafe {
                let _ = nccl::comm_abort(self.handle);
            }
        }
    }

    /// The orderly end of a healthy communicator: `ncclCommFinalize` (non-blocking, so polled
    /// until done, at most `timeout`), then `ncclCommDestroy`, which frees its resources. A
    /// finalize that fails or does not finish aborts instead (through [`Wait`]).
    fn close(&mut self, rank: usize, timeout: Duration) -> Result<()> {
        if self.aborted {
            return Ok(());
        }
        // SAFETY: the handle is live.
        if let Err(e) = unsafe { nccl::comm_finalize(self.handle) } {
            self.abort();
            return Err(nccl_err("finalize", rank, e));
        }
        let wait = Wait {
            op: "finalize",
            rank,
            timeout,
        };
        wait.until_ready(&mut CommOps(self), "ncclCommFinalize")?;
        self.aborted = true;
        // SAFETY: finalized, so no operation is outstanding; the handle is not used again.
        unsafe { nccl::comm_destroy(self.handle) }
            .map(|_| ())
            .map_err(|e| nccl_err("destroy", rank, e))
    }
}

/// The non-blocking configuration every communicator of this crate is created with: NCCL's
/// `NCCL_CONFIG_INITIALIZER` (size, magic, the version of the headers cudarc's bindings were
/// generated from, every other field unset) with `blocking = 0`, so that
/// `ncclCommInitRankConfig` and `ncclCommSplit` return at once and are polled against the
/// crate's timeout ([`Wait::until_ready`]) instead of blocking forever for a peer that died.
fn non_blocking_config() -> nccl_sys::ncclConfig_t {
    const UNDEF: std::ffi::c_int = std::ffi::c_int::MIN;
    nccl_sys::ncclConfig_t {
        size: std::mem::size_of::<nccl_sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        // NCCL_VERSION(2, 30, 0): cudarc's `nccl` feature binds NCCL 2.30's headers, whose
        // `ncclConfig_t` has exactly these fields; NCCL reads the fields its version knows.
        version: 2 * 10_000 + 30 * 100,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

/// [`NcclOps`] of a communicator alone (no stream): what initialisation, split and finalize
/// poll.
struct CommOps<'a>(&'a mut RawComm);

impl NcclOps for CommOps<'_> {
    fn group_end(&mut self) -> Poll {
        Poll::Ready
    }

    fn async_state(&mut self) -> Poll {
        async_state(self.0)
    }

    fn stream_state(&mut self) -> Poll {
        Poll::Ready
    }

    fn abort(&mut self) {
        self.0.abort();
    }
}

/// `ncclCommGetAsyncError` of a live communicator as a [`Poll`].
fn async_state(comm: &RawComm) -> Poll {
    if comm.aborted {
        return Poll::Failed("the communicator was aborted".into());
    }
    let mut state = nccl_sys::ncclResult_t::ncclSuccess;
    // SAFETY: the handle is live (not aborted or destroyed).
    let asked = unsafe { nccl_sys::ncclCommGetAsyncError(comm.handle, &mut state) };
    match (asked, state) {
        (nccl_sys::ncclResult_t::ncclSuccess, nccl_sys::ncclResult_t::ncclSuccess) => Poll::Ready,
        (nccl_sys::ncclResult_t::ncclSuccess, nccl_sys::ncclResult_t::ncclInProgress) => Poll::Pending,
        (nccl_sys::ncclResult_t::ncclSuccess, state) => Poll::Failed(format!("{state:?}")),
        (asked, _) => Poll::Failed(format!("ncclCommGetAsyncError: {asked:?}")),
    }
}

// SAFETY: NCCL allows a communicator to be used from any thread as long as calls on it do not
// run concurrently; every use goes through the `Mutex` in `NcclShared`, which serialises them.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        // A communicator dropped without `close` (a panic, or a rank's error unwinding): abort
        // rather than finalize, which would wait for outstanding work that a failed peer never
        // completes.
        self.abort();
    }
}

impl Drop for NcclShared {
    /// The success path's teardown: finalize and destroy, bounded by the transfer timeout
    /// (a failure or timeout aborts, see [`RawComm::close`]).
    fn drop(&mut self) {
        let timeout = Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed));
        let comm = self.comm.get_mut().unwrap_or_else(|e| e.into_inner());
        if self.context.bind_to_thread().is_err() {
            comm.abort();
            return;
        }
        if let Err(e) = comm.close(self.rank, timeout) {
            eprintln!(
                "mpipemoe-cuda: closing rank {}'s NCCL communicator: {e}",
                self.rank
            );
        }
    }
}

fn nccl_err(op: &str, rank: usize, e: impl std::fmt::Debug) -> MoeError {
    MoeError::comm(op, rank, format!("NCCL: {e:?}"))
}

fn cuda_err(op: &str, rank: usize, e: impl std::fmt::Debug) -> MoeError {
    MoeError::comm(op, rank, format!("CUDA: {e:?}"))
}

impl Nccl {
    /// Joins the group described by torchrun's environment: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`
    /// (the GPU; default `RANK` modulo the device count) and `MASTER_ADDR`, where rank 0 hands
    /// out the NCCL id over TCP on port `MPIPEMOE_RENDEZVOUS_PORT`, or `MASTER_PORT + 1`
    /// (torchrun's own store holds `MASTER_PORT`; see [`crate::bootstrap`]). Waits at most
    /// `timeout` for the rendezvous and for NCCL's initialisation.
    pub fn from_env(timeout: Duration) -> Result<Self> {
        crate::cuda_available().map_err(|e| MoeError::Backend(e.to_string()))?;
        crate::nccl_available().map_err(|e| MoeError::Backend(e.to_string()))?;
        let (rank, _) = rank_from_env()?;
        let devices = CudaContext::device_count().map_err(|e| cuda_err("init", rank, e))? as usize;
        let ordinal = env_usize("LOCAL_RANK", rank % devices.max(1))?;
        if ordinal >= devices {
            return Err(MoeError::Backend(format!(
                "LOCAL_RANK {ordinal} names a GPU, but this machine has {devices}"
            )));
        }
        let make_id = || {
            let id = nccl::get_uniqueid().map_err(|e| nccl_err("init", rank, e))?;
            Ok(std::array::from_fn(|i| id.internal[i] as u8))
        };
        let (rank, world, bytes) = rendezvous_from_env(make_id, timeout)?;
        let id = nccl_sys::ncclUniqueId {
            internal: std::array::from_fn(|i| bytes[i] as std::ffi::c_char),
        };
        Self::join(rank, world, ordinal, id, timeout)
    }

    /// `rank` of `world` on GPU `ordinal`, with the group's id.
    ///
    /// The communicator is created non-blocking (`ncclCommInitRankConfig`, `blocking = 0`)
    /// and polled until ready for at most `timeout`: a peer that dies before first contact is
    /// an error naming the wait, with the communicator aborted, instead of a hang.
    fn join(
        rank: usize,
        world: usize,
        ordinal: usize,
        id: nccl_sys::ncclUniqueId,
        timeout: Duration,
    ) -> Result<Self> {
        let context = CudaContext::new(ordinal).map_err(|e| cuda_err("init", rank, e))?;
        let stream = context.new_stream().map_err(|e| cuda_err("init", rank, e))?;
        let mut comm = std::ptr::null_mut();
        let mut config = non_blocking_config();
        // SAFETY: `comm` is written by NCCL (the handle is valid to poll and abort even while
        // the initialisation is in progress); the id is the group's; the config outlives the
        // call.
        unsafe {
            nccl_sys::ncclCommInitRankConfig(&mut comm, world as i32, id, rank as i32, &mut config)
                .result()
                .map_err(|e| nccl_err("init", rank, e))?;
        }
        if comm.is_null() {
            return Err(nccl_err(
                "init",
                rank,
                "ncclCommInitRankConfig returned no communicator",
            ));
        }
        let mut raw = RawComm::new(comm);
        let wait = Wait {
            op: "init",
            rank,
            timeout,
        };
        wait.until_ready(&mut CommOps(&mut raw), "ncclCommInitRankConfig")?;
        Self::from_parts(rank, world, raw, stream, context)
    }

    fn from_parts(
        rank: usize,
        world: usize,
        comm: RawComm,
        stream: Arc<CudaStream>,
        context: Arc<CudaContext>,
    ) -> Result<Self> {
        let shared = Arc::new(NcclShared {
            rank,
            world,
            comm: Mutex::new(comm),
            stream,
            context,
            timeout_ms: AtomicU64::new(DEFAULT_TIMEOUT.as_millis() as u64),
            arrival_ms: AtomicU64::new(DEFAULT_ARRIVAL_TIMEOUT.as_millis() as u64),
            watch: OnceLock::new(),
        });
        Ok(Self {
            paths: crate::rows::row_paths(&shared)?,
            shared,
            emulate_network: false,
        })
    }

    /// One rank per GPU for GPUs `0..n_gpus` of this machine, in one process: what one
    /// 8-GPU node needs without a launcher. Hand each rank to a thread of its own, as
    /// [`mpipemoe::LocalGroup::run`] does for the CPU.
    ///
    /// Every communicator is created non-blocking, as [`Nccl::from_env`]'s are: one unique
    /// id, then `ncclCommInitRankConfig` with `blocking = 0` for each GPU inside one NCCL
    /// group (NCCL requires the group when one thread initialises several ranks), each
    /// polled until ready for at most `timeout`. Not `ncclCommInitAll`: it creates
    /// *blocking* communicators (it passes `NCCL_CONFIG_INITIALIZER`, NCCL 2.30.7
    /// `src/init.cc:2585`),
    /// whose `ncclGroupEnd` then blocks in the connection setup of the first transfer, and a
    /// rank thread that failed before its first collective would leave its peers there
    /// forever, before any timer of ours could start.
    ///
    /// # Errors
    /// [`MoeError::Backend`] without CUDA or NCCL, or for a count of GPUs the machine lacks;
    /// [`MoeError::Comm`] naming the rank whose initialisation failed or did not finish
    /// (every communicator made so far is aborted).
    pub fn local_group(n_gpus: usize, timeout: Duration) -> Result<Vec<Self>> {
        crate::cuda_available().map_err(|e| MoeError::Backend(e.to_string()))?;
        crate::nccl_available().map_err(|e| MoeError::Backend(e.to_string()))?;
        let devices = CudaContext::device_count().map_err(|e| cuda_err("init", 0, e))? as usize;
        if n_gpus == 0 || n_gpus > devices {
            return Err(MoeError::Backend(format!(
                "a local NCCL group of {n_gpus} GPUs on a machine with {devices}"
            )));
        }
        let id = nccl::get_uniqueid().map_err(|e| nccl_err("init", 0, e))?;
        let contexts = (0..n_gpus)
            .map(|gpu| CudaContext::new(gpu).map_err(|e| cuda_err("init", gpu, e)))
            .collect::<Result<Vec<_>>>()?;
        let world = n_gpus as i32;
        let mut handles: Vec<nccl_sys::ncclComm_t> = vec![std::ptr::null_mut(); n_gpus];
        let mut first_error = None;
        nccl::group_start().map_err(|e| nccl_err("init", 0, e))?;
        for (rank, context) in contexts.iter().enumerate() {
            // `ncclCommInitRankConfig` takes the device from the thread's current context.
            if let Err(e) = context.bind_to_thread() {
                first_error.get_or_insert(cuda_err("init", rank, e));
                continue;
            }
            let mut config = non_blocking_config();
            // SAFETY: the slot is this rank's (NCCL writes the handle at the call, before
            // the non-blocking work: `ncclCommInitRankDev`'s `*newcomm = comm`, NCCL 2.30.7
            // `src/init.cc:2515`); the config outlives the call.
            let made = unsafe {
                nccl_sys::ncclCommInitRankConfig(&mut handles[rank], world, id, rank as i32, &mut config)
                    .result()
            };
            if let Err(e) = made {
                first_error.get_or_insert(nccl_err("init", rank, e));
            }
        }
        // The group must be closed whatever happened inside it. Non-blocking, it returns at
        // once (`ncclInProgress`); the work is polled below.
        let closed = nccl::group_end();
        // From here every handle made is owned: an early return aborts them all.
        let mut raws: Vec<Option<RawComm>> = handles
            .into_iter()
            .map(|h| (!h.is_null()).then(|| RawComm::new(h)))
            .collect();
        if let Some(err) = first_error {
            return Err(err);
        }
        if let Err(e) = closed {
            return Err(nccl_err("init", 0, e));
        }
        for (rank, raw) in raws.iter_mut().enumerate() {
            let Some(raw) = raw else {
                return Err(nccl_err(
                    "init",
                    rank,
                    "ncclCommInitRankConfig returned no communicator",
                ));
            };
            let wait = Wait {
                op: "init",
                rank,
                timeout,
            };
            wait.until_ready(&mut CommOps(raw), "ncclCommInitRankConfig")?;
        }
        raws.into_iter()
            .zip(contexts)
            .enumerate()
            .map(|(rank, (raw, context))| {
                let raw = raw.expect("checked above");
                let stream = context.new_stream().map_err(|e| cuda_err("init", rank, e))?;
                Self::from_parts(rank, n_gpus, raw, stream, context)
            })
            .collect()
    }

    /// Runs `f` on one thread per GPU of `0..n_gpus`, each with its rank's communicator (from
    /// [`Nccl::local_group`]), and returns the results in rank order: [`LocalGroup::run`]'s
    /// shape for one process driving a node's GPUs. A rank's own error or panic is preferred
    /// over the timeouts it causes in its peers (which end after [`Nccl::with_timeout`]).
    ///
    /// [`LocalGroup::run`]: mpipemoe::LocalGroup::run
    pub fn run_local<T, F>(n_gpus: usize, timeout: Duration, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(RankContext) -> Result<T> + Sync,
    {
        let ranks = Self::local_group(n_gpus, timeout)?;
        let watch = Arc::new(GroupWatch::default());
        for nccl in &ranks {
            let _ = nccl.shared.watch.set(watch.clone());
        }
        let results: Vec<Result<T>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|nccl| {
                    let (f, watch) = (&f, &watch);
                    scope.spawn(move || {
                        let rank = nccl.shared.rank;
                        let ctx = RankContext {
                            rank,
                            n_ranks: n_gpus,
                            comm: Arc::new(nccl.with_timeout(timeout)),
                        };
                        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(ctx)))
                            .unwrap_or_else(|payload| Err(MoeError::from_panic(payload, rank)));
                        // A rank's own failure (not its report of a peer's) stops the
                        // peers' waits now rather than at their timeout.
                        if let Err(e) = &result {
                            if !e.is_peer_failure() {
                                watch.fail(rank, e.to_string());
                            }
                        }
                        result
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| {
                    h.join()
                        .unwrap_or_else(|_| Err(MoeError::comm("run", rank, "rank thread panicked")))
                })
                .collect()
        });
        let errors: Vec<&MoeError> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        let own = errors
            .iter()
            .find(|e| !matches!(e, MoeError::Comm { .. } | MoeError::PeerFailed { .. }));
        if let Some(err) = own.or(errors.first()) {
            return Err((*err).clone());
        }
        results.into_iter().collect()
    }

    /// The GPU (device ordinal on this machine) this rank's communicator runs on: where the
    /// rank's tensors must live (`CudaDevice::new(gpu)`).
    pub fn gpu(&self) -> usize {
        self.shared.context.ordinal()
    }

    /// How long one transfer may wait for its peers before this rank aborts the communicator
    /// and returns an error (default 120 s, as the CPU group's): NCCL itself waits forever for
    /// a peer that died.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        self.shared.timeout_ms.store(ms, Ordering::Relaxed);
        self
    }

    /// How long [`arrival_barrier`](Communicator::arrival_barrier) waits for its peers
    /// (default 30 minutes, PyTorch's default process-group timeout): where ranks come apart
    /// by design, one writing a checkpoint or loading a slower one, far longer than a
    /// transfer may take.
    pub fn with_arrival_timeout(self, timeout: Duration) -> Self {
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        self.shared.arrival_ms.store(ms, Ordering::Relaxed);
        self
    }

    /// With one rank, sends every all-to-all through NCCL's path anyway (a local device copy)
    /// instead of skipping it: how a single GPU exercises the device row path.
    pub fn with_emulated_network(mut self, on: bool) -> Self {
        self.emulate_network = on;
        self
    }
}

impl NcclShared {
    /// Runs `post` on a transport over this rank's communicator and NCCL stream, between the
    /// device buffers at `send` and `recv`: the lock, the aborted check and the context binding
    /// every device transfer needs.
    fn with_transport<R>(
        &self,
        op: &str,
        (send, recv): (u64, u64),
        timeout: Duration,
        post: impl FnOnce(&mut NcclTransport<'_>) -> Result<R>,
    ) -> Result<R> {
        let mut comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        if comm.aborted {
            return Err(MoeError::comm(
                op,
                self.rank,
                "the NCCL communicator was aborted after an earlier error or timeout",
            ));
        }
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_err(op, self.rank, e))?;
        let mut transport = NcclTransport {
            watch: self.watch.get().cloned(),
            comm: &mut comm,
            stream: self.stream.cu_stream(),
            send,
            recv,
            rank: self.rank,
            op,
            timeout,
        };
        post(&mut transport)
    }

    /// How long one transfer may wait for its peers.
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// How long an arrival barrier may wait for its peers.
    fn arrival_timeout(&self) -> Duration {
        Duration::from_millis(self.arrival_ms.load(Ordering::Relaxed))
    }

    /// Runs one all-to-all-v between device buffers at `send` and `recv` on this rank's NCCL
    /// stream, and waits for it.
    pub(crate) fn all_to_all_device(
        &self,
        op: &str,
        send: u64,
        recv: u64,
        layout: &PeerLayout,
    ) -> Result<()> {
        self.all_to_all_within(op, (send, recv), layout, self.timeout())
    }

    /// [`all_to_all_device`](Self::all_to_all_device) bounded by `timeout`.
    fn all_to_all_within(
        &self,
        op: &str,
        buffers: (u64, u64),
        layout: &PeerLayout,
        timeout: Duration,
    ) -> Result<()> {
        self.with_transport(op, buffers, timeout, |t| post_all_to_all_v(t, self.rank, layout))
    }

    /// Runs one collective over `count` elements of `dtype` from the device buffer at `send`
    /// into the one at `recv` on this rank's NCCL stream: the sum over the group
    /// (`ncclAllReduce`, `root` `None`) or rank `root`'s buffer on every rank
    /// (`ncclBroadcast`), and waits for it with the same timeout and abort as the all-to-all.
    pub(crate) fn collective_device(
        &self,
        op: &str,
        (send, recv): (u64, u64),
        count: usize,
        dtype: nccl_sys::ncclDataType_t,
        root: Option<usize>,
    ) -> Result<()> {
        let root = match root.map(i32::try_from) {
            Some(Ok(root)) => Some(root),
            Some(Err(_)) => return Err(MoeError::comm(op, self.rank, "root rank out of range")),
            None => None,
        };
        self.with_transport(op, (send, recv), self.timeout(), |t| {
            t.begin()?;
            let (handle, stream) = (t.comm.handle, t.stream as _);
            let (send, recv) = (send as *const std::ffi::c_void, recv as *mut std::ffi::c_void);
            // SAFETY: both buffers hold `count` elements of `dtype` (the caller sized them)
            // and outlive the group, which `end` waits for.
            let posted = unsafe {
                match root {
                    None => nccl::all_reduce(
                        send,
                        recv,
                        count,
                        dtype,
                        nccl_sys::ncclRedOp_t::ncclSum,
                        handle,
                        stream,
                    ),
                    Some(root) => nccl::broadcast(send, recv, count, dtype, root, handle, stream),
                }
            };
            if let Err(e) = posted {
                t.abandon();
                return Err(nccl_err(op, self.rank, e));
            }
            t.end()
        })
    }

    /// One round of host bytes: `send[peer]` goes to `peer`, `recv_len[peer]` bytes arrive
    /// from it, through one device buffer each way, waiting at most `timeout`.
    fn round(
        &self,
        op: &str,
        send: &[Vec<u8>],
        recv_len: &[usize],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>> {
        let send_len: Vec<usize> = send.iter().map(Vec::len).collect();
        let layout = PeerLayout::new(&send_len, recv_len, 1)?;
        let s = &self.stream;
        let err = |e| cuda_err(op, self.rank, e);
        // NCCL cannot take zero-length allocations: keep at least one byte each way.
        let mut flat = send.concat();
        flat.resize(layout.send_bytes().max(1), 0);
        let device_send = s.clone_htod(&flat).map_err(err)?;
        let device_recv = s.alloc_zeros::<u8>(layout.recv_bytes().max(1)).map_err(err)?;
        {
            let (send_ptr, _send_sync) = device_send.device_ptr(s);
            let (recv_ptr, _recv_sync) = device_recv.device_ptr(s);
            // The copies above are on the same stream, so they complete before the group runs.
            self.all_to_all_within(op, (send_ptr, recv_ptr), &layout, timeout)?;
        }
        let flat = s.clone_dtoh(&device_recv).map_err(err)?;
        Ok(layout.recv.iter().map(|r| flat[r.clone()].to_vec()).collect())
    }
}

/// The device side of [`PeerTransport`]: raw `ncclSend` / `ncclRecv` at byte offsets of two
/// device buffers, a device copy for the own rows, on one stream.
struct NcclTransport<'a> {
    /// The one-process group's failure record, if this rank is in one.
    watch: Option<Arc<GroupWatch>>,
    comm: &'a mut RawComm,
    stream: cudarc::driver::sys::CUstream,
    send: u64,
    recv: u64,
    rank: usize,
    op: &'a str,
    timeout: Duration,
}

impl NcclTransport<'_> {
    /// Posts one `ncclSend` (`send` true) or `ncclRecv` of `bytes` at their offset in the send
    /// or receive buffer.
    fn post(&mut self, send: bool, peer: usize, bytes: Range<usize>) -> Result<()> {
        let u8_type = nccl_sys::ncclDataType_t::ncclUint8;
        let (comm, stream) = (self.comm.handle, self.stream as _);
        // SAFETY: the range lies in its buffer (`PeerLayout` built it from the same counts the
        // buffers were sized by), and both buffers outlive the group (`end` waits for it).
        let posted = unsafe {
            if send {
                let ptr = (self.send + bytes.start as u64) as *const std::ffi::c_void;
                nccl::send(ptr, bytes.len(), u8_type, peer as i32, comm, stream)
            } else {
                let ptr = (self.recv + bytes.start as u64) as *mut std::ffi::c_void;
                nccl::recv(ptr, bytes.len(), u8_type, peer as i32, comm, stream)
            }
        };
        posted.map(|_| ()).map_err(|e| nccl_err(self.op, self.rank, e))
    }
}

impl PeerTransport for NcclTransport<'_> {
    fn begin(&mut self) -> Result<()> {
        nccl::group_start()
            .map(|_| ())
            .map_err(|e| nccl_err(self.op, self.rank, e))
    }

    fn send(&mut self, peer: usize, bytes: Range<usize>) -> Result<()> {
        self.post(true, peer, bytes)
    }

    fn recv(&mut self, peer: usize, bytes: Range<usize>) -> Result<()> {
        self.post(false, peer, bytes)
    }

    fn copy_local(&mut self, from: Range<usize>, to: Range<usize>) -> Result<()> {
        // SAFETY: both ranges lie in their buffers and have the same length.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                self.recv + to.start as u64,
                self.send + from.start as u64,
                from.len(),
                self.stream,
            )
        }
        .map_err(|e| cuda_err(self.op, self.rank, e))
    }

    /// Ends the group NCCL holds open on this thread (its result is of no use: a post already
    /// failed) and aborts the communicator, because what was posted may wait for peers that
    /// will never see this rank's other half; later transfers on it are errors that say so.
    fn abandon(&mut self) {
        let _ = nccl::group_end();
        self.comm.abort();
    }

    /// Closes the group and waits for it ([`Wait::end_group`]): every error path, a failed
    /// `ncclGroupEnd` and a failed stream included, aborts the communicator.
    fn end(&mut self) -> Result<()> {
        let wait = Wait {
            op: self.op,
            rank: self.rank,
            timeout: self.timeout,
        };
        wait.end_group(self)
    }
}

impl NcclOps for NcclTransport<'_> {
    fn group_end(&mut self) -> Poll {
        match nccl::group_end() {
            Ok(nccl::NcclStatus::InProgress) => Poll::Pending,
            Ok(_) => Poll::Ready,
            Err(e) => Poll::Failed(format!("{e:?}")),
        }
    }

    fn async_state(&mut self) -> Poll {
        async_state(self.comm)
    }

    fn stream_state(&mut self) -> Poll {
        use cudarc::driver::sys::{cuStreamQuery, CUresult};
        // SAFETY: the stream belongs to this rank's context, which is bound to this thread.
        match unsafe { cuStreamQuery(self.stream) } {
            CUresult::CUDA_SUCCESS => Poll::Ready,
            CUresult::CUDA_ERROR_NOT_READY => Poll::Pending,
            other => Poll::Failed(format!("{other:?}")),
        }
    }

    fn abort(&mut self) {
        self.comm.abort();
    }

    fn peer_failure(&mut self) -> Option<String> {
        self.watch.as_ref()?.failure_for(self.rank)
    }
}

impl Communicator for Nccl {
    fn rank(&self) -> usize {
        self.shared.rank
    }

    fn n_ranks(&self) -> usize {
        self.shared.world
    }

    fn is_identity(&self) -> bool {
        self.shared.world == 1 && !self.emulate_network
    }

    fn row_paths(&self) -> Option<&RowPaths> {
        Some(&self.paths)
    }

    /// `ncclCommSplit` with this rank as the key: a communicator of its own (its own NCCL
    /// stream, the same GPU and timeout) for the ranks that pass the same color. Like every
    /// NCCL communicator creation it blocks until every rank of this group has called it.
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>> {
        let op = "split";
        let shared = &self.shared;
        let color = i32::try_from(color)
            .map_err(|_| MoeError::comm(op, shared.rank, format!("color {color} does not fit NCCL's int")))?;
        let mut comm = shared.comm.lock().unwrap_or_else(|e| e.into_inner());
        if comm.aborted {
            return Err(MoeError::comm(
                op,
                shared.rank,
                "the NCCL communicator was aborted",
            ));
        }
        shared
            .context
            .bind_to_thread()
            .map_err(|e| cuda_err(op, shared.rank, e))?;
        // Where NCCL writes the child's handle. Not a local: with a non-blocking parent,
        // NCCL's split job writes `*newcomm` when it *finishes*, on its own thread
        // (`ncclCommInitRankFunc`'s `exit:` label, success or failure alike: NCCL 2.30.7
        // `src/init.cc:1958-1961`; `ncclCommInitChildComm` only sets it to NULL at the call,
        // "NULL until comm split fully complete", `init.cc:3098-3099`). A heap slot stays
        // valid if this function returns before the job is done.
        let mut slot: Box<nccl_sys::ncclComm_t> = Box::new(std::ptr::null_mut());
        let mut config = non_blocking_config();
        let timeout = shared.timeout();
        // SAFETY: the parent handle is live (not aborted, held under its lock); the slot is
        // written by NCCL and outlives its job (see above); the config (non-blocking, so the
        // split is polled against the timeout rather than blocking until every rank calls
        // it) outlives the call.
        let split = unsafe {
            nccl_sys::ncclCommSplit(comm.handle, color, shared.rank as i32, &mut *slot, &mut config).result()
        };
        if let Err(e) = split {
            // The parent may be left mid-collective: abort it, as every error path does.
            comm.abort();
            return Err(nccl_err(op, shared.rank, e));
        }
        // A non-blocking parent is in progress until the split is done on every rank.
        let wait = Wait {
            op,
            rank: shared.rank,
            timeout,
        };
        if let Err(e) = wait.until_ready(&mut CommOps(&mut comm), "ncclCommSplit (the parent)") {
            // The wait aborted the parent, and `ncclCommAbort` joins the parent's pending
            // group job (`ncclCommEnsureReady` with the abort flag set calls
            // `ncclGroupJobAbort`, NCCL 2.30.7 `src/init.cc:422-426`, `3035-3040`, which sets
            // the job's abort flag and joins its thread, `src/group.cc:902-906`), whose split
            // job has then written the half-made child into the slot: abort it too (the drop
            // of `RawComm`), or it leaks with its connections and buffers.
            let half_made = std::mem::replace(&mut *slot, std::ptr::null_mut());
            if !half_made.is_null() {
                drop(RawComm::new(half_made));
            } else {
                // Nothing written yet: should the job still run, its late write must land
                // in memory that is still this slot's.
                Box::leak(slot);
            }
            return Err(e);
        }
        drop(comm);
        let new = *slot;
        if new.is_null() {
            return Err(nccl_err(
                op,
                shared.rank,
                "ncclCommSplit returned no communicator",
            ));
        }
        let mut raw = RawComm::new(new);
        wait.until_ready(&mut CommOps(&mut raw), "ncclCommSplit")?;
        // SAFETY: `raw.handle` is the live communicator just created.
        let (rank, world) = unsafe {
            (
                nccl::comm_user_rank(raw.handle).map_err(|e| nccl_err(op, shared.rank, e))?,
                nccl::comm_count(raw.handle).map_err(|e| nccl_err(op, shared.rank, e))?,
            )
        };
        let stream = shared
            .context
            .new_stream()
            .map_err(|e| cuda_err(op, shared.rank, e))?;
        let sub = Self::from_parts(rank as usize, world as usize, raw, stream, shared.context.clone())?
            .with_timeout(shared.timeout())
            .with_arrival_timeout(shared.arrival_timeout())
            .with_emulated_network(self.emulate_network);
        // A sub-group's waits watch the same rank threads.
        if let Some(watch) = shared.watch.get() {
            let _ = sub.shared.watch.set(watch.clone());
        }
        Ok(Arc::new(sub))
    }

    fn exchange(&self, op: &'static str, outgoing: Vec<Payload>) -> Result<Vec<Payload>> {
        self.exchange_within(op, outgoing, self.shared.timeout())
    }

    /// A barrier bounded by [`Nccl::with_arrival_timeout`]: two rounds of host bytes (sizes,
    /// then the empty payloads), each waiting up to the arrival bound.
    fn arrival_barrier(&self) -> Result<()> {
        let outgoing = vec![Payload::Counts(Vec::new()); self.shared.world];
        self.exchange_within("arrival_barrier", outgoing, self.shared.arrival_timeout())
            .map(|_| ())
    }
}

impl Nccl {
    /// [`Communicator::exchange`], each NCCL round waiting at most `timeout`.
    fn exchange_within(
        &self,
        op: &'static str,
        outgoing: Vec<Payload>,
        timeout: Duration,
    ) -> Result<Vec<Payload>> {
        let (rank, world) = (self.shared.rank, self.shared.world);
        if outgoing.len() != world {
            return Err(MoeError::comm(
                op,
                rank,
                format!("{} payloads for {world} ranks", outgoing.len()),
            ));
        }
        if world == 1 {
            return Ok(outgoing);
        }
        let send: Vec<Vec<u8>> = outgoing.iter().map(encode).collect();
        // First the sizes (eight bytes to and from every peer), then the payloads.
        let sizes: Vec<Vec<u8>> = send
            .iter()
            .map(|b| (b.len() as u64).to_le_bytes().to_vec())
            .collect();
        let got = self.shared.round(op, &sizes, &vec![8; world], timeout)?;
        let recv_len = got
            .iter()
            .enumerate()
            .map(|(src, b)| {
                let len = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
                usize::try_from(len)
                    .ok()
                    .filter(|&len| len <= MAX_PAYLOAD_BYTES)
                    .ok_or_else(|| {
                        MoeError::comm(op, rank, format!("rank {src} announced a {len}-byte payload"))
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        // In rounds of at most `ROUND_BYTES` per peer: the payloads pass through device
        // buffers that cudarc allocates outside cubecl's pool, and a gather of a layer's
        // experts for a save would otherwise put every expert on rank 0's GPU at once. Each
        // pair's chunk count follows from its length, which both ends know, so the ranks need
        // not agree on a round count: a rank with less to move takes fewer rounds, and chunk
        // `k` of a pair is in round `k` on both ends (zero-length transfers are not posted).
        let rounds = send
            .iter()
            .map(Vec::len)
            .chain(recv_len.iter().copied())
            .map(|n| n.div_ceil(ROUND_BYTES))
            .max()
            .unwrap_or(0);
        // Most payloads (counts, losses) take one round: sent as they are, no chunk copies.
        let received = match rounds {
            0 | 1 => self.shared.round(op, &send, &recv_len, timeout)?,
            _ => {
                let mut received: Vec<Vec<u8>> = recv_len.iter().map(|&n| Vec::with_capacity(n)).collect();
                for k in 0..rounds {
                    let part = |n: usize| (k * ROUND_BYTES).min(n)..((k + 1) * ROUND_BYTES).min(n);
                    let send_k: Vec<Vec<u8>> = send.iter().map(|b| b[part(b.len())].to_vec()).collect();
                    let recv_k: Vec<usize> = recv_len.iter().map(|&n| part(n).len()).collect();
                    let got = self.shared.round(op, &send_k, &recv_k, timeout)?;
                    for (into, chunk) in received.iter_mut().zip(got) {
                        into.extend_from_slice(&chunk);
                    }
                }
                received
            }
        };
        received
            .into_iter()
            .enumerate()
            .map(|(src, b)| {
                decode(&b)
                    .ok_or_else(|| MoeError::comm(op, rank, format!("rank {src} sent an unreadable payload")))
            })
            .collect()
    }
}

/// How long a transfer waits for its peers by default, as the CPU group does.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The most bytes a host payload moves to or from one peer in one NCCL round (the device
/// buffers of a round are at most this times the group's size each way).
const ROUND_BYTES: usize = 64 << 20;

/// How long an arrival barrier waits by default, as the CPU group does.
const DEFAULT_ARRIVAL_TIMEOUT: Duration = Duration::from_secs(30 * 60);
