//! The all-reduce of a float tensor on a given backend: how replicated gradients are summed
//! over the ranks (`crate::parallel::sync_replicated_grads`).
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
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive};

use super::{Communicator, RowPaths};
use crate::error::{MoeError, Result};

/// The sum over all ranks of a float tensor on backend `B`.
pub trait TensorReduce<B: Backend>: Send + Sync + fmt::Debug {
    /// Returns the element-wise sum of `x` over the ranks of `comm`, in `x`'s dtype, on every
    /// rank. Every rank must pass a tensor of the same shape and dtype.
    fn all_reduce_sum(&self, comm: &dyn Communicator, x: FloatTensor<B>) -> Result<FloatTensor<B>>;
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
        let device = B::float_device(&x);
        let data = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(x)).into_data();
        let dtype = data.dtype;
        let shape = data.shape.clone();
        let mut values: Vec<f32> = match dtype {
            // The common case reads the bytes as they are, without a conversion pass.
            DType::F32 => data.into_vec::<f32>(),
            _ => data.convert::<f32>().into_vec::<f32>(),
        }
        .map_err(|e| MoeError::Backend(format!("gradient bucket of dtype {dtype:?} as f32: {e:?}")))?;
        comm.all_reduce_sum_f32(&mut values)?;
        let summed = TensorData::new(values, shape).convert_dtype(dtype);
        Ok(B::float_from_data(summed, &device))
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
