//! [`Nccl`] as a [`Communicator`]: split, the host-bytes exchange in bounded rounds, and the
//! arrival barrier.

use std::sync::Arc;
use std::time::Duration;

use cudarc::nccl::{result as nccl, sys as nccl_sys};
use mpipemoe::comm::{Payload, RowPaths};
use mpipemoe::{Communicator, MoeError, Result};

use super::raw::{non_blocking_config, CommOps, RawComm};
use super::{cuda_err, nccl_err, Nccl, ROUND_BYTES};
use crate::group::Wait;
use crate::payload::{decode, encode, MAX_PAYLOAD_BYTES};

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
