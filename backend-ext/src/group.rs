//! Waiting on NCCL without hanging and without leaving a broken communicator live: the loop
//! that closes a group and waits for it, and the loop that waits for a non-blocking
//! communicator to finish initialising, written against [`NcclOps`] so that they run, and are
//! tested with a failing fake, on machines without CUDA or NCCL.
//!
//! The rule: every path that returns an error aborts the communicator first. After a failed
//! `ncclGroupEnd`, a failed stream, an asynchronous NCCL error or a timeout, what was posted
//! may still wait for peers, and the buffers it reads are about to be dropped; `ncclCommAbort`
//! stops those kernels, the peers then see an error instead of half a group, and later
//! transfers on the communicator are refused by the caller (it records the abort).
//!
//! Communicators are created non-blocking (`ncclConfig_t::blocking = 0`), so NCCL calls may
//! return `ncclInProgress` and finish in the background: `ncclGroupEnd` then returns before the
//! kernels are on the stream, and the stream looks idle until they are. So the wait first
//! polls `ncclCommGetAsyncError` until the communicator is no longer in progress, and only then
//! the stream (NCCL's user guide, "Fault tolerance": a non-blocking communicator's operations
//! are complete once `ncclCommGetAsyncError` no longer returns `ncclInProgress`).

use std::time::{Duration, Instant};

use mpipemoe::{MoeError, Result};

/// The state of something polled: done, still running, or failed with NCCL's or CUDA's word.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Poll {
    /// Finished (`ncclSuccess`, `CUDA_SUCCESS`).
    Ready,
    /// Still running (`ncclInProgress`, `CUDA_ERROR_NOT_READY`).
    Pending,
    /// Failed; the reason as the library gave it.
    Failed(String),
}

/// The calls the waiting loops make on one communicator and its stream.
pub trait NcclOps {
    /// `ncclGroupEnd`: [`Poll::Ready`] for `ncclSuccess`, [`Poll::Pending`] for
    /// `ncclInProgress` (a non-blocking communicator still enqueuing).
    fn group_end(&mut self) -> Poll;
    /// `ncclCommGetAsyncError` of the communicator.
    fn async_state(&mut self) -> Poll;
    /// `cuStreamQuery` of the stream the group runs on.
    fn stream_state(&mut self) -> Poll;
    /// `ncclCommAbort`, at most once (the implementation records it).
    fn abort(&mut self);
    /// A failure of a rank of this process's group that this rank waits for in vain: the
    /// one-process group ([`Nccl::run_local`](crate::Nccl::run_local)) records a rank
    /// thread's error or panic, so that its peers stop waiting at once instead of at the
    /// timeout. `None` (the default) where nothing is watched (a rank per process).
    fn peer_failure(&mut self) -> Option<String> {
        None
    }
}

/// What one wait is for: the operation and rank its errors name, and how long it may take.
#[derive(Debug, Clone, Copy)]
pub struct Wait<'a> {
    /// The operation, as errors name it (`all_to_all_rows`, `init`, ...).
    pub op: &'a str,
    /// This rank.
    pub rank: usize,
    /// How long the wait may take before the communicator is aborted.
    pub timeout: Duration,
}

