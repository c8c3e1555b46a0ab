//! What the crate's CubeCL kernels need around a launch (`experts/cubecl_activation.rs`,
//! `exchange/cubecl_combine.rs`, `router/cubecl_router.rs`): a contiguous output for a kernel
//! to write whole, the launch grid of a number of threads, and host indices on the device.

use burn::tensor::DType;
use burn_cubecl::cubecl::calculate_cube_count_elemwise;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::cubecl::server::Handle;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

/// Whether `t` holds a float type the crate's kernels are written for.
pub(crate) fn kernel_float<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16)
}

/// A contiguous tensor of `shape` and `like`'s dtype on its device, for a kernel to write whole.
pub(crate) fn output<R: CubeRuntime, const D: usize>(
    like: &CubeTensor<R>,
    shape: [usize; D],
) -> CubeTensor<R> {
    let bytes = shape.iter().product::<usize>() * like.dtype.size();
    let handle = like.client.empty(bytes.max(1));
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        shape.into(),
        handle,
        like.dtype,
    )
}

/// The launch shape of `units` threads, one per element (or per row) of a kernel's work.
pub(crate) fn grid<R: CubeRuntime>(t: &CubeTensor<R>, units: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&t.client, units);
    (calculate_cube_count_elemwise(&t.client, units, dim), dim)
}

/// The launch shape of one cube of `threads` threads per row of `rows`, for the kernels whose
/// cube strides along its row and reduces across its threads (`cubecl_cube.rs`).
pub(crate) fn cube_per_row<R: CubeRuntime>(
    t: &CubeTensor<R>,
    rows: usize,
    threads: usize,
) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new_1d(threads as u32);
    (calculate_cube_count_elemwise(&t.client, rows * threads, dim), dim)
}

/// `values` as `u32`s on `like`'s device; `None` if one does not fit in a `u32` (the caller
/// composes its op then).
pub(crate) fn upload_u32<R: CubeRuntime>(like: &CubeTensor<R>, values: &[usize]) -> Option<Handle> {
    let values: Vec<u32> = values
        .iter()
        .map(|&v| u32::try_from(v).ok())
        .collect::<Option<_>>()?;
    Some(like.client.create_from_slice(u32::as_bytes(&values)))
}
