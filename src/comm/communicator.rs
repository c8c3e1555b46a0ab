//! The [`Communicator`] trait and the collectives built on its one primitive.

use std::fmt;

use super::RowPaths;
use crate::error::{MoeError, Result};

/// One message from one rank to another.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// Raw tensor bytes (rows of any float dtype, row-major).
    Bytes(Vec<u8>),
    /// Integer bookkeeping: counts, token totals.
    Counts(Vec<usize>),
    /// Floating-point values reduced by the collectives (loss shares, statistics).
    Values(Vec<f64>),
    /// Single-precision values: the gradient buckets of
    /// [`all_reduce_sum_f32`](Communicator::all_reduce_sum_f32).
    Floats(Vec<f32>),
}

impl Payload {
    fn kind(&self) -> &'static str {
        match self {
            Payload::Bytes(_) => "bytes",
            Payload::Counts(_) => "counts",
            Payload::Values(_) => "values",
            Payload::Floats(_) => "floats",
        }
    }
}

/// A group of expert-parallel ranks that can exchange data.
///
/// Every rank must call the same collectives in the same order (as with NCCL or MPI). A
/// collective that cannot complete — a peer died, errored, or did not arrive within the
/// group's timeout — returns [`MoeError::Comm`] naming the collective and the rank at fault;
/// it never hangs.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This rank's index in `0..n_ranks`.
    fn rank(&self) -> usize;

    /// The number of ranks in the group.
    fn n_ranks(&self) -> usize;

    /// Whether an all-to-all may be skipped because it would return its input unchanged
    /// (one rank). A communicator that emulates a network on one rank says `false`.
    fn is_identity(&self) -> bool {
        self.n_ranks() == 1
    }

    /// This communicator's own paths for the rows' all-to-all, per backend (see
    /// [`RowPaths`]); `None` (the default) sends rows as host bytes through
    /// [`exchange`](Communicator::exchange).
    fn row_paths(&self) -> Option<&RowPaths> {
        None
    }

    /// Sends `outgoing[dst]` to every rank `dst` and returns what every rank sent to this one,
    /// indexed by source rank. `outgoing.len()` must equal `n_ranks`.
    fn exchange(&self, op: &'static str, outgoing: Vec<Payload>) -> Result<Vec<Payload>>;

    /// All-to-all with uneven counts over rows of `row_bytes` bytes each.
    ///
    /// `send` holds `sum(send_counts)` rows grouped by destination rank (`send_counts[dst]`
    /// rows for `dst`, in rank order). Returns the received rows grouped by source rank, and
    /// how many rows came from each source.
    fn all_to_all_v(
        &self,
        send: &[u8],
        row_bytes: usize,
        send_counts: &[usize],
    ) -> Result<(Vec<u8>, Vec<usize>)> {
        let op = "all_to_all_v";
        check_len(self, op, "send_counts", send_counts.len())?;
        let total: usize = send_counts.iter().sum();
        if total * row_bytes != send.len() {
            return Err(MoeError::comm(
                op,
                self.rank(),
                format!(
                    "send buffer has {} bytes, but send_counts sum to {total} rows of {row_bytes} bytes",
                    send.len()
                ),
            ));
        }
        let mut outgoing = Vec::with_capacity(send_counts.len());
        let mut start = 0;
        for &count in send_counts {
            let end = start + count * row_bytes;
            outgoing.push(Payload::Bytes(send[start..end].to_vec()));
            start = end;
        }
        let incoming = self.exchange(op, outgoing)?;
        let mut recv = Vec::new();
        let mut recv_counts = Vec::with_capacity(incoming.len());
        for (src, payload) in incoming.into_iter().enumerate() {
            let bytes = expect_bytes(self, op, src, payload)?;
            if row_bytes > 0 && bytes.len() % row_bytes != 0 {
                return Err(MoeError::comm(
                    op,
                    self.rank(),
                    format!(
                        "rank {src} sent {} bytes, not a whole number of {row_bytes}-byte rows",
                        bytes.len()
                    ),
                ));
            }
            recv_counts.push(bytes.len().checked_div(row_bytes).unwrap_or(0));
            recv.extend_from_slice(&bytes);
        }
        Ok((recv, recv_counts))
    }

    /// Exchanges blocks of counts: `send[dst * per_rank..(dst + 1) * per_rank]` goes to `dst`.
    /// Returns the blocks received, concatenated in source-rank order.
    fn all_to_all_counts(&self, send: &[usize], per_rank: usize) -> Result<Vec<usize>> {
        let op = "all_to_all_counts";
        check_len(self, op, "send", send.len() / per_rank.max(1))?;
        // A group of one sends to itself: no exchange (a decode step counts every layer's rows
        // this way, and a one-rank group of threads still takes its locks).
        if self.n_ranks() == 1 && send.len() == per_rank {
            return Ok(send.to_vec());
        }
        let outgoing = (0..self.n_ranks())
            .map(|dst| Payload::Counts(send[dst * per_rank..(dst + 1) * per_rank].to_vec()))
            .collect();
        let incoming = self.exchange(op, outgoing)?;
        let mut out = Vec::with_capacity(send.len());
        for (src, payload) in incoming.into_iter().enumerate() {
            out.extend(expect_counts(self, op, src, payload, per_rank)?);
        }
        Ok(out)
    }

    /// Gathers every rank's `local` counts (all of the same length) on every rank,
    /// concatenated in rank order.
    fn all_gather_counts(&self, local: &[usize]) -> Result<Vec<usize>> {
        let op = "all_gather_counts";
        if self.n_ranks() == 1 {
            return Ok(local.to_vec());
        }
        let outgoing = vec![Payload::Counts(local.to_vec()); self.n_ranks()];
        let incoming = self.exchange(op, outgoing)?;
        let mut out = Vec::with_capacity(local.len() * self.n_ranks());
        for (src, payload) in incoming.into_iter().enumerate() {
            out.extend(expect_counts(self, op, src, payload, local.len())?);
        }
        Ok(out)
    }

    /// Sums `values` over all ranks, in place. Every rank adds the contributions in rank
    /// order, so the result is bitwise identical on every rank and from run to run.
    fn all_reduce_sum(&self, values: &mut [f64]) -> Result<()> {
        let op = "all_reduce_sum";
        if self.n_ranks() == 1 {
            return Ok(());
        }
        let outgoing = vec![Payload::Values(values.to_vec()); self.n_ranks()];
        let incoming = self.exchange(op, outgoing)?;
        values.iter_mut().for_each(|v| *v = 0.0);
        for (src, payload) in incoming.into_iter().enumerate() {
            match payload {
                Payload::Values(v) if v.len() == values.len() => {
                    values.iter_mut().zip(v).for_each(|(acc, x)| *acc += x)
                }
                other => return Err(mismatch(self, op, src, "values", &other)),
            }
        }
        Ok(())
    }

    /// Sums `values` over all ranks in single precision, in place: the host path of the
    /// gradient all-reduce ([`crate::parallel::sync_replicated_grads`]).
    ///
    /// A reduce-scatter and an all-gather, as ring all-reduces move data: rank `r` receives
    /// everyone's chunk `r` (one `n_ranks`-th of the vector), adds the chunks in rank order and
    /// sends the sum to every rank. Each rank sends and receives about twice the vector, not
    /// `n_ranks` times as a gather of whole vectors would, and the result is bitwise the same
    /// on every rank and from run to run.
    fn all_reduce_sum_f32(&self, values: &mut [f32]) -> Result<()> {
        let op = "all_reduce_sum_f32";
        let n = self.n_ranks();
        if n == 1 {
            return Ok(());
        }
        let len = values.len();
        let chunk = |r: usize| crate::pipeline::chunk_range(len, n, r);
        let outgoing = (0..n)
            .map(|dst| Payload::Floats(values[chunk(dst)].to_vec()))
            .collect();
        let incoming = self.exchange(op, outgoing)?;
        let mine = chunk(self.rank());
        let mut sum = vec![0.0f32; mine.len()];
        for (src, payload) in incoming.into_iter().enumerate() {
            match payload {
                Payload::Floats(v) if v.len() == sum.len() => {
                    sum.iter_mut().zip(v).for_each(|(acc, x)| *acc += x)
                }
                other => return Err(mismatch(self, op, src, "floats of this rank's chunk", &other)),
            }
        }
        let incoming = self.exchange(op, vec![Payload::Floats(sum); n])?;
        for (src, payload) in incoming.into_iter().enumerate() {
            match payload {
                Payload::Floats(v) if v.len() == chunk(src).len() => values[chunk(src)].copy_from_slice(&v),
                other => return Err(mismatch(self, op, src, "floats of the sender's chunk", &other)),
            }
        }
        Ok(())
    }

    /// Copies rank `root`'s `values` into `values` on every rank (every rank passes a slice of
    /// the same length): how the layer sends a shadowed expert's weights from its owner to
    /// every rank.
    ///
    /// The default sends the root's vector to each other rank through
    /// [`exchange`](Communicator::exchange): the root sends `n_ranks - 1` copies and the other
    /// ranks send nothing, where the all-to-all it replaces had every rank send to every rank.
    /// A device communicator broadcasts on the device (NCCL's ring moves about one vector per
    /// rank), through its [`TensorReduce`](super::TensorReduce) path.
    ///
    /// # Errors
    /// [`MoeError::Comm`] if `root` is not a rank, a peer fails, or the root's vector has
    /// another length than this rank's.
    fn broadcast_f32(&self, root: usize, values: &mut [f32]) -> Result<()> {
        let op = "broadcast_f32";
        let n = self.n_ranks();
        if root >= n {
            return Err(MoeError::comm(
                op,
                self.rank(),
                format!("root {root} is not a rank of {n}"),
            ));
        }
        if n == 1 {
            return Ok(());
        }
        let outgoing = (0..n)
            .map(|dst| {
                let mine = self.rank() == root && dst != root;
                Payload::Floats(if mine { values.to_vec() } else { Vec::new() })
            })
            .collect();
        let incoming = self.exchange(op, outgoing)?;
        for (src, payload) in incoming.into_iter().enumerate() {
            let from_root = src == root && self.rank() != root;
            match payload {
                Payload::Floats(v) if from_root && v.len() == values.len() => values.copy_from_slice(&v),
                Payload::Floats(v) if from_root => {
                    return Err(MoeError::comm(
                        op,
                        self.rank(),
                        format!(
                            "root {root} sent {} values where this rank has {}",
                            v.len(),
                            values.len()
                        ),
                    ))
                }
                Payload::Floats(v) if v.is_empty() => {}
                other => return Err(mismatch(self, op, src, "the root's floats, or nothing", &other)),
            }
        }
        Ok(())
    }

    /// Splits this group into sub-groups, collectively: the ranks that pass the same `color`
    /// form one, ranked in their order here (as `MPI_Comm_split` and `ncclCommSplit` with the
    /// rank as key). How [`ParallelGroups`](crate::parallel::ParallelGroups) builds the
    /// expert-parallel and expert-data-parallel groups.
    ///
    /// # Errors
    /// [`MoeError::Comm`] if a peer fails, or if this communicator cannot form sub-groups (the
    /// default).
    fn split(&self, color: usize) -> Result<std::sync::Arc<dyn Communicator>> {
        let _ = color;
        Err(MoeError::comm(
            "split",
            self.rank(),
            format!("{self:?} cannot form sub-groups"),
        ))
    }

    /// Returns once every rank has called it, waiting at most a transfer's timeout.
    fn barrier(&self) -> Result<()> {
        let outgoing = vec![Payload::Counts(Vec::new()); self.n_ranks()];
        self.exchange("barrier", outgoing).map(|_| ())
    }

    /// A barrier for the points where ranks come apart by design and may wait for each other
    /// for minutes: one rank writing a checkpoint while the others wait, ranks loading
    /// theirs at different speeds before the first collective. It waits up to the group's
    /// *arrival* bound ([`GroupOptions::arrival_timeout`](super::GroupOptions), the NCCL
    /// group's `with_arrival_timeout`), far longer than a transfer's, which stays short so
    /// that a peer that died mid-step is found quickly. A peer that fails is still reported
    /// at once. The default, for a communicator without a bound of its own, is
    /// [`barrier`](Communicator::barrier).
    fn arrival_barrier(&self) -> Result<()> {
        self.barrier()
    }
}

