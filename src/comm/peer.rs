//! The uneven all-to-all as point-to-point posts: the part of a device all-to-all that is not
//! FFI, shared by the host twin ([`HostPeers`]) and the NCCL path of the `mpipemoe-cuda` crate.
//!
//! A device all-to-all-v is one group of sends and receives, one pair per peer, at per-peer
//! offsets into one send buffer and one receive buffer (as nccl-tests' `alltoallv` posts it).
//! [`PeerLayout`] turns row counts into those byte ranges, checked against overflow and against
//! the buffers; [`post_all_to_all_v`] posts them in a fixed order through a [`PeerTransport`].
//! The transport is the only thing a device backend writes: NCCL's `ncclSend`/`ncclRecv` on
//! device pointers there, [`HostPeers`] over any [`Communicator`] here, so the offsets, the
//! order of posts and the placement of received rows are tested on the CPU at 1–4 ranks.

use std::ops::Range;

use super::{Communicator, Payload};
use crate::error::{MoeError, Result};

/// Where each peer's rows lie in the send and the receive buffer of one all-to-all-v.
///
/// Rows are grouped by peer in rank order in both buffers: `send[peer]` is the byte range of
/// the rows this rank sends to `peer`, `recv[peer]` where the rows from `peer` land.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerLayout {
    /// Byte range of the rows for each destination rank, in the send buffer.
    pub send: Vec<Range<usize>>,
    /// Byte range of the rows from each source rank, in the receive buffer.
    pub recv: Vec<Range<usize>>,
}

impl PeerLayout {
    /// The layout of `send_rows[peer]` rows out and `recv_rows[peer]` rows in, each row
    /// `row_bytes` long. Both lists must cover the same number of ranks; a byte count that
    /// would overflow `usize` is an error, not a wrap.
    pub fn new(send_rows: &[usize], recv_rows: &[usize], row_bytes: usize) -> Result<Self> {
        if send_rows.len() != recv_rows.len() {
            return Err(MoeError::Backend(format!(
                "all-to-all layout: send counts cover {} ranks, receive counts {}",
                send_rows.len(),
                recv_rows.len()
            )));
        }
        Ok(Self {
            send: ranges(send_rows, row_bytes, "send")?,
            recv: ranges(recv_rows, row_bytes, "receive")?,
        })
    }

    /// The number of ranks.
    pub fn n_ranks(&self) -> usize {
        self.send.len()
    }

    /// Bytes in the send buffer.
    pub fn send_bytes(&self) -> usize {
        self.send.last().map_or(0, |r| r.end)
    }

    /// Bytes in the receive buffer.
    pub fn recv_bytes(&self) -> usize {
        self.recv.last().map_or(0, |r| r.end)
    }
}

/// Consecutive byte ranges of `rows[i] * row_bytes` bytes.
fn ranges(rows: &[usize], row_bytes: usize, side: &str) -> Result<Vec<Range<usize>>> {
    let overflow = || {
        MoeError::Backend(format!(
            "all-to-all layout: {side} counts {rows:?} of {row_bytes}-byte rows overflow the address space"
        ))
    };
    let mut start = 0usize;
    rows.iter()
        .map(|&n| {
            let end = n
                .checked_mul(row_bytes)
                .and_then(|len| start.checked_add(len))
                .ok_or_else(overflow)?;
            let range = start..end;
            start = end;
            Ok(range)
        })
        .collect()
}

/// The point-to-point primitives of one all-to-all-v between a send and a receive buffer that
/// the transport holds. Calls arrive as `begin`, then sends, receives and at most one local
/// copy, then `end`; nothing may be assumed complete before `end` returns.
pub trait PeerTransport {
    /// Opens the group (NCCL: `ncclGroupStart`).
    fn begin(&mut self) -> Result<()>;
    /// Posts the send of `bytes` of the send buffer to `peer`.
    fn send(&mut self, peer: usize, bytes: Range<usize>) -> Result<()>;
    /// Posts the receive from `peer` into `bytes` of the receive buffer.
    fn recv(&mut self, peer: usize, bytes: Range<usize>) -> Result<()>;
    /// Copies this rank's own rows from `from` in the send buffer to `to` in the receive
    /// buffer (same length), which never needs the network.
    fn copy_local(&mut self, from: Range<usize>, to: Range<usize>) -> Result<()>;
    /// Closes the group and waits until every posted transfer is complete.
    fn end(&mut self) -> Result<()>;
    /// Closes a group that failed part-way (a post returned an error), so that no group stays
    /// open on this thread: NCCL nests a later `ncclGroupStart` inside an open group, and that
    /// group's posts would then wait for an end that never comes while reporting success.
    /// Whatever was posted is not waited for; a device transport also makes sure it cannot
    /// hang (NCCL aborts the communicator: its peers see an error, not half a group).
    fn abandon(&mut self);
}

