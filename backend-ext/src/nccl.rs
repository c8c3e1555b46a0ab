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
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use mpipemoe::comm::{post_all_to_all_v, Payload, PeerLayout, PeerTransport, RowPaths};
use mpipemoe::{Communicator, MoeError, RankContext, Result};

use crate::bootstrap::{fetch_id, master_addr_from_env, serve_id, ID_BYTES};
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
}

/// An NCCL communicator handle, aborted on drop unless a timeout aborted it already.
#[derive(Debug)]
struct RawComm {
    handle: nccl_sys::ncclComm_t,
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
            // SAFETY: the handle is live (not aborted before).
            unsafe {
                let _ = nccl::comm_abort(self.handle);
            }
        }
    }
}

// SAFETY: NCCL allows a communicator to be used from any thread as long as calls on it do not
// run concurrently; every use goes through the `Mutex` in `NcclShared`, which serialises them.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        // Abort rather than destroy: destroy waits for outstanding work, which after a failed
        // peer never completes.
        self.abort();
    }
}

fn env_usize(name: &str, default: usize) -> Result<usize> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|_| MoeError::Backend(format!("environment variable {name}={v:?} is not a number"))),
        Err(_) => Ok(default),
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
    /// (the GPU; default `RANK` modulo the device count) and `MASTER_ADDR` / `MASTER_PORT`
    /// (default `127.0.0.1:29500`), where rank 0 hands out the NCCL id over TCP. Waits at most
    /// `timeout` for the rendezvous.
    pub fn from_env(timeout: Duration) -> Result<Self> {
        crate::cuda_available().map_err(|e| MoeError::Backend(e.to_string()))?;
        crate::nccl_available().map_err(|e| MoeError::Backend(e.to_string()))?;
        let rank = env_usize("RANK", 0)?;
        let world = env_usize("WORLD_SIZE", 1)?;
        if world == 0 || rank >= world {
            return Err(MoeError::Backend(format!(
                "RANK {rank} is not below WORLD_SIZE {world}"
            )));
        }
        let devices = CudaContext::device_count().map_err(|e| cuda_err("init", rank, e))? as usize;
        let ordinal = env_usize("LOCAL_RANK", rank % devices.max(1))?;
        if ordinal >= devices {
            return Err(MoeError::Backend(format!(
                "LOCAL_RANK {ordinal} names a GPU, but this machine has {devices}"
            )));
        }
        let addr = master_addr_from_env()?;
        let id = if world == 1 {
            // A group of one needs no rendezvous.
            nccl::get_uniqueid().map_err(|e| nccl_err("init", rank, e))?
        } else if rank == 0 {
            let id = nccl::get_uniqueid().map_err(|e| nccl_err("init", rank, e))?;
            let listener = std::net::TcpListener::bind(&addr)
                .map_err(|e| MoeError::comm("init", rank, format!("listen on {addr}: {e}")))?;
            let bytes: [u8; ID_BYTES] = std::array::from_fn(|i| id.internal[i] as u8);
            // Every rank has the id before rank 0 joins: the others wait inside
            // `ncclCommInitRank` for it, and a rank that never came is an error here rather
            // than a hang inside NCCL.
            serve_id(&listener, world, &bytes, timeout)?;
            id
        } else {
            let bytes = fetch_id(&addr, rank, world, timeout)?;
            nccl_sys::ncclUniqueId {
                internal: std::array::from_fn(|i| bytes[i] as std::ffi::c_char),
            }
        };
        Self::join(rank, world, ordinal, id)
    }

    /// `rank` of `world` on GPU `ordinal`, with the group's id.
    fn join(rank: usize, world: usize, ordinal: usize, id: nccl_sys::ncclUniqueId) -> Result<Self> {
        let context = CudaContext::new(ordinal).map_err(|e| cuda_err("init", rank, e))?;
        let stream = context.new_stream().map_err(|e| cuda_err("init", rank, e))?;
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL before it is read; the id is the group's.
        let comm = unsafe {
            nccl::comm_init_rank(comm.as_mut_ptr(), world as i32, id, rank as i32)
                .map_err(|e| nccl_err("init", rank, e))?;
            comm.assume_init()
        };
        Self::from_parts(rank, world, RawComm::new(comm), stream, context)
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
        });
        Ok(Self {
            paths: crate::rows::row_paths(&shared)?,
            shared,
            emulate_network: false,
        })
    }

    /// One rank per GPU for GPUs `0..n_gpus` of this machine, in one process
    /// (`ncclCommInitAll`): what one 8-GPU node needs without a launcher. Hand each rank to a
    /// thread of its own, as [`mpipemoe::LocalGroup::run`] does for the CPU.
    pub fn local_group(n_gpus: usize) -> Result<Vec<Self>> {
        crate::cuda_available().map_err(|e| MoeError::Backend(e.to_string()))?;
        crate::nccl_available().map_err(|e| MoeError::Backend(e.to_string()))?;
        let devices = CudaContext::device_count().map_err(|e| cuda_err("init", 0, e))? as usize;
        if n_gpus == 0 || n_gpus > devices {
            return Err(MoeError::Backend(format!(
                "a local NCCL group of {n_gpus} GPUs on a machine with {devices}"
            )));
        }
        let mut comms = vec![std::ptr::null_mut(); n_gpus];
        let ordinals: Vec<i32> = (0..n_gpus as i32).collect();
        // SAFETY: `comms` has room for one handle per listed device.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), n_gpus as i32, ordinals.as_ptr()) }
            .map_err(|e| nccl_err("init", 0, e))?;
        comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let comm = RawComm::new(comm);
                let context = CudaContext::new(rank).map_err(|e| cuda_err("init", rank, e))?;
                let stream = context.new_stream().map_err(|e| cuda_err("init", rank, e))?;
                Self::from_parts(rank, n_gpus, comm, stream, context)
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
        let ranks = Self::local_group(n_gpus)?;
        let results: Vec<Result<T>> = std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|nccl| {
                    let f = &f;
                    scope.spawn(move || {
                        let rank = nccl.shared.rank;
                        let ctx = RankContext {
                            rank,
                            n_ranks: n_gpus,
                            comm: Arc::new(nccl.with_timeout(timeout)),
                        };
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(ctx)))
                            .unwrap_or_else(|payload| Err(MoeError::from_panic(payload, rank)))
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
        send: u64,
        recv: u64,
        post: impl FnOnce(&mut NcclTransport<'_>) -> Result<R>,
    ) -> Result<R> {
        let mut comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        if comm.aborted {
            return Err(MoeError::comm(
                op,
                self.rank,
                "the NCCL communicator was aborted after an earlier transfer timed out",
            ));
        }
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_err(op, self.rank, e))?;
        let mut transport = NcclTransport {
            comm: &mut comm,
            stream: self.stream.cu_stream(),
            send,
            recv,
            rank: self.rank,
            op,
            timeout: Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed)),
        };
        post(&mut transport)
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
        self.with_transport(op, send, recv, |t| post_all_to_all_v(t, self.rank, layout))
    }

    /// Sums `count` elements of `dtype` from the device buffer at `send` into the one at
    /// `recv` over the group (`ncclAllReduce`) on this rank's NCCL stream, and waits for it
    /// with the same timeout and abort as the all-to-all.
    pub(crate) fn all_reduce_device(
        &self,
        op: &str,
        send: u64,
        recv: u64,
        count: usize,
        dtype: nccl_sys::ncclDataType_t,
    ) -> Result<()> {
        self.with_transport(op, send, recv, |t| {
            t.begin()?;
            let (handle, stream) = (t.comm.handle, t.stream as _);
            // SAFETY: both buffers hold `count` elements of `dtype` (the caller sized them)
            // and outlive the group, which `end` waits for.
            let posted = unsafe {
                nccl::all_reduce(
                    send as *const std::ffi::c_void,
                    recv as *mut std::ffi::c_void,
                    count,
                    dtype,
                    nccl_sys::ncclRedOp_t::ncclSum,
                    handle,
                    stream,
                )
            };
            if let Err(e) = posted {
                t.abandon();
                return Err(nccl_err(op, self.rank, e));
            }
            t.end()
        })
    }

    /// One round of host bytes: `send[peer]` goes to `peer`, `recv_len[peer]` bytes arrive
    /// from it, through one device buffer each way.
    fn round(&self, op: &str, send: &[Vec<u8>], recv_len: &[usize]) -> Result<Vec<Vec<u8>>> {
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
            self.all_to_all_device(op, send_ptr, recv_ptr, &layout)?;
        }
        let flat = s.clone_dtoh(&device_recv).map_err(err)?;
        Ok(layout.recv.iter().map(|r| flat[r.clone()].to_vec()).collect())
    }
}