fn check_len<C: Communicator + ?Sized>(comm: &C, op: &str, what: &str, len: usize) -> Result<()> {
    if len == comm.n_ranks() {
        Ok(())
    } else {
        Err(MoeError::comm(
            op,
            comm.rank(),
            format!("`{what}` covers {len} ranks, the group has {}", comm.n_ranks()),
        ))
    }
}

fn mismatch<C: Communicator + ?Sized>(comm: &C, op: &str, src: usize, want: &str, got: &Payload) -> MoeError {
    MoeError::comm(
        op,
        comm.rank(),
        format!(
            "rank {src} sent a {} payload where {want} was expected (ranks called different collectives)",
            got.kind()
        ),
    )
}

fn expect_bytes<C: Communicator + ?Sized>(
    comm: &C,
    op: &str,
    src: usize,
    payload: Payload,
) -> Result<Vec<u8>> {
    match payload {
        Payload::Bytes(bytes) => Ok(bytes),
        other => Err(mismatch(comm, op, src, "bytes", &other)),
    }
}

fn expect_counts<C: Communicator + ?Sized>(
    comm: &C,
    op: &str,
    src: usize,
    payload: Payload,
    len: usize,
) -> Result<Vec<usize>> {
    match payload {
        Payload::Counts(counts) if counts.len() == len => Ok(counts),
        Payload::Counts(counts) => Err(MoeError::comm(
            op,
            comm.rank(),
            format!("rank {src} sent {} counts, expected {len}", counts.len()),
        )),
        other => Err(mismatch(comm, op, src, "counts", &other)),
    }
}
