//! SwiGLU (plain and GPT-OSS's clamped form) and its derivative for the Flex backend,
//! vectorised and on every core.
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

use super::activation::{
    clamped_swiglu_backward_composed, clamped_swiglu_composed, swiglu_backward_composed, swiglu_composed,
};
use super::swiglu_math::{self, Clamped, Gate, Plain};

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
    forward(z, Plain, swiglu_composed::<Flex>)
}

/// GPT-OSS's clamped SwiGLU of `z = [gate | up]` (the composed form where the layout is not
/// one this kernel reads).
///
/// # Shapes
/// - z: `[n_rows, 2 · d_hidden]`; returns `[n_rows, d_hidden]`
pub(crate) fn clamped_swiglu(z: FlexTensor, alpha: f32, limit: f32) -> FlexTensor {
    forward(z, Clamped { alpha, limit }, |z| {
        clamped_swiglu_composed::<Flex>(z, alpha, limit)
    })
}

/// `d (silu(gate) · up) / dz · grad` (the composed form where a layout is not one this kernel
/// reads).
///
/// # Shapes
/// - z: `[n_rows, 2 · d_hidden]`; grad: `[n_rows, d_hidden]`; returns `[n_rows, 2 · d_hidden]`
pub(crate) fn swiglu_backward(z: FlexTensor, grad: FlexTensor) -> FlexTensor {
    backward(z, grad, Plain, swiglu_backward_composed::<Flex>)
}

/// The clamped SwiGLU's derivative (the composed form where a layout is not one this kernel
/// reads).
///
/// # Shapes
/// - z: `[n_rows, 2 · d_hidden]`; grad: `[n_rows, d_hidden]`; returns `[n_rows, 2 · d_hidden]`
pub(crate) fn clamped_swiglu_backward(z: FlexTensor, grad: FlexTensor, alpha: f32, limit: f32) -> FlexTensor {
    backward(z, grad, Clamped { alpha, limit }, |z, grad| {
        clamped_swiglu_backward_composed::<Flex>(z, grad, alpha, limit)
    })
}

/// The gated activation `form` of `z`, or `composed(z)` where the layout is not one the row
/// kernels read.
fn forward<G: Gate>(z: FlexTensor, form: G, composed: impl FnOnce(FlexTensor) -> FlexTensor) -> FlexTensor {
    let Some((src, rows, inner)) = contiguous_rows(&z).filter(|(_, _, inner)| inner % 2 == 0) else {
        return composed(z);
    };
    let h = inner / 2;
    let mut out = vec![0.0f32; rows * h];
    let task = rows_per_task(inner);
    match rows <= task {
        // One task's rows (a decode step's): on this thread, without rayon's split.
        true => swiglu_math::forward_rows(src, &mut out, h, form),
        false => out
            .par_chunks_mut(task * h)
            .zip(src.par_chunks(task * inner))
            .for_each(|(out, z)| swiglu_math::forward_rows(z, out, h, form)),
    }
    FlexTensor::from_data(TensorData::new(out, Shape::new([rows, h])))
}

/// The derivative of the gated activation `form`, or `composed(z, grad)` where a layout is not
/// one the row kernels read.
fn backward<G: Gate>(
    z: FlexTensor,
    grad: FlexTensor,
    form: G,
    composed: impl FnOnce(FlexTensor, FlexTensor) -> FlexTensor,
) -> FlexTensor {
    let ((x, rows, inner), (g, _, h)) = match (contiguous_rows(&z), contiguous_rows(&grad)) {
        (Some(z), Some(g)) if z.2 % 2 == 0 && g.1 == z.1 && g.2 * 2 == z.2 => (z, g),
        _ => return composed(z, grad),
    };
    let mut dz = vec![0.0f32; rows * inner];
    let task = rows_per_task(inner);
    dz.par_chunks_mut(task * inner)
        .zip(x.par_chunks(task * inner))
        .zip(g.par_chunks(task * h))
        .for_each(|((dz, z), g)| swiglu_math::backward_rows(z, g, dz, h, form));
    FlexTensor::from_data(TensorData::new(dz, Shape::new([rows, inner])))
}
