//! Latent attention's keys and values (DeepSeek-V2 / V3) on the CubeCL backends: one kernel
//! each way for each.
//!
//! The expanded product `kv` holds, per token and head, `[k_nope | v]`. The keys are each
//! head's `k_nope` joined with the rotary key every head shares, the values each head's `v`,
//! both head-major as attention's products read them. Composed, that was the swap of `kv` to
//! head-major (a copy), the two slices, the shared key repeated over the heads and the
//! concatenation forward; backward, each slice's gradient padded to the whole head and the two
//! added, the swap back, and the repeat's sum over the heads. Here the keys' backward writes
//! `kv`'s gradient (zero where the values are) and the rotary key's (summed over the heads in
//! head order) in one launch, and the values' backward `kv`'s other part (zero where `k_nope`
//! is); autodiff adds the two.
//!
//! Moving values is exact, so the forward kernels are the composed forms bit for bit; the
//! rotary key's gradient is a sum over the heads in f32, which the composed form makes in
//! burn's order. The tests hold both to the composed forms on WGPU (`decoder/cubecl_tests.rs`).

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use crate::cubecl_launch::{grid, kernel_float, output};

/// `keys[b, h, t, j]`: `kv[b, t, h, j]` for `j < nope`, `k_rot[b, 0, t, j − nope]` after.
#[cube(launch_unchecked)]
fn keys_kernel<F: Float>(
    kv: &Tensor<F>,
    k_rot: &Tensor<F>,
    keys: &mut Tensor<F>,
    nope: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= keys.len() {
        terminate!();
    }
    let width = keys.shape(3);
    let j = i % width;
    let t = (i / width) % keys.shape(2);
    let h = (i / (width * keys.shape(2))) % keys.shape(1);
    let b = i / (width * keys.shape(2) * keys.shape(1));
    if j < nope {
        keys[i] = kv[b * kv.stride(0) + t * kv.stride(1) + h * kv.stride(2) + j * kv.stride(3)];
    } else {
        keys[i] = k_rot[b * k_rot.stride(0) + t * k_rot.stride(2) + (j - nope) * k_rot.stride(3)];
    }
}

/// The keys' backward: threads below `dkv`'s length write `dkv[b, t, h, j]` (the gradient of
/// `k_nope`, zero where the values are), the rest `dk_rot[b, 0, t, r]`, the rotary part's
/// gradient summed over the heads in head order.
#[cube(launch_unchecked)]
fn keys_backward_kernel<F: Float>(
    grad: &Tensor<F>,
    dkv: &mut Tensor<F>,
    dk_rot: &mut Tensor<F>,
    nope: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    let (heads, seq) = (grad.shape(1), grad.shape(2));
    if i < dkv.len() {
        let width = dkv.shape(3);
        let j = i % width;
        let h = (i / width) % heads;
        let t = (i / (width * heads)) % seq;
        let b = i / (width * heads * seq);
        let mut value = F::new(0.0);
        if j < nope {
            value = grad[b * grad.stride(0) + h * grad.stride(1) + t * grad.stride(2) + j * grad.stride(3)];
        }
        dkv[i] = value;
    } else {
        let k = i - dkv.len();
        if k >= dk_rot.len() {
            terminate!();
        }
        let rope = dk_rot.shape(3);
        let r = k % rope;
        let t = (k / rope) % seq;
        let b = k / (rope * seq);
        let at = b * grad.stride(0) + t * grad.stride(2) + (nope + r) * grad.stride(3);
        let mut sum = f32::new(0.0);
        for h in 0..heads {
            sum += f32::cast_from(grad[at + h * grad.stride(1)]);
        }
        dk_rot[k] = F::cast_from(sum);
    }
}

/// `values[b, h, t, j] = kv[b, t, h, nope + j]`.
#[cube(launch_unchecked)]
fn values_kernel<F: Float>(
    kv: &Tensor<F>,
    values: &mut Tensor<F>,
    nope: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= values.len() {
        terminate!();
    }
    let width = values.shape(3);
    let j = i % width;
    let t = (i / width) % values.shape(2);
    let h = (i / (width * values.shape(2))) % values.shape(1);
    let b = i / (width * values.shape(2) * values.shape(1));
    values[i] = kv[b * kv.stride(0) + t * kv.stride(1) + h * kv.stride(2) + (nope + j) * kv.stride(3)];
}

/// The values' backward: `dkv[b, t, h, j]` is the values' gradient for `j ≥ nope`, zero before.
#[cube(launch_unchecked)]
fn values_backward_kernel<F: Float>(
    grad: &Tensor<F>,
    dkv: &mut Tensor<F>,
    nope: usize,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= dkv.len() {
        terminate!();
    }
    let width = dkv.shape(3);
    let j = i % width;
    let h = (i / width) % dkv.shape(2);
    let t = (i / (width * dkv.shape(2))) % dkv.shape(1);
    let b = i / (width * dkv.shape(2) * dkv.shape(1));
    let mut value = F::new(0.0);
    if j >= nope {
        value =
            grad[b * grad.stride(0) + h * grad.stride(1) + t * grad.stride(2) + (j - nope) * grad.stride(3)];
    }
    dkv[i] = value;
}

/// `kv`'s dims `[batch, seq, heads, nope + v]` where the kernels read it: a float type of
/// theirs, `nope` and `v` both at least one value, nothing empty.
fn kv_dims<R: CubeRuntime>(kv: &CubeTensor<R>, nope: usize) -> Option<[usize; 4]> {
    let dims = <[usize; 4]>::try_from(kv.meta.shape().to_vec()).ok()?;
    let ok = kernel_float(kv) && nope > 0 && dims[3] > nope && dims.iter().product::<usize>() > 0;
    ok.then_some(dims)
}