impl Wait<'_> {
    fn fail(&self, ops: &mut dyn NcclOps, reason: String) -> MoeError {
        ops.abort();
        MoeError::comm(
            self.op,
            self.rank,
            format!("{reason}; the communicator is aborted"),
        )
    }

    fn timed_out(&self, ops: &mut dyn NcclOps, what: &str) -> MoeError {
        let reason = format!(
            "{what} did not complete within {:?}: a peer failed or never arrived",
            self.timeout
        );
        self.fail(ops, reason)
    }

    /// Polls `ncclCommGetAsyncError` until it leaves `ncclInProgress`: how a non-blocking
    /// `ncclCommInitRankConfig`, `ncclCommSplit` or `ncclCommFinalize` is waited for. An error
    /// or the timeout aborts the communicator.
    pub fn until_ready(&self, ops: &mut dyn NcclOps, what: &str) -> Result<()> {
        let start = Instant::now();
        loop {
            match ops.async_state() {
                Poll::Ready => return Ok(()),
                Poll::Pending => {}
                Poll::Failed(e) => return Err(self.fail(ops, format!("{what}: NCCL: {e}"))),
            }
            if let Some(reason) = ops.peer_failure() {
                return Err(self.fail(ops, format!("{what}: {reason}")));
            }
            if start.elapsed() > self.timeout {
                return Err(self.timed_out(ops, what));
            }
            pause(start);
        }
    }

    /// Closes the group this thread holds open and waits until everything it posted is done:
    /// `ncclGroupEnd`, then the communicator's asynchronous state until it is no longer in
    /// progress, then the stream. Polls instead of blocking in `cuStreamSynchronize`, so that a
    /// peer that died or never posts its half is an error after the timeout instead of a hang.
    /// Every error (of `ncclGroupEnd`, of the stream, of NCCL, or the timeout) aborts the
    /// communicator.
    pub fn end_group(&self, ops: &mut dyn NcclOps) -> Result<()> {
        if let Poll::Failed(e) = ops.group_end() {
            return Err(self.fail(ops, format!("ncclGroupEnd: NCCL: {e}")));
        }
        self.until_ready(ops, "the NCCL group")?;
        let start = Instant::now();
        loop {
            match ops.stream_state() {
                Poll::Ready => return Ok(()),
                Poll::Pending => {}
                Poll::Failed(e) => return Err(self.fail(ops, format!("the NCCL stream: CUDA: {e}"))),
            }
            // A peer's failure shows up here while the stream still waits for it.
            if let Poll::Failed(e) = ops.async_state() {
                return Err(self.fail(ops, format!("the NCCL group: NCCL: {e}")));
            }
            if let Some(reason) = ops.peer_failure() {
                return Err(self.fail(ops, format!("the NCCL transfer: {reason}")));
            }
            if start.elapsed() > self.timeout {
                return Err(self.timed_out(ops, "the NCCL transfer"));
            }
            pause(start);
        }
    }
}