/// Posts one all-to-all-v as `rank` of `layout.n_ranks()`: the own rows as a local copy, then
/// for every other peer in rank order its send and its receive, skipping empty ones (a peer
/// with nothing to send posts nothing, and NCCL matches sends to receives per peer pair, so
/// both sides skip the same pairs because both derive them from the same counts).
///
/// The receive counts must be what the peers send (the layer's plan gets them from the counts
/// collective); a transport that cannot check it (NCCL) would otherwise move wrong bytes.
pub fn post_all_to_all_v<T: PeerTransport + ?Sized>(
    transport: &mut T,
    rank: usize,
    layout: &PeerLayout,
) -> Result<()> {
    if rank >= layout.n_ranks() {
        return Err(MoeError::Backend(format!(
            "all-to-all: rank {rank} is outside a layout of {} ranks",
            layout.n_ranks()
        )));
    }
    let own_send = layout.send[rank].clone();
    let own_recv = layout.recv[rank].clone();
    if own_send.len() != own_recv.len() {
        return Err(MoeError::Backend(format!(
            "all-to-all: rank {rank} sends itself {} bytes but expects {}",
            own_send.len(),
            own_recv.len()
        )));
    }
    transport.begin()?;
    let post = || -> Result<()> {
        if !own_send.is_empty() {
            transport.copy_local(own_send, own_recv)?;
        }
        for peer in (0..layout.n_ranks()).filter(|&p| p != rank) {
            if !layout.send[peer].is_empty() {
                transport.send(peer, layout.send[peer].clone())?;
            }
            if !layout.recv[peer].is_empty() {
                transport.recv(peer, layout.recv[peer].clone())?;
            }
        }
        Ok(())
    };
    // Every path out of an open group closes it: `end` on success, `abandon` on a failed post.
    match post() {
        Ok(()) => transport.end(),
        Err(e) => {
            transport.abandon();
            Err(e)
        }
    }
}

/// The host twin of a device transport: the same posts over any [`Communicator`], between
/// host buffers. `end` runs one [`Communicator::exchange`] with the posted sends and places
/// what arrives at the posted receive ranges, checking every length.
#[derive(Debug)]
pub struct HostPeers<'a> {
    comm: &'a dyn Communicator,
    op: &'static str,
    send: &'a [u8],
    recv: &'a mut [u8],
    outgoing: Vec<Option<Range<usize>>>,
    incoming: Vec<Option<Range<usize>>>,
}

impl<'a> HostPeers<'a> {
    /// A transport for one all-to-all named `op` from `send` into `recv`.
    pub fn new(comm: &'a dyn Communicator, op: &'static str, send: &'a [u8], recv: &'a mut [u8]) -> Self {
        let n = comm.n_ranks();
        Self {
            comm,
            op,
            send,
            recv,
            outgoing: vec![None; n],
            incoming: vec![None; n],
        }
    }

    fn check(&self, what: &str, peer: usize, bytes: &Range<usize>, len: usize) -> Result<()> {
        if peer >= self.comm.n_ranks() || bytes.start > bytes.end || bytes.end > len {
            return Err(MoeError::comm(
                self.op,
                self.comm.rank(),
                format!("{what} of bytes {bytes:?} for rank {peer} is outside a {len}-byte buffer"),
            ));
        }
        Ok(())
    }
}