/// The keys, head-major, in one kernel; `None` where the kernel does not read the tensors.
///
/// # Shapes
/// - kv: `[batch, seq, heads, nope + v]`; k_rot: `[batch, 1, seq, rope]` →
///   `[batch, heads, seq, nope + rope]`
pub(crate) fn keys<R: CubeRuntime>(
    kv: &CubeTensor<R>,
    k_rot: &CubeTensor<R>,
    nope: usize,
) -> Option<CubeTensor<R>> {
    let [batch, seq, heads, _] = kv_dims(kv, nope)?;
    let rot = k_rot.meta.shape().to_vec();
    if k_rot.dtype != kv.dtype || rot.len() != 4 || rot[..3] != [batch, 1, seq] || rot[3] == 0 {
        return None;
    }
    let out = output(kv, [batch, heads, seq, nope + rot[3]]);
    let (count, dim) = grid(kv, batch * heads * seq * (nope + rot[3]));
    // SAFETY: `kv` is read at its strides within `[batch, seq, heads, nope)` (`kv_dims`: its
    // last dimension is wider than `nope`), `k_rot` at its within `[batch, 1, seq, rope]`;
    // `out` is contiguous with the dims its index is split by, and threads past it leave.
    unsafe {
        keys_kernel::launch_unchecked(
            &kv.client,
            count,
            dim,
            kv.clone().into_tensor_arg(),
            k_rot.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            nope,
            kv.dtype.into(),
        )
    };
    Some(out)
}

/// The keys' backward: `kv`'s gradient `[batch, seq, heads, nope + v]` (zero where the values
/// are) and the rotary key's `[batch, 1, seq, rope]`, in one kernel; `None` where the kernel
/// does not read the tensors.
///
/// # Shapes
/// - grad: `[batch, heads, seq, nope + rope]`; `v`: the values' width in `kv`
pub(crate) fn keys_backward<R: CubeRuntime>(
    grad: &CubeTensor<R>,
    nope: usize,
    v: usize,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let [batch, heads, seq, width] = <[usize; 4]>::try_from(grad.meta.shape().to_vec()).ok()?;
    let rope = width.checked_sub(nope).filter(|&r| r > 0)?;
    if !kernel_float(grad) || nope == 0 || v == 0 || batch * heads * seq == 0 {
        return None;
    }
    let dkv = output(grad, [batch, seq, heads, nope + v]);
    let dk_rot = output(grad, [batch, 1, seq, rope]);
    let threads = batch * seq * heads * (nope + v) + batch * seq * rope;
    let (count, dim) = grid(grad, threads);
    // SAFETY: `grad` is read at its strides within its dims (`nope + r < width`, `h < heads`);
    // `dkv` and `dk_rot` are contiguous with the dims their indices are split by, the first
    // `dkv`'s length of threads write it and the next `dk_rot`'s length write that, the rest
    // leave.
    unsafe {
        keys_backward_kernel::launch_unchecked(
            &grad.client,
            count,
            dim,
            grad.clone().into_tensor_arg(),
            dkv.clone().into_tensor_arg(),
            dk_rot.clone().into_tensor_arg(),
            nope,
            grad.dtype.into(),
        )
    };
    Some((dkv, dk_rot))
}

/// The values, head-major, in one kernel; `None` where the kernel does not read `kv`.
///
/// # Shapes
/// - kv: `[batch, seq, heads, nope + v]` → `[batch, heads, seq, v]`
pub(crate) fn values<R: CubeRuntime>(kv: &CubeTensor<R>, nope: usize) -> Option<CubeTensor<R>> {
    let [batch, seq, heads, width] = kv_dims(kv, nope)?;
    let out = output(kv, [batch, heads, seq, width - nope]);
    let (count, dim) = grid(kv, batch * heads * seq * (width - nope));
    // SAFETY: `kv` is read at its strides within its dims (`nope + j < width`); `out` is
    // contiguous with the dims its index is split by, and threads past it leave.
    unsafe {
        values_kernel::launch_unchecked(
            &kv.client,
            count,
            dim,
            kv.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            nope,
            kv.dtype.into(),
        )
    };
    Some(out)
}

/// The values' backward: `kv`'s gradient `[batch, seq, heads, nope + v]`, zero where `k_nope`
/// is, in one kernel; `None` where the kernel does not read `grad`.
///
/// # Shapes
/// - grad: `[batch, heads, seq, v]`
pub(crate) fn values_backward<R: CubeRuntime>(grad: &CubeTensor<R>, nope: usize) -> Option<CubeTensor<R>> {
    let [batch, heads, seq, v] = <[usize; 4]>::try_from(grad.meta.shape().to_vec()).ok()?;
    if !kernel_float(grad) || nope == 0 || batch * heads * seq * v == 0 {
        return None;
    }
    let dkv = output(grad, [batch, seq, heads, nope + v]);
    let (count, dim) = grid(grad, batch * seq * heads * (nope + v));
    // SAFETY: `grad` is read at its strides within its dims (`j − nope < v`); `dkv` is
    // contiguous with the dims its index is split by, and threads past it leave.
    unsafe {
        values_backward_kernel::launch_unchecked(
            &grad.client,
            count,
            dim,
            grad.clone().into_tensor_arg(),
            dkv.clone().into_tensor_arg(),
            nope,
            grad.dtype.into(),
        )
    };
    Some(dkv)
}