/// The device side of [`PeerTransport`]: raw `ncclSend` / `ncclRecv` at byte offsets of two
/// device buffers, a device copy for the own rows, on one stream.
struct NcclTransport<'a> {
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

    /// Waits by polling the stream and NCCL's asynchronous error rather than blocking in
    /// `cuStreamSynchronize`, so that a peer that died or never posts its half is an error after
    /// the timeout (the communicator is then aborted, which stops the waiting kernels) instead
    /// of a hang.
    fn end(&mut self) -> Result<()> {
        use cudarc::driver::sys::{cuStreamQuery, CUresult};
        nccl::group_end().map_err(|e| nccl_err(self.op, self.rank, e))?;
        let start = std::time::Instant::now();
        loop {
            // SAFETY: the stream belongs to this rank's context, which is bound to this thread.
            match unsafe { cuStreamQuery(self.stream) } {
                CUresult::CUDA_SUCCESS => return Ok(()),
                CUresult::CUDA_ERROR_NOT_READY => {}
                other => return Err(cuda_err(self.op, self.rank, other)),
            }
            let mut state = nccl_sys::ncclResult_t::ncclSuccess;
            // SAFETY: the handle is live (checked not aborted when the transport was made).
            unsafe { nccl_sys::ncclCommGetAsyncError(self.comm.handle, &mut state) };
            if !matches!(
                state,
                nccl_sys::ncclResult_t::ncclSuccess | nccl_sys::ncclResult_t::ncclInProgress
            ) {
                self.comm.abort();
                return Err(nccl_err(self.op, self.rank, state));
            }
            if start.elapsed() > self.timeout {
                self.comm.abort();
                return Err(MoeError::comm(
                    self.op,
                    self.rank,
                    format!(
                        "the NCCL transfer did not complete within {:?}: a peer failed or never posted its half; the communicator is aborted",
                        self.timeout
                    ),
                ));
            }
            // Short waits first: most transfers finish within microseconds of the group.
            if start.elapsed() < Duration::from_micros(200) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
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
        let comm = shared.comm.lock().unwrap_or_else(|e| e.into_inner());
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
        let mut new = std::mem::MaybeUninit::uninit();
        // SAFETY: the parent handle is live (not aborted, held under its lock); `new` is
        // written by NCCL before it is read; a null config inherits the parent's.
        let new = unsafe {
            nccl_sys::ncclCommSplit(
                comm.handle,
                color,
                shared.rank as i32,
                new.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
            .map_err(|e| nccl_err(op, shared.rank, e))?;
            new.assume_init()
        };
        drop(comm);
        let raw = RawComm::new(new);
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
            .with_timeout(Duration::from_millis(shared.timeout_ms.load(Ordering::Relaxed)))
            .with_emulated_network(self.emulate_network);
        Ok(Arc::new(sub))
    }

    fn exchange(&self, op: &'static str, outgoing: Vec<Payload>) -> Result<Vec<Payload>> {
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
        let got = self.shared.round(op, &sizes, &vec![8; world])?;
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
        self.shared
            .round(op, &send, &recv_len)?
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