impl PeerTransport for HostPeers<'_> {
    fn begin(&mut self) -> Result<()> {
        self.outgoing.iter_mut().for_each(|o| *o = None);
        self.incoming.iter_mut().for_each(|o| *o = None);
        Ok(())
    }

    fn send(&mut self, peer: usize, bytes: Range<usize>) -> Result<()> {
        self.check("send", peer, &bytes, self.send.len())?;
        self.outgoing[peer] = Some(bytes);
        Ok(())
    }

    fn recv(&mut self, peer: usize, bytes: Range<usize>) -> Result<()> {
        self.check("receive", peer, &bytes, self.recv.len())?;
        self.incoming[peer] = Some(bytes);
        Ok(())
    }

    fn copy_local(&mut self, from: Range<usize>, to: Range<usize>) -> Result<()> {
        let rank = self.comm.rank();
        self.check("local copy", rank, &from, self.send.len())?;
        self.check("local copy", rank, &to, self.recv.len())?;
        self.recv[to].copy_from_slice(&self.send[from]);
        Ok(())
    }

    /// Nothing was sent yet (the exchange happens in `end`); the peers' collective fails on
    /// their side when this rank returns its error without joining it.
    fn abandon(&mut self) {}

    fn end(&mut self) -> Result<()> {
        let (op, rank) = (self.op, self.comm.rank());
        // Every rank takes part in the exchange, with an empty payload where it posted nothing,
        // because the communicator's primitive is a collective.
        let outgoing = self
            .outgoing
            .iter()
            .map(|r| Payload::Bytes(r.clone().map(|r| self.send[r].to_vec()).unwrap_or_default()))
            .collect();
        let incoming = self.comm.exchange(op, outgoing)?;
        for (src, payload) in incoming.into_iter().enumerate() {
            if src == rank {
                continue;
            }
            let bytes = match payload {
                Payload::Bytes(b) => b,
                _ => {
                    return Err(MoeError::comm(
                        op,
                        rank,
                        format!("rank {src} sent a non-byte payload in an all-to-all (ranks called different collectives)"),
                    ))
                }
            };
            let want = self.incoming[src].clone().unwrap_or(0..0);
            if bytes.len() != want.len() {
                return Err(MoeError::comm(
                    op,
                    rank,
                    format!(
                        "rank {src} sent {} bytes, the plan expected {}",
                        bytes.len(),
                        want.len()
                    ),
                ));
            }
            self.recv[want].copy_from_slice(&bytes);
        }
        Ok(())
    }
}

/// The uneven all-to-all of rows on host buffers through [`post_all_to_all_v`] and
/// [`HostPeers`]: `send_rows[peer]` rows of `row_bytes` go to each peer and `recv_rows[peer]`
/// are expected from it. Returns the receive buffer, grouped by source rank.
pub fn host_all_to_all_v(
    comm: &dyn Communicator,
    op: &'static str,
    send: &[u8],
    row_bytes: usize,
    send_rows: &[usize],
    recv_rows: &[usize],
) -> Result<Vec<u8>> {
    let layout = PeerLayout::new(send_rows, recv_rows, row_bytes)?;
    // Checked before the receive buffer is allocated from the counts.
    check_host_layout(comm, op, send.len(), &layout, layout.recv_bytes())?;
    let mut recv = vec![0u8; layout.recv_bytes()];
    post_all_to_all_v(
        &mut HostPeers::new(comm, op, send, &mut recv),
        comm.rank(),
        &layout,
    )?;
    Ok(recv)
}

/// [`host_all_to_all_v`] of `layout`'s rows into `recv`, a caller's buffer of exactly
/// `layout.recv_bytes()` (CUDA's page-locked one, which the rows then leave for the device
/// without another copy). Every byte of `recv` is written.
///
/// # Errors
/// [`MoeError::Comm`] where the layout is not for this group, `send` or `recv` is not its size,
/// or a peer fails.
pub fn host_all_to_all_v_into(
    comm: &dyn Communicator,
    op: &'static str,
    send: &[u8],
    layout: &PeerLayout,
    recv: &mut [u8],
) -> Result<()> {
    check_host_layout(comm, op, send.len(), layout, recv.len())?;
    post_all_to_all_v(&mut HostPeers::new(comm, op, send, recv), comm.rank(), layout)
}

/// That `layout` is for `comm`'s group, with `send_bytes` to send and room for `recv_bytes`.
fn check_host_layout(
    comm: &dyn Communicator,
    op: &'static str,
    send_bytes: usize,
    layout: &PeerLayout,
    recv_bytes: usize,
) -> Result<()> {
    if layout.n_ranks() == comm.n_ranks()
        && layout.send_bytes() == send_bytes
        && layout.recv_bytes() == recv_bytes
    {
        return Ok(());
    }
    Err(MoeError::comm(
        op,
        comm.rank(),
        format!(
            "{send_bytes} bytes to send and a {recv_bytes}-byte receive buffer for a layout of {} \
             and {} bytes over {} ranks, in a group of {}",
            layout.send_bytes(),
            layout.recv_bytes(),
            layout.n_ranks(),
            comm.n_ranks()
        ),
    ))
}
