//! `Nccl`: expert-parallel ranks as processes, one GPU each, exchanging through NCCL.
//!
//! Ranks are configured like torchrun: `RANK` and `WORLD_SIZE` from the environment
//! (defaults 0 and 1), `LOCAL_RANK` picks the GPU (default: `RANK` modulo the device count).
//! Rank 0 creates the NCCL unique id and writes it to a rendezvous file that the other ranks
//! wait for. This communicator implements the host-bytes [`Communicator`] contract: each
//! exchange copies the payloads to the device, runs one grouped send/recv per peer
//! (`ncclGroupStart`, `ncclSend`/`ncclRecv` at per-peer offsets, `ncclGroupEnd`), and copies
//! the result back. The device-pointer path that keeps rows on the GPU belongs with the
//! stream-overlapped exchange op and is not written yet.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::safe::{Comm, Id};
use mpipemoe::comm::Payload;
use mpipemoe::{Communicator, MoeError, Result};

/// One rank of an NCCL group.
#[derive(Debug)]
pub struct Nccl {
    rank: usize,
    world: usize,
    comm: Mutex<SendComm>,
    stream: Arc<CudaStream>,
}

/// `Comm` holds a raw NCCL handle, so it is neither `Send` nor `Sync`.
#[derive(Debug)]
struct SendComm(Comm);

// SAFETY: NCCL allows a communicator to be used from any thread as long as calls on it do
// not run concurrently; every use goes through the `Mutex` in `Nccl`, which serialises them.
unsafe impl Send for SendComm {}

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

impl Nccl {
    /// Joins the group described by `RANK`, `WORLD_SIZE` and `LOCAL_RANK`, exchanging the
    /// NCCL id through `rendezvous` (a path all ranks can read; rank 0 writes it). Waits at
    /// most `timeout` for rank 0.
    pub fn from_env(rendezvous: &Path, timeout: Duration) -> Result<Self> {
        crate::cuda_available().map_err(|e| MoeError::Backend(e.to_string()))?;
        let rank = env_usize("RANK", 0)?;
        let world = env_usize("WORLD_SIZE", 1)?;
        if rank >= world {
            return Err(MoeError::Backend(format!(
                "RANK {rank} is not below WORLD_SIZE {world}"
            )));
        }
        let devices =
            CudaContext::device_count().map_err(|e| MoeError::Backend(format!("CUDA: {e:?}")))? as usize;
        let ordinal = env_usize("LOCAL_RANK", rank % devices.max(1))?;
        let context = CudaContext::new(ordinal)
            .map_err(|e| MoeError::Backend(format!("CUDA device {ordinal}: {e:?}")))?;
        let stream = context
            .new_stream()
            .map_err(|e| MoeError::Backend(format!("CUDA stream: {e:?}")))?;
        let id = if rank == 0 {
            let id = Id::new().map_err(|e| nccl_err("init", rank, e))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            let tmp = rendezvous.with_extension("tmp");
            std::fs::write(&tmp, &bytes).map_err(|e| MoeError::file(&tmp, e.to_string()))?;
            std::fs::rename(&tmp, rendezvous).map_err(|e| MoeError::file(rendezvous, e.to_string()))?;
            id
        } else {
            let start = Instant::now();
            let bytes = loop {
                match std::fs::read(rendezvous) {
                    Ok(b) if b.len() == 128 => break b,
                    _ if start.elapsed() > timeout => {
                        return Err(MoeError::comm(
                            "init",
                            rank,
                            format!("rank 0 did not write {} in {timeout:?}", rendezvous.display()),
                        ))
                    }
                    _ => std::thread::sleep(Duration::from_millis(50)),
                }
            };
            let mut internal = [0 as std::ffi::c_char; 128];
            for (dst, src) in internal.iter_mut().zip(bytes) {
                *dst = src as std::ffi::c_char;
            }
            Id::uninit(internal)
        };
        let comm = Comm::from_rank(stream.clone(), rank, world, id).map_err(|e| nccl_err("init", rank, e))?;
        Ok(Self {
            rank,
            world,
            comm: Mutex::new(SendComm(comm)),
            stream,
        })
    }
}

