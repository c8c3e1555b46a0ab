//! Step 6's combine on the CubeCL backends: each target row the sum of its rows, one thread
//! per output element (`exchange/row_moves.rs` says why burn's `select_assign` is not used),
//! with the combine weights or without, and the weighted combine's backward.
//!
//! A thread reads its target's rows through the map's compressed inverse (`offsets`,
//! `order`) in ascending row order and adds them onto zero, so the result has the bits of
//! the sequential `select_assign` onto zeros and no atomics are needed: every output element
//! is written once, by one thread.

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use burn_cubecl::cubecl::calculate_cube_count_elemwise;

use crate::cubecl_launch::{grid, kernel_float, output, upload_u32};
use crate::dispatch::{CombineMap, RowMap};

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
    let [n_rows, width] = dims2(rows)?;
    if !kernel_float(rows) || n_rows != map.n_rows() {
        return None;
    }
    let units = map.n_targets() * width;
    if units == 0 || n_rows == 0 {
        // Nothing to launch over (CUDA refuses an empty grid); the caller's zeros are exact.
        return None;
    }
    let offsets = upload_u32(rows, map.offsets().iter().copied())?;
    let order = upload_u32(rows, map.order().iter().copied())?;
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

/// Step 6 with its weights (`exchange/weighted_combine.rs`): each output element the sum over
/// its token's rows, in ascending row order onto zero as `combine_kernel` adds them, of the
/// row's weight times the row's element. `map` holds the token offsets (`n_tokens + 1`), then
/// the rows in that order (`n_rows`), then each of those rows' choice `j` (`n_rows`).
#[cube(launch_unchecked)]
fn weighted_combine_kernel<F: Float>(
    rows: &Tensor<F>,
    weights: &Tensor<F>,
    map: &Array<u32>,
    out: &mut Tensor<F>,
    n_tokens: usize,
    n_rows: usize,
    width: usize,
    #[define(F)] _dtype: StorageType,
) {
    if ABSOLUTE_POS >= out.len() {
        terminate!();
    }
    let t = ABSOLUTE_POS / width;
    let c = ABSOLUTE_POS % width;
    let order = n_tokens + 1;
    let choice = order + n_rows;
    let start = map[t] as usize;
    let end = map[t + 1] as usize;
    let mut acc = F::new(0.0);
    for j in start..end {
        let r = map[order + j] as usize;
        let w = weights[t * weights.stride(0) + (map[choice + j] as usize) * weights.stride(1)];
        acc += w * rows[r * rows.stride(0) + c * rows.stride(1)];
    }
    out[ABSOLUTE_POS] = acc;
}

/// Threads of a cube of `weighted_combine_backward_kernel`: each walks every 64th column of
/// its slot's row, and thread 0 adds the 64 partial dot products in order.
const BACKWARD_THREADS: usize = 64;

/// Both gradients of step 6 with its weights, one cube per slot `s = t · top_k + j`: the rows'
/// gradient `w_s · grad[t]` written into the slot's row, and the slot's weight gradient
/// `grad[t] · rows[row]`, accumulated in f32 per thread and summed in shared memory (0 for a
/// slot without a row). `row_of_slot` holds each slot's row plus one, 0 for none.
#[cube(launch_unchecked)]
fn weighted_combine_backward_kernel<F: Float>(
    grad: &Tensor<F>,
    rows: &Tensor<F>,
    weights: &Tensor<F>,
    row_of_slot: &Array<u32>,
    d_rows: &mut Tensor<F>,
    d_weights: &mut Tensor<F>,
    n_slots: usize,
    top_k: usize,
    width: usize,
    #[comptime] threads: usize,
    #[define(F)] _dtype: StorageType,
) {
    // A whole cube leaves together (one slot per cube), so the barrier below is reached by
    // every thread of every cube that stays.
    let s = CUBE_POS;
    if s >= n_slots {
        terminate!();
    }
    let unit = UNIT_POS as usize;
    let t = s / top_k;
    let row = row_of_slot[s] as usize;
    let mut acc = 0.0f32;
    if row > 0 {
        let r = row - 1;
        let w = weights[t * weights.stride(0) + (s % top_k) * weights.stride(1)];
        let mut c = unit;
        while c < width {
            let g = grad[t * grad.stride(0) + c * grad.stride(1)];
            d_rows[r * width + c] = w * g;
            acc += f32::cast_from(g) * f32::cast_from(rows[r * rows.stride(0) + c * rows.stride(1)]);
            c += threads;
        }
    }
    let mut partial = SharedMemory::<f32>::new(threads);
    partial[unit] = acc;
    sync_cube();
    if unit == 0 {
        let mut sum = 0.0f32;
        for i in 0..threads {
            sum += partial[i];
        }
        d_weights[s] = F::cast_from(sum);
    }
}

/// `[rows, width]`, the dims of a 2-d tensor.
fn dims2<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<[usize; 2]> {
    <[usize; 2]>::try_from(t.meta.shape().to_vec()).ok()
}

