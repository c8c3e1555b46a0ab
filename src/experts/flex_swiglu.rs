//! SwiGLU and its derivative for the Flex backend, vectorised and on every core.
//!
//! Flex runs its element-wise ops on one thread while its GEMMs use all cores; the composed
//! SwiGLU (a sigmoid with a scalar `expf`, then products, each a new tensor) left the other
//! cores idle for about 15% of a Qwen3-MoE fine-tuning step. These kernels run
//! [`swiglu_math`](super::swiglu_math)'s row kernels in parallel chunks of rows (rayon).
//! Layouts they do not handle (non-`f32`, strided views) take the composed form, so the result never depends on which path ran beyond the sigmoid's last
//! bits.

use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::{DType, Shape, TensorData};
use rayon::prelude::*;

use super::activation::{swiglu_backward_composed, swiglu_composed};
use super::swiglu_math;

/// Elements per rayon task: large enough that scheduling costs nothing next to the kernel.
const MIN_CHUNK: usize = 1 << 13;

/// The tensor's elements in row-major order and its `[rows, cols]`, when it is a contiguous
/// `f32` matrix (an offset is fine: row slices of a larger tensor are).
fn contiguous_rows(t: &FlexTensor) -> Option<(&[f32], usize, usize)> {
    let dims = t.layout().shape().to_vec();
    if t.dtype() != DType::F32 || dims.len() != 2 {
        return None;
    }
    let (start, end) = t.layout().contiguous_offsets()?;
    Some((&t.storage::<f32>()[start..end], dims[0], dims[1]))
}

/// Rows per rayon task for rows of `width` values.
fn rows_per_task(width: usize) -> usize {
    (MIN_CHUNK / width.max(1)).max(1)
}

/// `silu(gate) · up` of `z = [gate | up]` (the composed form where the layout is not one this
/// kernel reads).
///
/// # Shapes
/// - z: `[n_rows, 2 · d_hidden]`; returns `[n_rows, d_hidden]`
pub(crate) fn swiglu(z: FlexTensor) -> FlexTensor {
    let Some((src, rows, inner)) = contiguous_rows(&z).filter(|(_, _, inner)| inner % 2 == 0) else {
        return swiglu_composed::<Flex>(z);
    };
    let h = inner / 2;
    let mut out = vec![0.0f32; rows * h];
    let task = rows_per_task(inner);
    match rows <= task {
        // One task's rows (a decode step's): on this thread, without rayon's split.
        true => swiglu_math::forward_rows(src, &mut out, h),
        false => out
            .par_chunks_mut(task * h)
            .zip(src.par_chunks(task * inner))
            .for_each(|(out, z)| swiglu_math::forward_rows(z, out, h)),
    }
    FlexTensor::from_data(TensorData::new(out, Shape::new([rows, h])))
}

/// `d (silu(gate) · up) / dz · grad` (the composed form where a layout is not one this kernel
/// reads).
///
/// # Shapes
/// - z: `[n_rows, 2 · d_hidden]`; grad: `[n_rows, d_hidden]`; returns `[n_rows, 2 · d_hidden]`
pub(crate) fn swiglu_backward(z: FlexTensor, grad: FlexTensor) -> FlexTensor {
    let ((x, rows, inner), (g, _, h)) = match (contiguous_rows(&z), contiguous_rows(&grad)) {
        (Some(z), Some(g)) if z.2 % 2 == 0 && g.1 == z.1 && g.2 * 2 == z.2 => (z, g),
        _ => return swiglu_backward_composed::<Flex>(z, grad),
    };
    let mut dz = vec![0.0f32; rows * inner];
    let task = rows_per_task(inner);
    dz.par_chunks_mut(task * inner)
        .zip(x.par_chunks(task * inner))
        .zip(g.par_chunks(task * h))
        .for_each(|((dz, z), g)| swiglu_math::backward_rows(z, g, dz, h));
    FlexTensor::from_data(TensorData::new(dz, Shape::new([rows, inner])))
}
