//! The rows' all-to-all through host bytes for ranks without a device path between them
//! (thread ranks on one GPU, `gpu_bench`'s emulated exchange), with the received rows copied
//! to the device from page-locked memory on a copy stream of the rank's own; and the paths a
//! CUDA rank falls back on ([`host_paths`]).
//!
//! Why not the host twin (`mpipemoe::comm::HostRows`): it hands the received rows to burn's
//! `float_from_data`, and cubecl-runtime 0.10's `create` copies whatever bytes it is given into
//! a fresh pageable `Vec` (`client.rs`, `do_create`, line 268:
//! `Bytes::from_bytes_vec(data.to_vec())`), which cubecl-cuda then copies with
//! `cuMemcpyHtoDAsync` on its device thread
//! (`compute/command.rs`, `write_to_gpu`, line 528). From pageable memory that call is not
//! asynchronous: the driver first copies the bytes into staging memory of its own and "may
//! synchronize with the stream" to do so (the CUDA runtime API's "API synchronization
//! behavior", asynchronous copies). cubecl serves every stream of a device from that one
//! thread, so while it copies a partition's rows (megabytes at the paper's shapes) no stream
//! gets a launch, and the compute stream runs dry in the middle of the overlap the pipeline
//! exists for. Here the host all-to-all writes the received rows straight into a pooled
//! page-locked buffer on the calling thread (the exchange's comm worker), which then waits for
//! the DMA itself (`PinnedOffload::upload_with`); cubecl's device thread only hands out the
//! destination. The rows are read to the host as before: cubecl reads into page-locked memory
//! already (`compute/command.rs`, `read_async`, line 195: `copies_to_bytes(descriptors, true)`).

use std::sync::Arc;

use burn::tensor::{Shape, Tensor, TensorPrimitive};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::FloatElement;
use cubecl::cuda::CudaRuntime;
use mpipemoe::comm::{host_all_to_all_v_into, PeerLayout, RowExchange, RowPaths};
use mpipemoe::{Communicator, MoeError, Result};

use crate::offload::{PinnedOffload, PinnedPath};
use crate::rows::matrix_dims;
use crate::CudaMoe;

/// The host-bytes all-to-all of one GPU's ranks, uploading through page-locked memory.
#[derive(Debug, Clone)]
pub(crate) struct PinnedHostRows(pub(crate) Arc<PinnedOffload>);

impl<F: FloatElement> RowExchange<CudaMoe<F>> for PinnedHostRows {
    fn all_to_all(
        &self,
        comm: &dyn Communicator,
        x: CubeTensor<CudaRuntime>,
        send_rows: &[usize],
        recv_rows: &[usize],
    ) -> Result<CubeTensor<CudaRuntime>> {
        let [_, width] = matrix_dims(&x, |why| MoeError::comm("all_to_all_v", comm.rank(), why))?;
        let (client, device, dtype) = (x.client.clone(), x.device.clone(), x.dtype);
        let layout = PeerLayout::new(send_rows, recv_rows, width * dtype.size())?;
        let data = Tensor::<CudaMoe<F>, 2>::from_primitive(TensorPrimitive::Float(x)).into_data();
        let shape = Shape::new([recv_rows.iter().sum::<usize>(), width]);
        // The peers' rows land in the page-locked buffer itself: no receive buffer to zero
        // and copy again (`host_all_to_all_v_into` writes every byte of it).
        self.0.upload_with(&client, &device, shape, dtype, |recv| {
            host_all_to_all_v_into(comm, "all_to_all_v", data.as_bytes(), &layout, recv)
        })
    }
}

/// The paths a rank of GPU `offload`'s context falls back on where its communicator has none
/// of the kind (`RowPaths::absent_from`): the rows' all-to-all through host bytes uploaded from
/// page-locked memory, and the S1–S3 offload to page-locked memory, for the CUDA backend in
/// f32, bf16 and f16. NCCL's ranks have both of their own (`rows.rs`).
pub(crate) fn host_paths(offload: &Arc<PinnedOffload>) -> RowPaths {
    let rows = PinnedHostRows(offload.clone());
    let pinned = PinnedPath(offload.clone());
    RowPaths::new()
        .with::<CudaMoe<f32>>(Arc::new(rows.clone()))
        .with::<CudaMoe<burn::tensor::bf16>>(Arc::new(rows.clone()))
        .with::<CudaMoe<burn::tensor::f16>>(Arc::new(rows))
        .with_offload::<CudaMoe<f32>>(Arc::new(pinned.clone()))
        .with_offload::<CudaMoe<burn::tensor::bf16>>(Arc::new(pinned.clone()))
        .with_offload::<CudaMoe<burn::tensor::f16>>(Arc::new(pinned))
}
