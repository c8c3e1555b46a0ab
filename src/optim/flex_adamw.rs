//! AdamW on Flex in one parallel pass, in place.
//!
//! Flex runs each element-wise op on one thread into a fresh buffer, so the composed update
//! reads and writes the parameter's size about fifteen times. This kernel reads the gradient
//! once and rewrites the parameter and both moments in place, in parallel chunks (rayon, on
//! the calling thread's pool). Each element goes through [`AdamWCoefficients::update`], the
//! composed update's arithmetic in its order, so the two paths agree to the last bits of
//! Flex's scalar division.

use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::{DType, Tensor, TensorPrimitive};
use rayon::prelude::*;

use super::kernels::{adamw_update_composed, AdamWCoefficients, AdamWTensors};

/// Elements per rayon task: large enough that scheduling costs nothing next to the update.
const MIN_CHUNK: usize = 1 << 14;

fn flex<const D: usize>(tensor: Tensor<Flex, D>) -> FlexTensor {
    tensor.into_primitive().tensor()
}

fn tensor<const D: usize>(flex: FlexTensor) -> Tensor<Flex, D> {
    Tensor::from_primitive(TensorPrimitive::Float(flex))
}

/// `t` as a tensor that owns a contiguous `f32` buffer of exactly its elements from offset 0:
/// itself where it already is one (the usual case: a parameter after backward, and the
/// moments this kernel wrote), otherwise a copy.
fn owned(t: FlexTensor) -> FlexTensor {
    let n = t.layout().shape().num_elements();
    let whole = t.layout().contiguous_offsets() == Some((0, n)) && t.storage::<f32>().len() == n;
    if whole && t.is_unique() {
        t
    } else {
        FlexTensor::from_data(t.into_data())
    }
}

/// One AdamW step of one parameter (see [`OptimizerKernels::adamw_update`](super::OptimizerKernels::adamw_update)).
///
/// # Shapes
/// - every tensor: the parameter's shape
pub(crate) fn adamw_update<const D: usize>(
    tensors: AdamWTensors<Flex, D>,
    grad: Tensor<Flex, D>,
    c: &AdamWCoefficients,
) -> AdamWTensors<Flex, D> {
    let shape = tensors.param.shape();
    let f32_only = [&tensors.param, &tensors.moment_1, &tensors.moment_2, &grad]
        .iter()
        .all(|t| t.dtype() == DType::F32 && t.shape() == shape);
    if !f32_only {
        return adamw_update_composed(tensors, grad, c);
    }
    let grad = flex(grad);
    let grad = match grad.layout().contiguous_offsets() {
        Some(_) => grad,
        None => FlexTensor::from_data(grad.into_data()),
    };
    let (start, end) = grad.layout().contiguous_offsets().expect("made contiguous above");
    let g = &grad.storage::<f32>()[start..end];
    let mut param = owned(flex(tensors.param));
    let mut moment_1 = owned(flex(tensors.moment_1));
    let mut moment_2 = owned(flex(tensors.moment_2));
    {
        // `owned` gave each a buffer of its own, so these borrows cannot fail.
        let p = param.try_storage_mut::<f32>().expect("owned buffer");
        let m = moment_1.try_storage_mut::<f32>().expect("owned buffer");
        let v = moment_2.try_storage_mut::<f32>().expect("owned buffer");
        p.par_chunks_mut(MIN_CHUNK)
            .zip(m.par_chunks_mut(MIN_CHUNK))
            .zip(v.par_chunks_mut(MIN_CHUNK))
            .zip(g.par_chunks(MIN_CHUNK))
            .for_each(|(((p, m), v), g)| {
                for (((p, m), v), g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
                    (*p, *m, *v) = c.update(*p, *g, *m, *v);
                }
            });
    }
    AdamWTensors {
        param: tensor(param),
        moment_1: tensor(moment_1),
        moment_2: tensor(moment_2),
    }
}
