//! The transfers of one rank: all-to-all-v between device buffers, the reductions and
//! broadcasts, and rounds of host bytes, each one NCCL group on the rank's stream, posted
//! through [`NcclTransport`] and waited for with the rank's timeout.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::DevicePtr;
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use mpipemoe::comm::{post_all_to_all_v, PeerLayout, PeerTransport};
use mpipemoe::{MoeError, Result};

use super::local::GroupWatch;
use super::raw::{async_state, RawComm};
use super::{cuda_err, nccl_err, NcclShared};
use crate::group::{NcclOps, Poll, Wait};

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
    pub(super) fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// How long an arrival barrier may wait for its peers.
    pub(super) fn arrival_timeout(&self) -> Duration {
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
    pub(super) fn round(
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
