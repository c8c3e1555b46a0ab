//! N ranks as threads of one process.
//!
//! The ranks meet in a shared hub: for each collective (numbered by a per-rank sequence
//! counter, which agrees across ranks because every rank calls the same collectives in the
//! same order) each rank deposits one payload per destination, waits until all ranks have
//! deposited, and takes the payloads addressed to it. A rank whose closure returns an error
//! or panics marks the group failed, which wakes every waiting rank with an error naming it;
//! a rank that is still missing after the timeout is named in a timeout error. Nothing blocks
//! forever.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Communicator, Payload};
use crate::error::{MoeError, Result};

/// Options for a [`LocalGroup`].
#[derive(Debug, Clone, Copy)]
pub struct GroupOptions {
    /// How long a rank waits in one collective for its peers before giving up.
    pub timeout: Duration,
    /// How long a rank waits in [`arrival_barrier`](Communicator::arrival_barrier) for its
    /// peers: the points where ranks come apart by design (one rank writing a checkpoint
    /// while the others wait, ranks loading theirs at different speeds), far longer than a
    /// transfer (default 30 minutes, PyTorch's default process-group timeout).
    pub arrival_timeout: Duration,
    /// Each rank runs its closure in a rayon thread pool of its own with this many threads,
    /// as each GPU has its own SMs: work a rank hands to rayon (this crate's CPU kernels)
    /// then runs on that rank's threads only, so a rank with little work cannot lend its
    /// cores to a loaded one. Flex's GEMMs stay in the pool: burn-flex 0.21 asks gemm for
    /// `Parallelism::Rayon(0)` (`ops/matmul.rs`), which gemm-common 0.19 turns into
    /// `rayon::current_num_threads()` threads of the current pool (`gemm.rs`, the
    /// `Parallelism::Rayon` arm). `None`: every rank shares rayon's global
    /// pool (the machine's cores). Threads the rank starts itself (the threaded executor's
    /// stream workers) and backends that do not use rayon (NdArray's GEMMs) are not confined.
    pub threads_per_rank: Option<usize>,
}

impl Default for GroupOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(120),
            arrival_timeout: Duration::from_secs(30 * 60),
            threads_per_rank: None,
        }
    }
}

impl GroupOptions {
    /// Default options with each of `n_ranks` ranks on a rayon pool of its own, the current
    /// pool's threads (rayon's count: the machine's cores, or `RAYON_NUM_THREADS`) shared out
    /// evenly, at least one each.
    ///
    /// Besides confining each rank, a pool makes a rank's own thread one of its workers (its
    /// closure runs inside `ThreadPool::install`), and that is what makes small parallel
    /// regions cheap: a worker that splits work pushes the other half onto its own deque and
    /// goes on with its half while a peer steals it, where a thread outside the pool injects
    /// the job, wakes a worker and sleeps until the job is done (rayon-core 1.13
    /// `Registry::in_worker_cold`). A decode step hands off dozens of products of a few
    /// hundred microseconds each; run from outside a pool, the second thread made generation
    /// about 1.2 times as fast on this project's 2-vCPU VM, from inside one about 1.45 times.
    pub fn pool_per_rank(n_ranks: usize) -> Self {
        Self {
            threads_per_rank: Some((rayon::current_num_threads() / n_ranks.max(1)).max(1)),
            ..Self::default()
        }
    }
}

/// What each rank's closure receives from [`LocalGroup::run`].
#[derive(Debug, Clone)]
pub struct RankContext {
    /// This rank's index.
    pub rank: usize,
    /// The number of ranks.
    pub n_ranks: usize,
    /// This rank's handle to the group.
    pub comm: Arc<dyn Communicator>,
}

