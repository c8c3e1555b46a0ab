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
/// composes its op then). One pass without a branch a value: the values are narrowed as they
/// are written and OR-ed together, and the high bits of the OR say whether any did not fit.
/// (A collect into `Option<Vec<_>>` cannot know its length, grows its array by doubling and
/// tests every value.)
pub(crate) fn upload_u32<R: CubeRuntime>(
    like: &CubeTensor<R>,
    values: impl IntoIterator<Item = usize>,
) -> Option<Handle> {
    let values = values.into_iter();
    let mut host: Vec<u32> = Vec::with_capacity(values.size_hint().0);
    let mut any = 0u64;
    host.extend(values.map(|v| {
        any |= v as u64;
        v as u32
    }));
    (any <= u64::from(u32::MAX)).then(|| like.client.create_from_slice(u32::as_bytes(&host)))
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::backend::Wgpu;
    use burn::tensor::Tensor;
    use burn_cubecl::cubecl::prelude::*;

    use super::upload_u32;

    /// Indices arrive as written, `u32::MAX` among them; one past it refuses the upload, so
    /// that a narrowing that wrapped would be caught rather than read by a kernel.
    #[test]
    fn indices_arrive_as_written_and_one_past_u32_is_refused() {
        let like = Tensor::<Wgpu, 1>::zeros([1], &Default::default())
            .into_primitive()
            .tensor();
        let values = [0usize, 7, u32::MAX as usize, 123_456, 1];
        let handle = upload_u32(&like, values).expect("every value fits");
        let bytes = like.client.read_one(handle).expect("the upload reads back");
        let read: Vec<u32> = u32::from_bytes(&bytes).to_vec();
        let want: Vec<u32> = values.iter().map(|&v| v as u32).collect();
        assert_eq!(read, want);
        assert!(upload_u32(&like, [3usize, 1 << 32, 5]).is_none());
        assert!(upload_u32(&like, [usize::MAX]).is_none());
    }
}
