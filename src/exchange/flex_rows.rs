//! Writing a block of rows into a Flex tensor in place.
//!
//! Flex's `slice_assign` copies the whole destination before writing (it goes through
//! `to_contiguous` and a copy-on-write of the storage), so assembling `T_O` from `n`
//! partitions that way copied the full-size tensor `n` times and held two of them at once:
//! 48 MiB extra per partition at 16k GPT3-S tokens, measured. When the destination is `f32`,
//! contiguous from offset 0 and owned alone, the rows are copied straight into it.

use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::DType;

use super::assemble::slice_assign_rows;

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