/// Runs `f` in a rayon pool of `options.threads_per_rank` threads named after `rank`, or
/// directly without that option: how [`LocalGroup::run_each`] gives each rank a fixed compute
/// budget, for callers that manage their own rank threads.
///
/// # Errors
/// [`MoeError::Config`] naming `threads_per_rank` if it is 0 or the pool cannot be started.
pub fn in_rank_pool<T>(options: GroupOptions, rank: usize, f: impl FnOnce() -> Result<T> + Send) -> Result<T>
where
    T: Send,
{
    match options.threads_per_rank {
        None => f(),
        Some(0) => Err(MoeError::config(
            "threads_per_rank",
            "must be at least 1 (or None)",
        )),
        Some(threads) => rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("rank{rank}-compute{i}"))
            .build()
            .map_err(|e| {
                MoeError::config(
                    "threads_per_rank",
                    format!("rank {rank}'s pool of {threads}: {e}"),
                )
            })?
            .install(f),
    }
}

/// Runs N ranks as threads of this process.
///
/// ```
/// use mpipemoe::{Communicator, LocalGroup};
/// let sums = LocalGroup::run(3, |ctx| {
///     let mut v = [ctx.rank as f64];
///     ctx.comm.all_reduce_sum(&mut v)?;
///     Ok(v[0])
/// })
/// .unwrap();
/// assert_eq!(sums, vec![3.0, 3.0, 3.0]);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalGroup;

impl LocalGroup {
    /// Runs `f` on `n_ranks` threads, one per rank, and returns their results in rank order.
    ///
    /// If any rank fails, returns the root cause: the first error that is not a peer's
    /// report of that failure (a rank's own error is preferred over the others' comm errors).
    pub fn run<T, F>(n_ranks: usize, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(RankContext) -> Result<T> + Sync,
    {
        Self::run_with(GroupOptions::default(), n_ranks, f)
    }

    /// [`LocalGroup::run`] with explicit options.
    pub fn run_with<T, F>(options: GroupOptions, n_ranks: usize, f: F) -> Result<Vec<T>>
    where
        T: Send,
        F: Fn(RankContext) -> Result<T> + Sync,
    {
        let results = Self::run_each(options, n_ranks, f);
        let root_cause = results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .find(|e| !e.is_peer_failure())
            .cloned();
        if let Some(err) = root_cause {
            return Err(err);
        }
        results.into_iter().collect()
    }

    /// Runs `f` on every rank and returns each rank's own result, errors included.
    pub fn run_each<T, F>(options: GroupOptions, n_ranks: usize, f: F) -> Vec<Result<T>>
    where
        T: Send,
        F: Fn(RankContext) -> Result<T> + Sync,
    {
        let comms = Self::communicators(options, n_ranks);
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let f = &f;
                    scope.spawn(move || {
                        let rank = comm.rank;
                        let hub = comm.hub.clone();
                        let ctx = RankContext {
                            rank,
                            n_ranks,
                            comm: Arc::new(comm),
                        };
                        let result =
                            catch_unwind(AssertUnwindSafe(|| in_rank_pool(options, rank, || f(ctx))))
                                .unwrap_or_else(|payload| Err(MoeError::from_panic(payload, rank)));
                        match &result {
                            Ok(_) => hub.exit(rank),
                            Err(err) => hub.fail(rank, err.to_string()),
                        }
                        result
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| h.join().unwrap_or_else(|p| Err(MoeError::from_panic(p, rank))))
                .collect()
        })
    }

    /// The communicators of a fresh group, for callers that manage their own threads.
    ///
    /// `options.threads_per_rank` is theirs to apply (see [`in_rank_pool`]).
    pub fn communicators(options: GroupOptions, n_ranks: usize) -> Vec<LocalComm> {
        assert!(n_ranks > 0, "a group needs at least one rank");
        let hub = Arc::new(Hub::new(
            (0..n_ranks).collect(),
            options.timeout,
            options.arrival_timeout,
        ));
        (0..n_ranks)
            .map(|rank| LocalComm {
                rank,
                hub: hub.clone(),
                seq: AtomicU64::new(0),
            })
            .collect()
    }
}

/// One rank's handle to a [`LocalGroup`].
#[derive(Debug)]
pub struct LocalComm {
    rank: usize,
    hub: Arc<Hub>,
    seq: AtomicU64,
}