/// Whether the kernels of step 6 with its weights read these tensors: the crate's float types,
/// one dtype, rows and weights shaped as `map` says, and something to sum.
fn weighted_fits<R: CubeRuntime>(rows: &CubeTensor<R>, weights: &CubeTensor<R>, map: &CombineMap) -> bool {
    let (Some([n_rows, width]), Some(w)) = (dims2(rows), dims2(weights)) else {
        return false;
    };
    kernel_float(rows)
        && weights.dtype == rows.dtype
        && n_rows == map.n_rows()
        && w == [map.n_tokens(), map.top_k()]
        && n_rows > 0
        && width > 0
}

/// Step 6 with its weights in one kernel; `None` where it does not read the tensors or there
/// is nothing to sum (the caller composes it then).
///
/// # Shapes
/// - rows: `[n_rows, d_model]`, weights: `[n_tokens, top_k]` → `[n_tokens, d_model]`
pub(crate) fn combine_weighted<R: CubeRuntime>(
    rows: &CubeTensor<R>,
    weights: &CubeTensor<R>,
    map: &CombineMap,
) -> Option<CubeTensor<R>> {
    if !weighted_fits(rows, weights, map) {
        return None;
    }
    let [n_rows, width] = dims2(rows)?;
    let tokens = map.tokens();
    let (slots, top_k) = (map.slots().targets(), map.top_k());
    // A row's choice is its slot less its token's first slot: a product, where a remainder
    // would divide once a row.
    let choices = (tokens.order().iter()).map(|&r| slots[r] - tokens.targets()[r] * top_k);
    let packed = (tokens.offsets().iter().copied())
        .chain(tokens.order().iter().copied())
        .chain(choices);
    let packed = upload_u32(rows, packed)?;
    let units = map.n_tokens() * width;
    let out = output(rows, [map.n_tokens(), width]);
    let (count, dim) = grid(rows, units);
    // SAFETY: `packed` holds `n_tokens + 1` offsets within the `n_rows` rows that follow them,
    // each a row of `rows`, and each row's choice below `top_k` (CombineMap builds them so, and
    // `weighted_fits` checked the shapes); the kernel bounds its index by `out`'s elements.
    unsafe {
        weighted_combine_kernel::launch_unchecked(
            &rows.client,
            count,
            dim,
            rows.clone().into_tensor_arg(),
            weights.clone().into_tensor_arg(),
            ArrayArg::from_raw_parts(packed, map.n_tokens() + 1 + 2 * n_rows),
            out.clone().into_tensor_arg(),
            map.n_tokens(),
            n_rows,
            width,
            rows.dtype.into(),
        )
    };
    Some(out)
}

/// Both gradients of step 6 with its weights in one kernel; `None` where it does not read the
/// tensors or there is nothing to sum (the caller composes them then).
///
/// # Shapes
/// - grad: `[n_tokens, d_model]`, rows: `[n_rows, d_model]`, weights: `[n_tokens, top_k]`
/// - returns `([n_rows, d_model], [n_tokens, top_k])`
pub(crate) fn combine_weighted_backward<R: CubeRuntime>(
    grad: &CubeTensor<R>,
    rows: &CubeTensor<R>,
    weights: &CubeTensor<R>,
    map: &CombineMap,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let [n_rows, width] = dims2(rows)?;
    if !weighted_fits(rows, weights, map)
        || grad.dtype != rows.dtype
        || dims2(grad)? != [map.n_tokens(), width]
    {
        return None;
    }
    let n_slots = map.n_tokens() * map.top_k();
    // Each slot's row plus one, 0 for none, read off the slot map's offsets in one pass.
    let slot_map = map.slots();
    let row_of_slot = slot_map.offsets().windows(2).map(|w| match w[1] > w[0] {
        true => slot_map.order()[w[0]] + 1,
        false => 0,
    });
    let row_of_slot = upload_u32(rows, row_of_slot)?;
    let d_rows = output(rows, [n_rows, width]);
    let d_weights = output(rows, [map.n_tokens(), map.top_k()]);
    let dim = CubeDim::new_1d(BACKWARD_THREADS as u32);
    let count = calculate_cube_count_elemwise(&rows.client, n_slots * BACKWARD_THREADS, dim);
    // SAFETY: `row_of_slot` has an entry per slot, each 0 or a row of `rows` plus one, and a
    // row belongs to one slot, so each row of `d_rows` is written by one cube; cubes past the
    // last slot leave before reading, and `d_weights` has an element per slot.
    unsafe {
        weighted_combine_backward_kernel::launch_unchecked(
            &rows.client,
            count,
            dim,
            grad.clone().into_tensor_arg(),
            rows.clone().into_tensor_arg(),
            weights.clone().into_tensor_arg(),
            ArrayArg::from_raw_parts(row_of_slot, n_slots),
            d_rows.clone().into_tensor_arg(),
            d_weights.clone().into_tensor_arg(),
            n_slots,
            map.top_k(),
            width,
            BACKWARD_THREADS,
            rows.dtype.into(),
        )
    };
    Some((d_rows, d_weights))
}
