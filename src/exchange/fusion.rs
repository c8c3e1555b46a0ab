//! `MoeBackend` for `Fusion<B>`: burn's default GPU backends (`burn::backend::Wgpu` and
//! `Cuda` with burn's default features are `Fusion<CubeBackend<..>>`).
//!
//! The exchange is a wall for fusion: it talks to other ranks, runs on worker threads with
//! device streams of their own and builds its partitions in an arena of the inner backend's
//! buffers. None of that can be expressed as fusion's lazy operation stream, so the op
//! resolves its inputs to the inner backend's tensors at the boundary (fusion executes every
//! queued operation that produces them first), runs the inner backend's exchange, and
//! registers its outputs as new fusion tensors. Everything before and after it (router,
//! gating, the combine's weighting, the shared experts, the optimizer) stays fusable.
//!
//! Streams: fusion runs a thread's operations under that thread's cubecl stream id
//! (`burn-fusion` `op.rs`, `UnfusedOp::execute` calls `stream_id.executes`; the device
//! thread takes the caller's id in `cubecl-common` `device/handle/channel.rs`,
//! `submit_blocking`). So a resolved tensor lives on the caller's stream, as it would on the
//! raw backend, and the outputs the inner exchange allocates on the caller's stream are
//! registered on that same stream: the rule of `exchange/streams.rs` holds unchanged.

use std::sync::Arc;

use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;
use burn_fusion::stream::OperationStreams;
use burn_fusion::{get_client, Fusion, FusionBackend, NoOp};
use burn_ir::{InitOperationIr, OperationIr, OperationOutput};

use super::executor::StepExecutor;
use super::streams::WorkerStreams;
use super::{ExchangeGrads, ExchangeRun, MoeBackend};
use crate::comm::Communicator;
use crate::dispatch::{CombineMap, ExchangePlan, RowMap};
use crate::error::Result;
use crate::experts::ExpertTensors;

/// The inner backend's tensor behind a fusion tensor, after fusion has executed every queued
/// operation of the stream that produces it. A tensor fusion still holds elsewhere (a
/// parameter) is shared, not copied: cubecl writes in place only to a buffer it holds alone.
pub(crate) fn resolve<B: FusionBackend>(tensor: FloatTensor<Fusion<B>>) -> FloatTensor<B> {
    let client = tensor.client.clone();
    client.resolve_tensor_float::<B>(tensor)
}

/// An inner tensor registered with fusion as a new tensor on the calling thread's stream, as
/// `Fusion::float_from_data` registers the tensors it creates.
pub(crate) fn register<B: FusionBackend>(
    tensor: FloatTensor<B>,
    device: &B::Device,
) -> FloatTensor<Fusion<B>> {
    let client = get_client::<B>(device);
    let shape = tensor.shape();
    let dtype = tensor.dtype();
    let handle = B::float_tensor_handle(tensor);
    let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            OperationStreams::default(),
            OperationIr::Init(desc),
            NoOp::<B>::new(),
        )
        .output()
}

impl<B: FusionBackend + MoeBackend> MoeBackend for Fusion<B> {
    type Saved = B::Saved;

    fn exchange_forward(
        input: FloatTensor<Self>,
        experts: ExpertTensors<Self>,
        plan: &ExchangePlan,
        run: &ExchangeRun,
    ) -> Result<(FloatTensor<Self>, Self::Saved)> {
        let device = input.client.device().clone();
        let (out, saved) = B::exchange_forward(resolve::<B>(input), experts.map(resolve::<B>), plan, run)?;
        Ok((register::<B>(out, &device), saved))
    }

    fn experts_forward(
        input: FloatTensor<Self>,
        experts: ExpertTensors<Self>,
        rows_per_expert: &[usize],
        run: &ExchangeRun,
    ) -> Result<FloatTensor<Self>> {
        let device = input.client.device().clone();
        let out = B::experts_forward(
            resolve::<B>(input),
            experts.map(resolve::<B>),
            rows_per_expert,
            run,
        )?;
        Ok(register::<B>(out, &device))
    }

    fn exchange_backward(
        grad_out: FloatTensor<Self>,
        saved: Self::Saved,
        plan: &ExchangePlan,
        run: &ExchangeRun,
    ) -> Result<ExchangeGrads<Self>> {
        let device = grad_out.client.device().clone();
        let grads = B::exchange_backward(resolve::<B>(grad_out), saved, plan, run)?;
        Ok(ExchangeGrads {
            input: register::<B>(grads.input, &device),
            experts: grads.experts.map(|t| register::<B>(t, &device)),
        })
    }

    fn step_executor(device: &Self::Device) -> StepExecutor {
        B::step_executor(device)
    }

    fn worker_streams(device: &Self::Device) -> Box<dyn WorkerStreams> {
        B::worker_streams(device)
    }

    fn dense_library(comm: &dyn Communicator) -> bool {
        B::dense_library(comm)
    }

    fn expert_route(
        comm: &dyn Communicator,
        own: bool,
        precision: crate::GemmPrecision,
    ) -> crate::memory::ExpertRoute {
        B::expert_route(comm, own, precision)
    }