#[derive(Debug)]
struct Hub {
    n_ranks: usize,
    /// The rank in the group `LocalGroup` started of each member, in this hub's rank order:
    /// failures are reported with those ranks, which are the threads' identities.
    members: Vec<usize>,
    timeout: Duration,
    /// The bound of [`Communicator::arrival_barrier`].
    arrival_timeout: Duration,
    state: Mutex<HubState>,
    wake: Condvar,
}

#[derive(Debug)]
struct HubState {
    rounds: BTreeMap<u64, Round>,
    /// A failure, by the failing thread's rank in the started group.
    failed: Option<(usize, String)>,
    exited: Vec<bool>,
    /// Sub-groups split from this one, by (the split's collective number, color): a failure or
    /// an exit here is passed on to them, so that no rank waits in a sub-group for a thread
    /// that is gone.
    children: BTreeMap<(u64, usize), Arc<Hub>>,
}

#[derive(Debug)]
struct Round {
    op: &'static str,
    /// `deposits[src][dst]`: what `src` sent to `dst`, until `dst` takes it.
    deposits: Vec<Option<Vec<Option<Payload>>>>,
    arrived: usize,
    taken: usize,
}

impl Hub {
    fn lock(&self) -> MutexGuard<'_, HubState> {
        // A rank that panicked while holding the lock leaves consistent state (every update
        // is a single assignment), so a poisoned lock is safe to keep using.
        crate::sync::lock(&self.state)
    }

    fn new(members: Vec<usize>, timeout: Duration, arrival_timeout: Duration) -> Self {
        let n_ranks = members.len();
        Hub {
            n_ranks,
            members,
            timeout,
            arrival_timeout,
            state: Mutex::new(HubState {
                rounds: BTreeMap::new(),
                failed: None,
                exited: vec![false; n_ranks],
                children: BTreeMap::new(),
            }),
            wake: Condvar::new(),
        }
    }

    /// Marks the group failed by the thread of started-group rank `thread`, here and in every
    /// sub-group. The first failure wins, and it is the one passed on: a peer that fails
    /// because it learned of that failure (in a sub-group that the first failure reached
    /// sooner) reports here after it, and its own failure must not overtake the first on the
    /// way to a sub-group that has not heard yet.
    fn fail(&self, thread: usize, reason: String) {
        let mut state = self.lock();
        let (first, first_reason) = state.failed.get_or_insert((thread, reason)).clone();
        let children: Vec<Arc<Hub>> = state.children.values().cloned().collect();
        drop(state);
        self.wake.notify_all();
        for child in children {
            child.fail(first, first_reason.clone());
        }
    }

    /// Marks the thread of started-group rank `thread` finished, here and in every sub-group
    /// it belongs to.
    fn exit(&self, thread: usize) {
        let mut state = self.lock();
        if let Some(index) = self.members.iter().position(|&m| m == thread) {
            state.exited[index] = true;
        }
        let children: Vec<Arc<Hub>> = state.children.values().cloned().collect();
        drop(state);
        self.wake.notify_all();
        for child in children {
            child.exit(thread);
        }
    }

    /// The sub-group of `members` (ranks here) made by split number `key`, created by the
    /// first member to ask.
    fn child(&self, key: (u64, usize), members: &[usize]) -> Arc<Hub> {
        let mut state = self.lock();
        let threads: Vec<usize> = members.iter().map(|&m| self.members[m]).collect();
        let exited: Vec<bool> = members.iter().map(|&m| state.exited[m]).collect();
        let failed = state.failed.clone();
        let child = state
            .children
            .entry(key)
            .or_insert_with(|| {
                let hub = Hub::new(threads, self.timeout, self.arrival_timeout);
                {
                    let mut child_state = hub.lock();
                    child_state.exited = exited;
                    child_state.failed = failed;
                }
                Arc::new(hub)
            })
            .clone();
        child
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn n_ranks(&self) -> usize {
        self.hub.n_ranks
    }

    fn exchange(&self, op: &'static str, outgoing: Vec<Payload>) -> Result<Vec<Payload>> {
        self.exchange_within(op, outgoing, self.hub.timeout)
    }

    /// A barrier bounded by the group's [`GroupOptions::arrival_timeout`].
    fn arrival_barrier(&self) -> Result<()> {
        let outgoing = vec![Payload::Counts(Vec::new()); self.hub.n_ranks];
        self.exchange_within("arrival_barrier", outgoing, self.hub.arrival_timeout)
            .map(|_| ())
    }

    /// A sub-group in the same process: the colors are gathered (one collective, whose number
    /// names the split), and the first member of each sub-group to arrive creates its hub.
    fn split(&self, color: usize) -> Result<Arc<dyn Communicator>> {
        let key = self.seq.load(Ordering::SeqCst);
        let colors = self.all_gather_counts(&[color])?;
        let members: Vec<usize> = (0..colors.len()).filter(|&r| colors[r] == color).collect();
        let rank = members
            .iter()
            .position(|&r| r == self.rank)
            .expect("this rank has its own color");
        Ok(Arc::new(LocalComm {
            rank,
            hub: self.hub.child((key, color), &members),
            seq: AtomicU64::new(0),
        }))
    }
}

