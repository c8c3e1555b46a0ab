//! `Nccl`: expert-parallel ranks over NCCL, one GPU each, as processes (torchrun-style) or as
//! threads of one process driving several GPUs.
//!
//! Every transfer is one NCCL group of sends and receives posted by mpipemoe's
//! [`post_all_to_all_v`](mpipemoe::comm::post_all_to_all_v) through `NcclTransport`, the device
//! twin of the host transport the CPU tests run. The rows' all-to-all of the layer stays on the
//! device ([`crate::rows`]); the counts and the other small collectives go through the
//! host-bytes [`Communicator`](mpipemoe::Communicator) contract, copied to the device and back.
//!
//! The rooms: the communicator handle and its teardown (`raw.rs`), one process driving
//! several GPUs (`local.rs`), the transfers (`transport.rs`) and the `Communicator` contract
//! (`communicator.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use mpipemoe::comm::RowPaths;
use mpipemoe::{MoeError, Result};

use crate::bootstrap::{env_usize, rank_from_env, rendezvous_from_env};
use crate::group::Wait;
use local::GroupWatch;
use raw::{non_blocking_config, CommOps, RawComm};

mod communicator;
mod local;
mod raw;
mod transport;

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
    /// How long [`Communicator::arrival_barrier`](mpipemoe::Communicator::arrival_barrier) waits, in milliseconds.
    arrival_ms: AtomicU64,
    /// The one-process group's record of a failed rank thread ([`Nccl::run_local`]); unset
    /// for a rank per process.
    watch: OnceLock<Arc<GroupWatch>>,
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

    /// How long [`arrival_barrier`](mpipemoe::Communicator::arrival_barrier) waits for its peers
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

/// How long a transfer waits for its peers by default, as the CPU group does.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The most bytes a host payload moves to or from one peer in one NCCL round (the device
/// buffers of a round are at most this times the group's size each way).
const ROUND_BYTES: usize = 64 << 20;

/// How long an arrival barrier waits by default, as the CPU group does.
const DEFAULT_ARRIVAL_TIMEOUT: Duration = Duration::from_secs(30 * 60);