    /// On the inner backend where the communicator offers a library for it (paths are found by
    /// backend type); fusion's own matmul, which stays fusable, otherwise.
    fn dense_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        comm: &Arc<dyn Communicator>,
        precision: super::GemmPrecision,
    ) -> Result<FloatTensor<Self>> {
        use burn::tensor::ops::FloatTensorOps;
        if !B::dense_library(comm.as_ref()) {
            return Ok(Self::float_matmul(lhs, rhs));
        }
        let device = lhs.client.device().clone();
        let out = B::dense_matmul(resolve::<B>(lhs), resolve::<B>(rhs), comm, precision)?;
        Ok(register::<B>(out, &device))
    }

    /// On the inner backend where the communicator offers a library for it; fusion's own
    /// per-head product otherwise.
    fn dense_heads_matmul(
        lhs: FloatTensor<Self>,
        rhs: FloatTensor<Self>,
        comm: &Arc<dyn Communicator>,
        precision: super::GemmPrecision,
    ) -> Result<FloatTensor<Self>> {
        if !B::dense_library(comm.as_ref()) {
            return Ok(Self::heads_matmul(lhs, rhs));
        }
        let device = lhs.client.device().clone();
        let out = B::dense_heads_matmul(resolve::<B>(lhs), resolve::<B>(rhs), comm, precision)?;
        Ok(register::<B>(out, &device))
    }

    /// On the inner backend in one call where the communicator offers a library for it;
    /// fusion's own matmuls otherwise.
    fn dense_matmuls(
        pairs: Vec<(FloatTensor<Self>, FloatTensor<Self>)>,
        comm: &Arc<dyn Communicator>,
        precision: super::GemmPrecision,
    ) -> Result<Vec<FloatTensor<Self>>> {
        use burn::tensor::ops::FloatTensorOps;
        if !B::dense_library(comm.as_ref()) {
            return Ok(pairs
                .into_iter()
                .map(|(lhs, rhs)| Self::float_matmul(lhs, rhs))
                .collect());
        }
        let Some(device) = pairs.first().map(|(lhs, _)| lhs.client.device().clone()) else {
            return Ok(Vec::new());
        };
        let inner = pairs
            .into_iter()
            .map(|(lhs, rhs)| (resolve::<B>(lhs), resolve::<B>(rhs)))
            .collect();
        Ok(B::dense_matmuls(inner, comm, precision)?
            .into_iter()
            .map(|out| register::<B>(out, &device))
            .collect())
    }

    /// On the inner backend, whose combine kernel fusion cannot express; the gather with it,
    /// so that each is the other's backward on the same backend.
    fn gather_rows(x: FloatTensor<Self>, map: &Arc<RowMap>) -> FloatTensor<Self> {
        let device = x.client.device().clone();
        register::<B>(B::gather_rows(resolve::<B>(x), map), &device)
    }

    /// On the inner backend (see `gather_rows`).
    fn combine_rows(rows: FloatTensor<Self>, map: &Arc<RowMap>) -> FloatTensor<Self> {
        let device = rows.client.device().clone();
        register::<B>(B::combine_rows(resolve::<B>(rows), map), &device)
    }

    /// On the inner backend, whose kernel fusion cannot express either (see `gather_rows`).
    fn combine_weighted(
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        map: &Arc<CombineMap>,
    ) -> FloatTensor<Self> {
        let device = rows.client.device().clone();
        let out = B::combine_weighted(resolve::<B>(rows), resolve::<B>(weights), map);
        register::<B>(out, &device)
    }

    /// On the inner backend (see `combine_weighted`).
    fn combine_weighted_backward(
        grad: FloatTensor<Self>,
        rows: FloatTensor<Self>,
        weights: FloatTensor<Self>,
        map: &Arc<CombineMap>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let device = grad.client.device().clone();
        let (d_rows, d_weights) =
            B::combine_weighted_backward(resolve::<B>(grad), resolve::<B>(rows), resolve::<B>(weights), map);
        (register::<B>(d_rows, &device), register::<B>(d_weights, &device))
    }

    /// The reference twin's all-to-all, on the inner backend's rows (the device path where the
    /// communicator has one).
    fn all_to_all(
        x: FloatTensor<Self>,
        send_per_rank: &[usize],
        recv_per_rank: &[usize],
        comm: &Arc<dyn Communicator>,
    ) -> Result<FloatTensor<Self>> {
        let device = x.client.device().clone();
        let rows = B::all_to_all(resolve::<B>(x), send_per_rank, recv_per_rank, comm)?;
        Ok(register::<B>(rows, &device))
    }

    /// The bucket on the inner backend, so that the communicator's path for it (NCCL on
    /// CUDA) is found: paths are registered per backend type, and `Fusion<B>` is another type.
    fn all_reduce_sum(x: FloatTensor<Self>, comm: &dyn Communicator) -> Result<FloatTensor<Self>> {
        let device = x.client.device().clone();
        let sum = B::all_reduce_sum(resolve::<B>(x), comm)?;
        Ok(register::<B>(sum, &device))
    }

    /// The inner backend's, for the same reason as the all-reduce.
    fn has_device_reduce(comm: &dyn Communicator) -> bool {
        B::has_device_reduce(comm)
    }

    /// On the inner backend, for the same reason as the all-reduce.
    fn broadcast(
        x: FloatTensor<Self>,
        root: usize,
        comm: &Arc<dyn Communicator>,
    ) -> Result<FloatTensor<Self>> {
        let device = x.client.device().clone();
        let out = B::broadcast(resolve::<B>(x), root, comm)?;
        Ok(register::<B>(out, &device))
    }
}