impl LocalComm {
    /// One collective that waits at most `timeout` for the peers.
    fn exchange_within(
        &self,
        op: &'static str,
        outgoing: Vec<Payload>,
        timeout: Duration,
    ) -> Result<Vec<Payload>> {
        let n = self.hub.n_ranks;
        if outgoing.len() != n {
            return Err(MoeError::comm(
                op,
                self.rank,
                format!("{} payloads for a group of {n} ranks", outgoing.len()),
            ));
        }
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let deadline = Instant::now() + timeout;
        let state = self.deposit(op, seq, outgoing)?;
        let state = self.wait_for_peers(op, seq, (deadline, timeout), state)?;
        Ok(self.take(seq, state))
    }

    /// The failure a peer reported, as this rank's error in `op`.
    fn peer_error(&self, op: &str, state: &HubState) -> Option<MoeError> {
        state.failed.as_ref().map(|(peer, reason)| MoeError::PeerFailed {
            op: op.to_string(),
            rank: self.rank,
            peer: *peer,
            reason: reason.clone(),
        })
    }

    /// Puts this rank's payloads of collective `seq` in the hub. A rank that calls another
    /// collective than its peers at the same position fails the group.
    fn deposit(
        &self,
        op: &'static str,
        seq: u64,
        outgoing: Vec<Payload>,
    ) -> Result<MutexGuard<'_, HubState>> {
        let n = self.hub.n_ranks;
        let mut state = self.hub.lock();
        if let Some(err) = self.peer_error(op, &state) {
            return Err(err);
        }
        let round = state.rounds.entry(seq).or_insert_with(|| Round {
            op,
            deposits: (0..n).map(|_| None).collect(),
            arrived: 0,
            taken: 0,
        });
        if round.op != op {
            let reason = format!(
                "collective #{seq}: this rank called `{op}`, another called `{}`",
                round.op
            );
            drop(state);
            self.hub.fail(self.hub.members[self.rank], reason.clone());
            return Err(MoeError::comm(op, self.rank, reason));
        }
        round.deposits[self.rank] = Some(outgoing.into_iter().map(Some).collect());
        round.arrived += 1;
        self.hub.wake.notify_all();
        Ok(state)
    }

    /// Waits until every rank has deposited in collective `seq`: an error if a peer failed,
    /// finished without joining, or did not come by `deadline` (which fails the group).
    fn wait_for_peers<'a>(
        &'a self,
        op: &'static str,
        seq: u64,
        (deadline, timeout): (Instant, Duration),
        mut state: MutexGuard<'a, HubState>,
    ) -> Result<MutexGuard<'a, HubState>> {
        let n = self.hub.n_ranks;
        loop {
            if let Some(err) = self.peer_error(op, &state) {
                return Err(err);
            }
            let round = &state.rounds[&seq];
            if round.arrived == n {
                return Ok(state);
            }
            let missing: Vec<usize> = (0..n).filter(|&r| round.deposits[r].is_none()).collect();
            if let Some(&gone) = missing.iter().find(|&&r| state.exited[r]) {
                return Err(MoeError::comm(
                    op,
                    self.rank,
                    format!("rank {gone} finished without joining collective #{seq}"),
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                let reason = format!(
                    "timed out after {timeout:.1?} waiting for rank(s) {missing:?} in collective #{seq}"
                );
                drop(state);
                self.hub.fail(self.hub.members[self.rank], reason.clone());
                return Err(MoeError::comm(op, self.rank, reason));
            }
            state = self
                .hub
                .wake
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Takes what every source sent to this rank in collective `seq`; the last rank to take
    /// removes the round.
    fn take(&self, seq: u64, mut state: MutexGuard<'_, HubState>) -> Vec<Payload> {
        let n = self.hub.n_ranks;
        let round = state
            .rounds
            .get_mut(&seq)
            .expect("round exists until all ranks took");
        let incoming: Vec<Payload> = (0..n)
            .map(|src| {
                round.deposits[src].as_mut().expect("all ranks arrived")[self.rank]
                    .take()
                    .expect("each payload is taken once")
            })
            .collect();
        round.taken += 1;
        if round.taken == n {
            state.rounds.remove(&seq);
        }
        drop(state);
        incoming
            .into_iter()
            .enumerate()
            .map(|(src, payload)| receive(src == self.rank, payload))
            .collect()
    }
}

/// A peer's rows land in a buffer the receiving rank allocates, and the sender's buffer is
/// freed once they are copied, as NCCL receives into the receiving GPU's memory. Handing over
/// the sender's buffer itself would save one copy, but the rows a rank sent would then stay
/// its allocation while the peer holds them: under the counting allocator, which charges a
/// block to the rank that allocated it, a rank that only sends would seem to hold its peers'
/// inputs while the peer's own peak missed them. Measured (tests/memory.rs, every token to
/// rank 0, n = 4, S1): rank 0's peak was 6.33 MiB with the sender's buffer handed over and is
/// 6.71 MiB with its own copy, against 6.63 MiB modelled.
fn receive(own: bool, payload: Payload) -> Payload {
    match payload {
        Payload::Bytes(bytes) if !own => Payload::Bytes(bytes.as_slice().to_vec()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank 3 fails the group; before that reaches sub-group {1, 3}, rank 0 (which learned it
    /// in sub-group {0, 2}) fails too. Sub-group {1, 3} must hear of rank 3, the first.
    #[test]
    fn the_first_failure_is_the_one_passed_on() {
        let root = Hub::new(vec![0, 1, 2, 3], Duration::from_secs(1), Duration::from_secs(1));
        let even = root.child((0, 0), &[0, 2]);
        let odd = root.child((0, 1), &[1, 3]);
        // Rank 3's failure, recorded at the root and passed on to {0, 2} only so far.
        root.lock().failed = Some((3, "rank 3 gives up".into()));
        even.fail(3, "rank 3 gives up".into());
        root.fail(0, "rank 0 heard of rank 3".into());
        assert_eq!(odd.lock().failed.as_ref().map(|f| f.0), Some(3));
        assert_eq!(even.lock().failed.as_ref().map(|f| f.0), Some(3));
    }

    /// `pool_per_rank` shares the current pool's threads out over the ranks, at least one each,
    /// and each rank's closure then runs on a worker of a pool of that size.
    #[test]
    fn pool_per_rank_shares_the_threads_out() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(5).build().unwrap();
        pool.install(|| {
            for (ranks, each) in [(1, 5), (2, 2), (5, 1), (8, 1), (0, 5)] {
                assert_eq!(
                    GroupOptions::pool_per_rank(ranks).threads_per_rank,
                    Some(each),
                    "{ranks} ranks"
                );
            }
            let seen = LocalGroup::run_with(GroupOptions::pool_per_rank(2), 2, |_| {
                Ok((
                    rayon::current_thread_index().is_some(),
                    rayon::current_num_threads(),
                ))
            })
            .unwrap();
            assert_eq!(seen, vec![(true, 2), (true, 2)]);
        });
    }
}
