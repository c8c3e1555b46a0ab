//! The rows' all-to-all of the fused exchange on device pointers: `T_DI` and `T_DO` partitions
//! go from cubecl's buffers to NCCL and back into a cubecl buffer without touching the host.
//! Only the counts (a few bytes, through the counts collective) pass through the host.
//!
//! Ordering with cubecl's streams: the exchange step runs on one of the schedule's worker
//! threads, and the rows it sends were written either on that worker's stream or on another
//! worker's stream that the executor fenced after that step (mpipemoe's `execute_on`: a step's
//! stream is synchronised after it before a step on another stream that waits for it runs);
//! cubecl's own cross-stream events are not what makes this correct, since they key a buffer
//! to the stream that allocated it (mpipemoe's `exchange/streams.rs`). `client.sync()` then
//! waits until the writes queued on this worker's stream are done, the NCCL group runs on
//! this rank's own CUDA stream, and `end` waits for it before the output tensor is handed to
//! the next step. Blocking the comm worker's host thread costs nothing: compute is issued
//! from the other workers.

use std::sync::Arc;

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::FloatElement;
use cubecl::cuda::CudaRuntime;
use cudarc::nccl::sys as nccl_sys;
use mpipemoe::comm::{PeerLayout, RowExchange, RowPaths, TensorReduce};
use mpipemoe::{Communicator, MoeError, Result};

use crate::nccl::NcclShared;
use crate::offload::{PinnedOffload, PinnedPath};
use crate::CudaMoe;

/// The NCCL device row path of one rank.
#[derive(Debug, Clone)]
pub(crate) struct NcclRows(pub(crate) Arc<NcclShared>);

/// The paths a rank offers for the CUDA backend in f32, bf16 and f16: its NCCL device path for
/// the rows' all-to-all and its pinned offload.
pub(crate) fn row_paths(shared: &Arc<NcclShared>) -> Result<RowPaths> {
    let rows = NcclRows(shared.clone());
    let pinned = PinnedPath(Arc::new(PinnedOffload::new(shared.context.clone())?));
    Ok(RowPaths::new()
        .with::<CudaMoe<f32>>(Arc::new(rows.clone()))
        .with::<CudaMoe<burn::tensor::bf16>>(Arc::new(rows.clone()))
        .with::<CudaMoe<burn::tensor::f16>>(Arc::new(rows))
        .with_offload::<CudaMoe<f32>>(Arc::new(pinned.clone()))
        .with_offload::<CudaMoe<burn::tensor::bf16>>(Arc::new(pinned.clone()))
        .with_offload::<CudaMoe<burn::tensor::f16>>(Arc::new(pinned))
        .with_reduce::<CudaMoe<f32>>(Arc::new(NcclReduce(shared.clone())))
        .with_reduce::<CudaMoe<burn::tensor::bf16>>(Arc::new(NcclReduce(shared.clone())))
        .with_reduce::<CudaMoe<burn::tensor::f16>>(Arc::new(NcclReduce(shared.clone()))))
}

/// The gradient buckets' all-reduce (`ncclAllReduce`) and the shadowed experts' broadcast
/// (`ncclBroadcast`) on device pointers, out of place into a fresh cubecl buffer: the input
/// may share its buffer with other tensors. Ordered with cubecl's streams as the rows are
/// (module docs).
#[derive(Debug, Clone)]
pub(crate) struct NcclReduce(pub(crate) Arc<NcclShared>);

impl<F: FloatElement> TensorReduce<CudaMoe<F>> for NcclReduce {
    fn all_reduce_sum(
        &self,
        comm: &dyn Communicator,
        x: CubeTensor<CudaRuntime>,
    ) -> Result<CubeTensor<CudaRuntime>> {
        self.collective(comm, x, "all_reduce_tensor", None)
    }

    /// `ncclBroadcast` from the root's buffer into a fresh buffer on every rank.
    fn broadcast(
        &self,
        comm: &dyn Communicator,
        x: CubeTensor<CudaRuntime>,
        root: usize,
    ) -> Result<CubeTensor<CudaRuntime>> {
        self.collective(comm, x, "broadcast_tensor", Some(root))
    }
}

