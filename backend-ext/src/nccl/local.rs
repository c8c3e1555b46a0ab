//! One process driving several GPUs: a rank per GPU, each on a thread of its own
//! ([`Nccl::local_group`], [`Nccl::run_local`]), and the record of the first rank thread that
//! failed, which its peers' waits read.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::CudaContext;
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use mpipemoe::{MoeError, RankContext, Result};

use super::raw::{non_blocking_config, CommOps, RawComm};
use super::{cuda_err, nccl_err, Nccl};
use crate::group::Wait;

/// The first failure of a rank thread of a one-process group, which the peers' waits read
/// ([`NcclOps::peer_failure`](crate::group::NcclOps::peer_failure)) so that they stop at once: a rank that errs before its first
/// collective (out of memory while building its model, a bad checkpoint) never posts its
/// half, and its peers would otherwise wait out the whole timeout.
#[derive(Debug, Default)]
pub(crate) struct GroupWatch {
    failed: Mutex<Option<(usize, String)>>,
}

impl GroupWatch {
    /// Records rank `rank`'s failure, unless one came first.
    pub(super) fn fail(&self, rank: usize, reason: String) {
        let mut failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        failed.get_or_insert((rank, reason));
    }

    /// The failure of a rank other than `me`, as a wait's reason to stop.
    pub(super) fn failure_for(&self, me: usize) -> Option<String> {
        let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        match &*failed {
            Some((rank, reason)) if *rank != me => {
                Some(format!("rank {rank} of this process failed: {reason}"))
            }
            _ => None,
        }
    }
}

impl Nccl {
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
}
