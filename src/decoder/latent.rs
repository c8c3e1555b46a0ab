//! Latent attention's keys and values (DeepSeek-V2 / V3) composed from burn's ops: the
//! defaults of [`DecoderKernels::latent_keys`], [`DecoderKernels::latent_values`] and their
//! backwards, the twins the CubeCL kernels (`cubecl_latent.rs`) are held to.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

#[cfg(doc)]
use super::DecoderKernels;

fn tensor<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// [`DecoderKernels::latent_keys`]'s default: `k_nope` sliced from `kv` and seen head-major,
/// joined with the rotary key repeated over the heads.
pub(crate) fn latent_keys_composed<B: Backend>(
    kv: FloatTensor<B>,
    k_rot: FloatTensor<B>,
    nope: usize,
) -> FloatTensor<B> {
    let kv = tensor::<B>(kv);
    let [b, t, h, _] = kv.dims();
    let k_nope = kv.slice([0..b, 0..t, 0..h, 0..nope]).swap_dims(1, 2);
    Tensor::cat(vec![k_nope, tensor::<B>(k_rot).repeat_dim(1, h)], 3)
        .into_primitive()
        .tensor()
}

/// [`DecoderKernels::latent_keys_backward`]'s default: `kv`'s gradient the keys' first `nope`
/// values seen sequence-major, zeros where the values are; the rotary key's the rest summed
/// over the heads.
pub(crate) fn latent_keys_backward_composed<B: Backend>(
    grad: FloatTensor<B>,
    nope: usize,
    v: usize,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let grad = tensor::<B>(grad);
    let [b, h, t, width] = grad.dims();
    let zeros = Tensor::<B, 4>::zeros([b, t, h, v], (&grad.device(), grad.dtype()));
    let k_nope = grad.clone().slice([0..b, 0..h, 0..t, 0..nope]).swap_dims(1, 2);
    let dkv = Tensor::cat(vec![k_nope, zeros], 3);
    let dk_rot = grad.slice([0..b, 0..h, 0..t, nope..width]).sum_dim(1);
    (dkv.into_primitive().tensor(), dk_rot.into_primitive().tensor())
}

/// [`DecoderKernels::latent_values`]'s default: `kv`'s values sliced and seen head-major (a
/// view).
pub(crate) fn latent_values_composed<B: Backend>(kv: FloatTensor<B>, nope: usize) -> FloatTensor<B> {
    let kv = tensor::<B>(kv);
    let [b, t, h, width] = kv.dims();
    kv.slice([0..b, 0..t, 0..h, nope..width])
        .swap_dims(1, 2)
        .into_primitive()
        .tensor()
}

/// [`DecoderKernels::latent_values_backward`]'s default: zeros where `k_nope` is, the values'
/// gradient seen sequence-major after.
pub(crate) fn latent_values_backward_composed<B: Backend>(
    grad: FloatTensor<B>,
    nope: usize,
) -> FloatTensor<B> {
    let grad = tensor::<B>(grad);
    let [b, h, t, _] = grad.dims();
    let zeros = Tensor::<B, 4>::zeros([b, t, h, nope], (&grad.device(), grad.dtype()));
    Tensor::cat(vec![zeros, grad.swap_dims(1, 2)], 3)
        .into_primitive()
        .tensor()
}