/// A payload as bytes: a kind tag, then little-endian values.
fn encode(payload: &Payload) -> Vec<u8> {
    match payload {
        Payload::Bytes(b) => std::iter::once(0u8).chain(b.iter().copied()).collect(),
        Payload::Counts(c) => std::iter::once(1u8)
            .chain(c.iter().flat_map(|v| (*v as u64).to_le_bytes()))
            .collect(),
        Payload::Values(v) => std::iter::once(2u8)
            .chain(v.iter().flat_map(|x| x.to_le_bytes()))
            .collect(),
    }
}

fn decode(bytes: &[u8]) -> Option<Payload> {
    let (tag, body) = bytes.split_first()?;
    let words = |f: fn([u8; 8]) -> u64| {
        body.chunks_exact(8)
            .map(move |c| f(c.try_into().expect("8 bytes")))
    };
    match tag {
        0 => Some(Payload::Bytes(body.to_vec())),
        1 => Some(Payload::Counts(
            words(u64::from_le_bytes).map(|v| v as usize).collect(),
        )),
        2 => Some(Payload::Values(
            words(u64::from_le_bytes).map(f64::from_bits).collect(),
        )),
        _ => None,
    }
}

impl Nccl {
    /// One grouped send/recv round: `send[peer]` goes to `peer`, `recv_len[peer]` bytes
    /// arrive from it.
    fn round(&self, op: &str, send: &[Vec<u8>], recv_len: &[usize]) -> Result<Vec<Vec<u8>>> {
        let comm = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let s = &self.stream;
        let err = |e: cudarc::driver::DriverError| MoeError::comm(op, self.rank, format!("CUDA: {e:?}"));
        let device_send = send
            .iter()
            .map(|b| {
                s.clone_htod(&if b.is_empty() { vec![0u8] } else { b.clone() })
                    .map_err(err)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut device_recv = recv_len
            .iter()
            .map(|&n| s.alloc_zeros::<u8>(n.max(1)).map_err(err))
            .collect::<Result<Vec<_>>>()?;
        {
            let mut group = comm.0.group();
            for (peer, buf) in device_send.iter().enumerate() {
                if !send[peer].is_empty() {
                    group
                        .send(buf.slice(0..send[peer].len()), peer as i32)
                        .map_err(|e| nccl_err(op, self.rank, e))?;
                }
            }
            for (peer, buf) in device_recv.iter_mut().enumerate() {
                if recv_len[peer] > 0 {
                    group
                        .recv(buf.slice_mut(0..recv_len[peer]), peer as i32)
                        .map_err(|e| nccl_err(op, self.rank, e))?;
                }
            }
        }
        s.synchronize().map_err(err)?;
        device_recv
            .iter()
            .zip(recv_len)
            .map(|(buf, &n)| {
                s.clone_dtoh(buf)
                    .map(|mut v| {
                        v.truncate(n);
                        v
                    })
                    .map_err(err)
            })
            .collect()
    }
}

impl Communicator for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn n_ranks(&self) -> usize {
        self.world
    }

    fn exchange(&self, op: &'static str, outgoing: Vec<Payload>) -> Result<Vec<Payload>> {
        if outgoing.len() != self.world {
            return Err(MoeError::comm(
                op,
                self.rank,
                format!("{} payloads for {} ranks", outgoing.len(), self.world),
            ));
        }
        if self.world == 1 {
            return Ok(outgoing);
        }
        let send: Vec<Vec<u8>> = outgoing.iter().map(encode).collect();
        // First the sizes (eight bytes to and from every peer), then the payloads.
        let sizes: Vec<Vec<u8>> = send
            .iter()
            .map(|b| (b.len() as u64).to_le_bytes().to_vec())
            .collect();
        let got = self.round(op, &sizes, &vec![8; self.world])?;
        let recv_len: Vec<usize> = got
            .iter()
            .map(|b| u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as usize)
            .collect();
        self.round(op, &send, &recv_len)?
            .into_iter()
            .enumerate()
            .map(|(src, b)| {
                decode(&b).ok_or_else(|| {
                    MoeError::comm(op, self.rank, format!("rank {src} sent an unreadable payload"))
                })
            })
            .collect()
    }
}