/// Short waits first: most transfers finish within microseconds of the group.
fn pause(start: Instant) {
    if start.elapsed() < Duration::from_micros(200) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake communicator: each call answers from its script (the last answer repeats), and
    /// the aborts are counted.
    #[derive(Default)]
    struct Scripted {
        group_end: Vec<Poll>,
        async_state: Vec<Poll>,
        stream: Vec<Poll>,
        aborts: usize,
        calls: Vec<&'static str>,
        /// What `peer_failure` says from its n-th call on: `(n, reason)`.
        peer_fails_at: Option<(usize, String)>,
        peer_calls: usize,
    }

    fn next(script: &mut Vec<Poll>) -> Poll {
        if script.len() > 1 {
            script.remove(0)
        } else {
            script.first().cloned().unwrap_or(Poll::Ready)
        }
    }

    impl NcclOps for Scripted {
        fn group_end(&mut self) -> Poll {
            self.calls.push("group_end");
            next(&mut self.group_end)
        }
        fn async_state(&mut self) -> Poll {
            self.calls.push("async");
            next(&mut self.async_state)
        }
        fn stream_state(&mut self) -> Poll {
            self.calls.push("stream");
            next(&mut self.stream)
        }
        fn abort(&mut self) {
            self.aborts += 1;
        }
        fn peer_failure(&mut self) -> Option<String> {
            self.peer_calls += 1;
            match &self.peer_fails_at {
                Some((n, reason)) if self.peer_calls >= *n => Some(reason.clone()),
                _ => None,
            }
        }
    }

    const WAIT: Wait<'static> = Wait {
        op: "all_to_all_rows",
        rank: 3,
        timeout: Duration::from_millis(200),
    };

    #[test]
    fn a_failed_group_end_aborts_and_names_it() {
        let mut ops = Scripted {
            group_end: vec![Poll::Failed("ncclInvalidUsage".into())],
            ..Default::default()
        };
        let err = WAIT.end_group(&mut ops).unwrap_err().to_string();
        assert_eq!(ops.aborts, 1);
        assert!(
            err.contains("ncclGroupEnd") && err.contains("ncclInvalidUsage"),
            "{err}"
        );
        assert!(err.contains("rank 3") && err.contains("aborted"), "{err}");
        // Nothing is waited for on a group that did not close.
        assert_eq!(ops.calls, ["group_end"]);
    }

    #[test]
    fn a_stream_error_other_than_not_ready_aborts() {
        let mut ops = Scripted {
            stream: vec![Poll::Pending, Poll::Failed("CUDA_ERROR_LAUNCH_FAILED".into())],
            ..Default::default()
        };
        let err = WAIT.end_group(&mut ops).unwrap_err().to_string();
        assert_eq!(ops.aborts, 1);
        assert!(err.contains("CUDA_ERROR_LAUNCH_FAILED"), "{err}");
    }

    #[test]
    fn an_async_error_while_the_stream_waits_aborts() {
        let mut ops = Scripted {
            async_state: vec![Poll::Ready, Poll::Failed("ncclRemoteError".into())],
            stream: vec![Poll::Pending],
            ..Default::default()
        };
        let err = WAIT.end_group(&mut ops).unwrap_err().to_string();
        assert_eq!(ops.aborts, 1);
        assert!(err.contains("ncclRemoteError"), "{err}");
    }

    #[test]
    fn a_peer_that_never_posts_times_out_and_aborts() {
        let mut ops = Scripted {
            stream: vec![Poll::Pending],
            ..Default::default()
        };
        let start = Instant::now();
        let err = WAIT.end_group(&mut ops).unwrap_err().to_string();
        assert!(start.elapsed() >= WAIT.timeout);
        assert_eq!(ops.aborts, 1);
        assert!(err.contains("did not complete within"), "{err}");
    }

    #[test]
    fn a_group_in_progress_is_waited_for_before_the_stream() {
        // Non-blocking: ncclGroupEnd says in progress and the stream looks idle until NCCL has
        // enqueued the kernels; the wait must not take the idle stream for done.
        let mut ops = Scripted {
            group_end: vec![Poll::Pending],
            async_state: vec![Poll::Pending, Poll::Pending, Poll::Ready],
            stream: vec![Poll::Pending, Poll::Ready],
            ..Default::default()
        };
        WAIT.end_group(&mut ops).unwrap();
        assert_eq!(ops.aborts, 0);
        let first_stream = ops.calls.iter().position(|&c| c == "stream").unwrap();
        assert_eq!(
            &ops.calls[..first_stream],
            ["group_end", "async", "async", "async"]
        );
    }

    #[test]
    fn a_failed_peer_of_this_process_ends_the_wait_long_before_the_timeout() {
        // The transfer waits for a peer (stream pending, NCCL in progress for ever); on the
        // third poll the one-process group reports that rank 1's thread failed.
        let long = Wait {
            timeout: Duration::from_secs(60),
            ..WAIT
        };
        let mut ops = Scripted {
            stream: vec![Poll::Pending],
            peer_fails_at: Some((3, "rank 1 failed: out of memory".into())),
            ..Default::default()
        };
        let start = Instant::now();
        let err = long.end_group(&mut ops).unwrap_err().to_string();
        assert!(start.elapsed() < Duration::from_secs(5));
        assert_eq!(ops.aborts, 1);
        assert!(err.contains("rank 1 failed: out of memory"), "{err}");
        // The same for an initialisation or split in progress.
        let mut ops = Scripted {
            async_state: vec![Poll::Pending],
            peer_fails_at: Some((2, "rank 0 failed: bad checkpoint".into())),
            ..Default::default()
        };
        let err = long
            .until_ready(&mut ops, "ncclCommSplit")
            .unwrap_err()
            .to_string();
        assert_eq!(ops.aborts, 1);
        assert!(
            err.contains("bad checkpoint") && err.contains("ncclCommSplit"),
            "{err}"
        );
    }

    #[test]
    fn an_initialisation_that_never_finishes_is_aborted_at_the_timeout() {
        let mut ops = Scripted {
            async_state: vec![Poll::Pending],
            ..Default::default()
        };
        let err = WAIT
            .until_ready(&mut ops, "ncclCommInitRankConfig")
            .unwrap_err()
            .to_string();
        assert_eq!(ops.aborts, 1);
        assert!(
            err.contains("ncclCommInitRankConfig") && err.contains("within"),
            "{err}"
        );
        let mut ok = Scripted {
            async_state: vec![Poll::Pending, Poll::Ready],
            ..Default::default()
        };
        WAIT.until_ready(&mut ok, "ncclCommInitRankConfig").unwrap();
        assert_eq!(ok.aborts, 0);
    }
}
