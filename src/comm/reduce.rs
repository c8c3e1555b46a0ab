//! The all-reduce and the broadcast of a float tensor on a given backend: how replicated
//! gradients are summed over the ranks (`crate::parallel::sync_replicated_grads`), and how a
//! shadowed expert's weights reach every rank.
//!
//! As with the rows' all-to-all ([`RowExchange`](super::RowExchange)), a communicator may offer
//! a path of its own per backend type in its [`RowPaths`] (NCCL's `ncclAllReduce` on the
//! tensor's device buffer); without one, the tensor goes through [`HostReduce`]: one copy to
//! the host in its own dtype, summed in f32 by
//! [`Communicator::all_reduce_sum_f32`], one copy back.

use std::fmt;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use super::{Communicator, RowPaths};
use crate::error::{MoeError, Result};

/// The sum over all ranks of a float tensor on backend `B`.
pub trait TensorReduce<B: Backend>: Send + Sync + fmt::Debug {
    /// Returns the element-wise sum of `x` over the ranks of `comm`, in `x`'s dtype, on every
    /// rank. Every rank must pass a tensor of the same shape and dtype.
    fn all_reduce_sum(&self, comm: &dyn Communicator, x: FloatTensor<B>) -> Result<FloatTensor<B>>;

    /// Returns rank `root`'s `x` on every rank, in `x`'s dtype. Every rank must pass a tensor
    /// of the same shape and dtype (what a rank other than the root passes is not read). The
    /// default is the host path: the root's values through
    /// [`Communicator::broadcast_f32`], written back in the dtype on every rank.
    fn broadcast(&self, comm: &dyn Communicator, x: FloatTensor<B>, root: usize) -> Result<FloatTensor<B>> {
        host_broadcast::<B>(comm, x, root)
    }
}

/// A tensor's values on the host as f32, with what writing them back needs.
struct HostValues<B: Backend> {
    values: Vec<f32>,
    device: B::Device,
    dtype: DType,
    shape: Vec<usize>,
}

impl<B: Backend> HostValues<B> {
    /// `x` read to the host; `what` names it in the error.
    fn read(x: FloatTensor<B>, what: &str) -> Result<Self> {
        let device = B::float_device(&x);
        let data = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(x)).into_data();
        let dtype = data.dtype;
        let shape = data.shape.to_vec();
        let values: Vec<f32> = match dtype {
            // The common case reads the bytes as they are, without a conversion pass.
            DType::F32 => data.into_vec::<f32>(),
            _ => data.convert::<f32>().into_vec::<f32>(),
        }
        .map_err(|e| MoeError::Backend(format!("{what} of dtype {dtype:?} as f32: {e:?}")))?;
        Ok(Self {
            values,
            device,
            dtype,
            shape,
        })
    }

    /// Room for values shaped like `x`, in its dtype and on its device, without reading it.
    fn receiver(x: &FloatTensor<B>) -> Self {
        let shape = x.shape().to_vec();
        Self {
            values: vec![0.0; shape.iter().product()],
            device: B::float_device(x),
            dtype: x.dtype(),
            shape,
        }
    }

    /// The values written back in the tensor's dtype, on its device.
    fn write(self) -> FloatTensor<B> {
        B::float_from_data(
            TensorData::new(self.values, self.shape).convert_dtype(self.dtype),
            &self.device,
        )
    }
}

fn host_broadcast<B: Backend>(
    comm: &dyn Communicator,
    x: FloatTensor<B>,
    root: usize,
) -> Result<FloatTensor<B>> {
    if comm.n_ranks() == 1 && root == 0 {
        return Ok(x);
    }
    // Only the root's values travel: the others' are a buffer to receive into (a fresh
    // allocation, not a read of a tensor the broadcast then overwrites).
    let mut host = if comm.rank() == root {
        HostValues::<B>::read(x, "broadcast tensor")?
    } else {
        HostValues::<B>::receiver(&x)
    };
    comm.broadcast_f32(root, &mut host.values)?;
    Ok(host.write())
}

/// The host twin of a device [`TensorReduce`]: the tensor is read to the host, summed in f32
/// through [`Communicator::all_reduce_sum_f32`] (bitwise identical on every rank) and written
/// back in its dtype. It serves every backend and every communicator.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostReduce;

impl<B: Backend> TensorReduce<B> for HostReduce {
    fn all_reduce_sum(&self, comm: &dyn Communicator, x: FloatTensor<B>) -> Result<FloatTensor<B>> {
        if comm.n_ranks() == 1 {
            return Ok(x);
        }
        let mut host = HostValues::<B>::read(x, "gradient bucket")?;
        comm.all_reduce_sum_f32(&mut host.values)?;
        Ok(host.write())
    }
}

impl RowPaths {
    /// Adds the all-reduce path for backend `B` (replacing an earlier one for the same
    /// backend).
    pub fn with_reduce<B: Backend>(self, path: Arc<dyn TensorReduce<B>>) -> Self {
        self.insert(path)
    }

    /// The all-reduce path for backend `B`, if there is one.
    pub fn reduce<B: Backend>(&self) -> Option<Arc<dyn TensorReduce<B>>> {
        self.find()
    }
}

/// Rank `root`'s `x` on every rank of `comm`: the communicator's path for `B` where it has one
/// (NCCL's broadcast on CUDA), the host path otherwise.
///
/// # Shapes
/// - x: any, the same on every rank; returns that shape
pub fn broadcast_tensor<B: Backend>(
    comm: &dyn Communicator,
    x: FloatTensor<B>,
    root: usize,
) -> Result<FloatTensor<B>> {
    match comm.row_paths().and_then(RowPaths::reduce::<B>) {
        Some(path) => path.broadcast(comm, x, root),
        None => host_broadcast::<B>(comm, x, root),
    }
}

/// The sum of `x` over the ranks of `comm`: the communicator's path for `B` where it has one,
/// the host path otherwise. What [`MoeBackend::all_reduce_sum`](crate::MoeBackend::all_reduce_sum)
/// does by default.
///
/// # Shapes
/// - x: `[n]` → `[n]`
pub fn all_reduce_tensor<B: Backend>(comm: &dyn Communicator, x: FloatTensor<B>) -> Result<FloatTensor<B>> {
    match comm.row_paths().and_then(RowPaths::reduce::<B>) {
        Some(path) => path.all_reduce_sum(comm, x),
        None => TensorReduce::<B>::all_reduce_sum(&HostReduce, comm, x),
    }
}
