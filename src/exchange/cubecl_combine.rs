//! Step 6's combine on the CubeCL backends: each target row the sum of its rows, one thread
//! per output element (`exchange/row_moves.rs` says why burn's `select_assign` is not used).
//!
//! A thread reads its target's rows through the map's compressed inverse (`offsets`,
//! `order`) in ascending row order and adds them onto zero, so the result has the bits of
//! the sequential `select_assign` onto zeros and no atomics are needed: every output element
//! is written once, by one thread.

use burn::tensor::DType;
use burn_cubecl::cubecl;
use burn_cubecl::cubecl::calculate_cube_count_elemwise;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::cubecl::server::Handle;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

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

fn upload<R: CubeRuntime>(like: &CubeTensor<R>, values: &[usize]) -> Option<Handle> {
    let values: Vec<u32> = values
        .iter()
        .map(|&v| u32::try_from(v).ok())
        .collect::<Option<_>>()?;
    Some(like.client.create_from_slice(u32::as_bytes(&values)))
}

/// The combine of `rows` onto `map.n_targets()` rows in one kernel; `None` where the kernel
/// does not read the tensors (another dtype, another rank, an index past `u32`), and the
/// caller composes it then.
///
/// # Shapes
/// - rows: `[n_rows, width]` → `[n_targets, width]`
pub(crate) fn combine<R: CubeRuntime>(rows: &CubeTensor<R>, map: &RowMap) -> Option<CubeTensor<R>> {
    let [n_rows, width] = <[usize; 2]>::try_from(rows.meta.shape().to_vec()).ok()?;
    if !matches!(rows.dtype, DType::F32 | DType::F16 | DType::BF16) || n_rows != map.n_rows() {
        return None;
    }
    let units = map.n_targets() * width;
    if units == 0 || n_rows == 0 {
        // Nothing to launch over (CUDA refuses an empty grid); the caller's zeros are exact.
        return None;
    }
    let offsets = upload(rows, map.offsets())?;
    let order = upload(rows, map.order())?;
    let handle = rows.client.empty(units * rows.dtype.size());
    let out = CubeTensor::new_contiguous(
        rows.client.clone(),
        rows.device.clone(),
        [map.n_targets(), width].into(),
        handle,
        rows.dtype,
    );
    let dim = CubeDim::new(&rows.client, units);
    let count = calculate_cube_count_elemwise(&rows.client, units, dim);
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
