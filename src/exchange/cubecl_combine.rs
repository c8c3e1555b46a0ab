//! Step 6's combine on the CubeCL backends: each target row the sum of its rows, one thread
//! per output element (`exchange/row_moves.rs` says why burn's `select_assign` is not used).
//!
//! A thread reads its target's rows through the map's compressed inverse (`offsets`,
//! `order`) in ascending row order and adds them onto zero, so the result has the bits of
//! the sequential `select_assign` onto zeros and no atomics are needed: every output element
//! is written once, by one thread.

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use crate::cubecl_launch::{grid, kernel_float, output, upload_u32};
use crate::dispatch::RowMap;

#[cube(launch_unchecked)]
fn combine_kernel<F: Float>(
    rows: &Tensor<F>,
    offsets: &Array<u32>,
    order: &Array<u32>,
    out: &mut Tensor<F>,
    width: usize,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= out.len() {
        terminate!();
    }
    let t = ABSOLUTE_POS / width;
    let c = ABSOLUTE_POS % width;
    let start = offsets[t] as usize;
    let end = offsets[t + 1] as usize;
    let mut acc = F::new(0.0);
    for j in start..end {
        let r = order[j] as usize;
        acc += rows[r * rows.stride(0) + c * rows.stride(1)];
    }
    out[ABSOLUTE_POS] = acc;
}

/// The combine of `rows` onto `map.n_targets()` rows in one kernel; `None` where the kernel
/// does not read the tensors (another dtype, another rank, an index past `u32`), and the
/// caller composes it then.
///
/// # Shapes
/// - rows: `[n_rows, width]` → `[n_targets, width]`
pub(crate) fn combine<R: CubeRuntime>(rows: &CubeTensor<R>, map: &RowMap) -> Option<CubeTensor<R>> {
    let [n_rows, width] = <[usize; 2]>::try_from(rows.meta.shape().to_vec()).ok()?;
    if !kernel_float(rows) || n_rows != map.n_rows() {
        return None;
    }
    let units = map.n_targets() * width;
    if units == 0 || n_rows == 0 {
        // Nothing to launch over (CUDA refuses an empty grid); the caller's zeros are exact.
        return None;
    }
    let offsets = upload_u32(rows, map.offsets())?;
    let order = upload_u32(rows, map.order())?;
    let out = output(rows, [map.n_targets(), width]);
    let (count, dim) = grid(rows, units);
    // SAFETY: `offsets` has `n_targets + 1` entries and `order` `n_rows`, every entry of
    // `order` a row of `rows` and every offset within `order` (RowMap builds them so); the
    // kernel bounds its index by `out`'s `n_targets · width` elements.
    unsafe {
        combine_kernel::launch_unchecked(
            &rows.client,
            count,
            dim,
            rows.clone().into_tensor_arg(),
            ArrayArg::from_raw_parts(offsets, map.n_targets() + 1),
            ArrayArg::from_raw_parts(order, map.n_rows()),
            out.clone().into_tensor_arg(),
            width,
            rows.dtype.into(),
        )
    };
    Some(out)
}
