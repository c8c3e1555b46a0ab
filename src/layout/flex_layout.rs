//! [`LayoutKernels::swap_middle_dims`](super::LayoutKernels::swap_middle_dims) on Flex: the
//! swapped tensor written contiguously, one run of the last dimension at a time, over the pool.

use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorData};
use rayon::prelude::*;

/// Values per rayon task: enough that the split costs nothing next to the copy.
const VALUES_PER_TASK: usize = 1 << 14;

/// `x` (`[d0, d1, d2, d3]`, any strides) as a contiguous `[d0, d2, d1, d3]`; other dtypes
/// and ranks as Flex's view.
pub(super) fn swap_middle_dims(x: FlexTensor) -> FlexTensor {
    let dims = x.layout().shape().to_vec();
    if x.dtype() != DType::F32 || dims.len() != 4 || dims.contains(&0) {
        return Flex::float_swap_dims(x, 1, 2);
    }
    let strides = x.layout().strides().to_vec();
    let start = x.layout().start_offset();
    let [d0, d1, d2, d3] = [dims[0], dims[1], dims[2], dims[3]];
    let [s0, s1, s2, s3] = [strides[0], strides[1], strides[2], strides[3]];
    let src = x.storage::<f32>();
    // Where run `(a, j, i)` of the output (row `i` of block `(a, j)`) starts in the input.
    let at = |a: usize, i: usize, j: usize| {
        let offset = start as isize + a as isize * s0 + i as isize * s1 + j as isize * s2;
        offset as usize
    };
    let mut out: Vec<f32> = Vec::with_capacity(d0 * d1 * d2 * d3);
    let block = d1 * d3;
    let blocks_per_task = (VALUES_PER_TASK / block).max(1);
    out.spare_capacity_mut()[..d0 * d2 * block]
        .par_chunks_mut(block * blocks_per_task)
        .enumerate()
        .for_each(|(task, chunk)| {
            for (b, block_out) in chunk.chunks_exact_mut(block).enumerate() {
                let (a, j) = (
                    (task * blocks_per_task + b) / d2,
                    (task * blocks_per_task + b) % d2,
                );
                for (i, run) in block_out.chunks_exact_mut(d3).enumerate() {
                    let from = at(a, i, j);
                    match s3 {
                        1 => {
                            for (o, &v) in run.iter_mut().zip(&src[from..from + d3]) {
                                o.write(v);
                            }
                        }
                        _ => {
                            for (k, o) in run.iter_mut().enumerate() {
                                o.write(src[(from as isize + k as isize * s3) as usize]);
                            }
                        }
                    }
                }
            }
        });
    // SAFETY: the tasks wrote every one of the `d0 · d2 · d1 · d3` values: each block
    // `(a, j)` holds `d1` runs of `d3`, all written above.
    unsafe { out.set_len(d0 * d2 * block) };
    FlexTensor::from_data(TensorData::new(out, Shape::new([d0, d2, d1, d3])))
}
