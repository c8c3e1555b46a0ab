//! Writing a block of rows (or of entries along any dimension) into a Flex tensor in place.
//!
//! Flex's `slice_assign` copies the whole destination before writing (it goes through
//! `to_contiguous` and a copy-on-write of the storage), so assembling `T_O` from `n`
//! partitions that way copied the full-size tensor `n` times and held two of them at once:
//! 48 MiB extra per partition at 16k GPT3-S tokens, measured. When the destination is `f32`,
//! contiguous from offset 0 and owned alone, the rows are copied straight into it.

use burn::backend::flex::{Flex, FlexTensor, Layout};
use burn::tensor::{DType, Shape};

use super::assemble::{slice_assign_along, slice_assign_rows};

/// `dst[start..start + len] = rows`, in place where `dst` can be written directly.
///
/// # Shapes
/// - dst: `[n_rows, width]`, rows: `[len, width]`; returns `[n_rows, width]`
pub(crate) fn assign_rows(mut dst: FlexTensor, start: usize, rows: FlexTensor) -> FlexTensor {
    let dims = dst.layout().shape().to_vec();
    let width = dims[1];
    let len = rows.layout().shape().to_vec()[0];
    let n = dims[0] * width;
    let direct = dst.dtype() == DType::F32
        && rows.dtype() == DType::F32
        && start + len <= dims[0]
        && dst.layout().contiguous_offsets() == Some((0, n));
    if direct {
        // A row block of a larger tensor is contiguous at an offset: no copy needed.
        if let Some((a, b)) = rows.layout().contiguous_offsets() {
            let src = &rows.storage::<f32>()[a..b];
            if let Some(dst_rows) = dst.try_storage_mut::<f32>() {
                dst_rows[start * width..(start + len) * width].copy_from_slice(src);
                return dst;
            }
        }
    }
    slice_assign_rows::<Flex>(dst, start, rows)
}

/// `dst[.., start..start + len, ..] = value` along dimension `dim`, in place where `dst` is
/// `f32`, contiguous from offset 0, spans its whole storage and is owned alone, and `value` is
/// `f32`; otherwise (and for shapes that do not fit) as burn's `slice_assign`
/// ([`slice_assign_along`]), which copies `dst`.
///
/// # Shapes
/// - dst: `[.., n, ..]`, value: the same dims but `len` at `dim`; returns `dst`'s shape
pub(crate) fn assign_along(mut dst: FlexTensor, dim: usize, start: usize, value: FlexTensor) -> FlexTensor {
    let dims = dst.layout().shape().to_vec();
    let value_dims = value.layout().shape().to_vec();
    let fits = dims.len() == value_dims.len()
        && dim < dims.len()
        && (0..dims.len()).all(|i| i == dim || dims[i] == value_dims[i])
        && start + value_dims[dim] <= dims[dim];
    let n: usize = dims.iter().product();
    let direct = fits
        && dst.dtype() == DType::F32
        && value.dtype() == DType::F32
        && dst.layout().contiguous_offsets() == Some((0, n))
        && dst.bytes().len() == n * 4;
    if direct {
        // Blocks: every index before `dim` (`outer`) holds a run of `dims[dim] · inner` values
        // in `dst` and of `len · inner` in `value`.
        let inner: usize = dims[dim + 1..].iter().product();
        let outer: usize = dims[..dim].iter().product();
        let (dst_block, value_block) = (dims[dim] * inner, value_dims[dim] * inner);
        let value = value.to_contiguous();
        let (a, _) = value.layout().contiguous_offsets().expect("a contiguous copy");
        let src = &value.storage::<f32>()[a..a + outer * value_block];
        if let Some(out) = dst.try_storage_mut::<f32>() {
            for (o, block) in src.chunks_exact(value_block.max(1)).enumerate().take(outer) {
                let at = o * dst_block + start * inner;
                out[at..at + value_block].copy_from_slice(block);
            }
            return dst;
        }
    }
    slice_assign_along::<Flex>(dst, dim, start, value)
}