impl NcclReduce {
    /// One NCCL collective on `x`'s device buffer into a fresh one of its shape and dtype: the
    /// sum over the group (`root` `None`) or rank `root`'s `x` on every rank.
    fn collective(
        &self,
        comm: &dyn Communicator,
        x: CubeTensor<CudaRuntime>,
        op: &str,
        root: Option<usize>,
    ) -> Result<CubeTensor<CudaRuntime>> {
        let err = |reason: String| MoeError::comm(op, self.0.rank, reason);
        if comm.rank() != self.0.rank {
            return Err(err(format!("called through rank {}'s communicator", comm.rank())));
        }
        if let Some(root) = root.filter(|&r| r >= comm.n_ranks()) {
            return Err(err(format!("root {root} is not a rank of {}", comm.n_ranks())));
        }
        let x = burn_cubecl::kernel::into_contiguous(x);
        let dtype: DType = x.dtype;
        let nccl_type = match dtype {
            DType::F32 => nccl_sys::ncclDataType_t::ncclFloat32,
            DType::BF16 => nccl_sys::ncclDataType_t::ncclBfloat16,
            DType::F16 => nccl_sys::ncclDataType_t::ncclFloat16,
            other => return Err(err(format!("no NCCL collective for {other:?}"))),
        };
        let count = x.meta.shape().num_elements();
        if count == 0 {
            return Ok(x);
        }
        let client = x.client.clone();
        let out = client.empty(count * dtype.size());
        let device_err = |what: &str, e: &dyn std::fmt::Debug| err(format!("cubecl {what}: {e:?}"));
        let src = client
            .get_resource(x.handle.clone())
            .map_err(|e| device_err("resource of the input", &e))?;
        let dst = client
            .get_resource(out.clone())
            .map_err(|e| device_err("resource of the output", &e))?;
        cubecl::future::block_on(client.sync()).map_err(|e| device_err("sync", &e))?;
        self.0.collective_device(
            op,
            (src.resource().ptr, dst.resource().ptr),
            count,
            nccl_type,
            root,
        )?;
        drop((src, dst));
        Ok(CubeTensor::new_contiguous(
            client,
            x.device.clone(),
            x.meta.shape().clone(),
            out,
            dtype,
        ))
    }
}

impl NcclRows {
    fn err(&self, reason: impl Into<String>) -> MoeError {
        MoeError::comm("all_to_all_rows", self.0.rank, reason)
    }

    fn exchange(
        &self,
        x: CubeTensor<CudaRuntime>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<CubeTensor<CudaRuntime>> {
        let x = burn_cubecl::kernel::into_contiguous(x);
        let [rows, width] = matrix_dims(&x, |why| self.err(why))?;
        let dtype: DType = x.dtype;
        let row_bytes = width * dtype.size();
        let layout = PeerLayout::new(send_rows, recv_rows, row_bytes)?;
        if layout.n_ranks() != self.0.world {
            return Err(self.err(format!(
                "counts for {} ranks in a group of {}",
                layout.n_ranks(),
                self.0.world
            )));
        }
        // The bytes in use, not the whole buffer: a view (a slice of a larger tensor) holds a
        // handle to all of it, so `size()` would let a view of too few rows through.
        let used = usize::try_from(x.handle.size_in_used()).unwrap_or(usize::MAX);
        if layout.send_bytes() != rows * row_bytes || used < layout.send_bytes() {
            return Err(self.err(format!(
                "send counts {send_rows:?} do not describe a [{rows}, {width}] tensor"
            )));
        }
        let client = x.client.clone();
        // NCCL and cubecl both refuse zero-byte buffers: one byte stands in for an empty side.
        let out = client.empty(layout.recv_bytes().max(1));
        let device_err = |what: &str, e: &dyn std::fmt::Debug| self.err(format!("cubecl {what}: {e:?}"));
        // A rank that sends nothing posts nothing from its send buffer, so an empty tensor's
        // buffer (which cubecl may not back with memory) is never resolved.
        let src = match layout.send_bytes() {
            0 => None,
            _ => Some(
                client
                    .get_resource(x.handle.clone())
                    .map_err(|e| device_err("resource of the rows", &e))?,
            ),
        };
        let dst = client
            .get_resource(out.clone())
            .map_err(|e| device_err("resource of the output", &e))?;
        cubecl::future::block_on(client.sync()).map_err(|e| device_err("sync", &e))?;
        let src_ptr = src.as_ref().map_or(0, |r| r.resource().ptr);
        self.0
            .all_to_all_device("all_to_all_rows", src_ptr, dst.resource().ptr, &layout)?;
        drop((src, dst));
        let total = recv_rows.iter().sum::<usize>();
        Ok(CubeTensor::new_contiguous(
            client,
            x.device.clone(),
            Shape::new([total, width]),
            out,
            dtype,
        ))
    }
}

/// `x`'s `[rows, width]`, or the error `err` makes of a message naming its shape.
pub(crate) fn matrix_dims(
    x: &CubeTensor<CudaRuntime>,
    err: impl FnOnce(String) -> MoeError,
) -> Result<[usize; 2]> {
    match x.meta.shape()[..] {
        [rows, width] => Ok([rows, width]),
        ref dims => Err(err(format!("rows must be a matrix, got shape {dims:?}"))),
    }
}

impl<F: FloatElement> RowExchange<CudaMoe<F>> for NcclRows {
    fn all_to_all(
        &self,
        comm: &dyn Communicator,
        x: CubeTensor<CudaRuntime>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<CubeTensor<CudaRuntime>> {
        if comm.rank() != self.0.rank {
            return Err(self.err(format!("called through rank {}'s communicator", comm.rank())));
        }
        self.exchange(x, send_rows, recv_rows)
    }
}
