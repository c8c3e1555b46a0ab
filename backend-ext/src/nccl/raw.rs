//! The NCCL communicator handle ([`RawComm`]): created non-blocking, polled, aborted on every
//! error path, finalized and destroyed when its rank is done with it.

use std::time::Duration;

use cudarc::nccl::{result as nccl, sys as nccl_sys};
use mpipemoe::Result;

use super::nccl_err;
use crate::group::{NcclOps, Poll, Wait};

/// An NCCL communicator handle: closed with `ncclCommFinalize` + `ncclCommDestroy` when its
/// rank is done with it ([`RawComm::close`]), aborted on every error path and on a drop that
/// was not preceded by a close.
#[derive(Debug)]
pub(super) struct RawComm {
    pub(super) handle: nccl_sys::ncclComm_t,
    /// Aborted or destroyed: the handle must not be used again.
    pub(super) aborted: bool,
}

impl RawComm {
    pub(super) fn new(handle: nccl_sys::ncclComm_t) -> Self {
        Self {
            handle,
            aborted: false,
        }
    }

    /// Aborts the communicator, which stops its kernels that wait for a peer.
    pub(super) fn abort(&mut self) {
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
    pub(super) fn close(&mut self, rank: usize, timeout: Duration) -> Result<()> {
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
pub(super) fn non_blocking_config() -> nccl_sys::ncclConfig_t {
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
pub(super) struct CommOps<'a>(pub(super) &'a mut RawComm);

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
pub(super) fn async_state(comm: &RawComm) -> Poll {
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