/// Expert `e`'s `[rows, cols]` matrix of a stacked `[n_experts, rows, cols]` weight, as a view
/// that shares the weight's storage (see [`MoeBackend::expert_matrix`](super::MoeBackend::expert_matrix)).
///
/// # Shapes
/// - w: `[n_experts, rows, cols]` → `[rows, cols]`
pub(crate) fn expert_matrix(w: &FlexTensor, e: usize) -> FlexTensor {
    let layout = w.layout();
    let dims = layout.shape().to_vec();
    let strides = layout.strides();
    assert!(
        dims.len() == 3 && e < dims[0],
        "expert {e} of a stacked weight of shape {dims:?}"
    );
    // The view's first element: `e` steps along the expert axis from the weight's own start.
    // With a flipped expert axis (negative stride) it lies before the start, still inside
    // the storage.
    let start = layout.start_offset() as isize + e as isize * strides[0];
    let view = Layout::new(
        Shape::new([dims[1], dims[2]]),
        vec![strides[1], strides[2]],
        start as usize,
    );
    w.clone().with_layout(view)
}

/// Values per rayon task of [`zeros`]: a few hundred KiB, so that a stacked gradient's zeros
/// split over every thread of the pool.
const ZEROS_PER_TASK: usize = 1 << 16;

/// `n` zeros written over the pool. Under the kept heap (`mpipemoe::heap`) freed memory is
/// reused, so `vec![0.0; n]` (`calloc`) zeroes a stacked gradient sum on the calling thread:
/// 150 MB a layer and step in the 163 M Qwen3-MoE's fine-tuning, with the pool's other thread
/// idle (`perf`: about 29 ms of a 1.2 s step).
pub(crate) fn zeros(n: usize) -> Vec<f32> {
    use rayon::prelude::*;

    let mut values: Vec<f32> = Vec::with_capacity(n);
    values.spare_capacity_mut()[..n]
        .par_chunks_mut(ZEROS_PER_TASK)
        .for_each(|chunk| {
            for v in chunk {
                v.write(0.0);
            }
        });
    // SAFETY: the tasks above wrote each of the `n` values.
    unsafe { values.set_len(n) };
    values
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::{Flex, FlexTensor};
    use burn::tensor::{Tensor, TensorData, TensorPrimitive};

    use super::{assign_along, slice_assign_along};

    fn tensor(dims: [usize; 4], first: f32) -> FlexTensor {
        let n = dims.iter().product::<usize>();
        let values: Vec<f32> = (0..n).map(|i| first + i as f32).collect();
        FlexTensor::from_data(TensorData::new(values, dims))
    }

    fn values(t: FlexTensor) -> Vec<f32> {
        Tensor::<Flex, 4>::from_primitive(TensorPrimitive::Float(t))
            .into_data()
            .to_vec()
            .unwrap()
    }

    /// Against burn's `slice_assign` (the reference twin) along every dimension, at the start,
    /// the middle and the end, from a contiguous value and from a strided view; in place (the
    /// same storage) where the destination is owned alone, and never into a destination another
    /// tensor shares (which keeps its values).
    #[test]
    fn writes_along_a_dimension_as_slice_assign_does_in_place_when_owned_alone() {
        let dims = [2, 3, 5, 4];
        for dim in 0..4 {
            for start in [0, dims[dim] / 2, dims[dim] - 1] {
                let mut value_dims = dims;
                value_dims[dim] = 1;
                let contiguous = tensor(value_dims, 1000.0);
                // The same values through a transposed view of a transposed copy: strided.
                let strided = {
                    let t = Tensor::<Flex, 4>::from_primitive(TensorPrimitive::Float(contiguous.clone()));
                    let copy = t.swap_dims(2, 3).into_data();
                    Tensor::<Flex, 4>::from_data(copy, &Default::default())
                        .swap_dims(2, 3)
                        .into_primitive()
                        .tensor()
                };
                for value in [contiguous, strided] {
                    let want = values(slice_assign_along::<Flex>(
                        tensor(dims, 0.0),
                        dim,
                        start,
                        value.clone(),
                    ));
                    let dst = tensor(dims, 0.0);
                    let at = dst.storage::<f32>().as_ptr();
                    let got = assign_along(dst, dim, start, value.clone());
                    assert_eq!(
                        got.storage::<f32>().as_ptr(),
                        at,
                        "dim {dim} start {start}: copied"
                    );
                    assert_eq!(values(got), want, "dim {dim} start {start}");
                    // Shared: the other holder keeps its values.
                    let dst = tensor(dims, 0.0);
                    let other = dst.clone();
                    assert_eq!(
                        values(assign_along(dst, dim, start, value)),
                        want,
                        "dim {dim}: shared"
                    );
                    assert_eq!(
                        values(other),
                        values(tensor(dims, 0.0)),
                        "dim {dim}: wrote into a shared storage"
                    );
                }
            }
        }
    }
}
