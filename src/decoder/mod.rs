//! Kernels of the decoder blocks around the MoE layer: RMSNorm and the rotary embedding (the
//! `rotate_half` form), which a model built on the layer runs at every position of every step.
//!
//! Composed from burn's ops, each is six to ten ops, each op an allocation and a pass, on a
//! few hundred values per token: in a decode step of the 163 M Qwen3-MoE the norms and the
//! rotations were 2.9% of the step, nearly all of it per-op overhead (BENCHMARKS §13m). The
//! defaults here are those compositions, exactly as the models wrote them (and what
//! `Autodiff` records, with their gradients); Flex runs each as one pass over its rows
//! (`decoder/flex.rs`), with the same operations per value.

mod autodiff;
#[cfg(feature = "cubecl")]
mod cubecl_norm;
#[cfg(all(test, feature = "wgpu"))]
mod cubecl_tests;
#[cfg(feature = "flex")]
mod flex;
#[cfg(feature = "fusion")]
mod fusion;
#[cfg(all(test, feature = "flex"))]
mod tests;

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

/// The decoder blocks' kernels, on the backend that runs them.
pub trait DecoderKernels: Backend {
    /// `weight · x / sqrt(mean(x²) + eps)` over each row (transformers' `*RMSNorm`), composed
    /// as `x · recip(sqrt(mean(x²) + eps)) · weight` from burn's ops by default.
    ///
    /// # Shapes
    /// - x: `[rows, width]`, weight: `[width]` → `[rows, width]`
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        rms_norm_composed::<Self>(x, weight, eps)
    }

    /// Whether `Autodiff` over this backend records [`rms_norm`](Self::rms_norm) as one node
    /// whose backward is [`rms_norm_backward`](Self::rms_norm_backward), rather than burn's
    /// ops one by one (seven forward, about a dozen backward, each a launch on a GPU backend
    /// that does not fuse). The backends with a kernel each way say yes; the others keep the
    /// composed graph, and their training is unchanged by this switch.
    fn rms_norm_node() -> bool {
        false
    }

    /// Both gradients of [`rms_norm`](Self::rms_norm) from the output's, with
    /// `r = 1 / sqrt(mean(x²) + eps)` per row and `u = grad · weight`:
    /// `dx = r · u − r³ · x · mean(u · x)` per row, `d weight = Σ_rows grad · x · r`.
    ///
    /// # Shapes
    /// - x, grad: `[rows, width]`, weight: `[width]` → (`[rows, width]`, `[width]`)
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        rms_norm_backward_composed::<Self>(x, weight, grad, eps)
    }

    /// `x · cos + rotate_half(x) · sin` for every head of every position, the heads
    /// consecutive (`rotate_half(v) = [−v[d/2..] | v[..d/2]]` per head of `head_dim` values),
    /// each position's tables shared by its heads, and by every batch row where the tables
    /// have one row. By default composed as the models wrote it: the tables repeated over the
    /// heads, `rotate_half` one product with the signed permutation `[[0, I], [−I, 0]]` (exact:
    /// each output one input times ±1), then the products and the sum.
    ///
    /// # Shapes
    /// - x: `[batch, seq, heads, head_dim]`
    /// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch` → `[batch, seq, heads, head_dim]`
    fn rotate_half_seq_major(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        rotate_half_seq_major_composed::<Self>(x, cos, sin)
    }
}

/// [`DecoderKernels::rms_norm`]'s default: burn's ops.
pub(crate) fn rms_norm_composed<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    eps: f64,
) -> FloatTensor<B> {
    let x = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x));
    let weight = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(weight));
    let width = weight.dims()[0];
    let mean_square = x.clone().powi_scalar(2).mean_dim(1);
    let normalised = x * (mean_square + eps).sqrt().recip();
    (normalised * weight.reshape([1, width]))
        .into_primitive()
        .tensor()
}

/// [`DecoderKernels::rms_norm_backward`]'s default: burn's ops.
pub(crate) fn rms_norm_backward_composed<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    eps: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let x = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x));
    let grad = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(grad));
    let weight = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(weight));
    let width = weight.dims()[0];
    let r = (x.clone().powi_scalar(2).mean_dim(1) + eps).sqrt().recip();
    let u = grad.clone() * weight.reshape([1, width]);
    let mean_ux = (u.clone() * x.clone()).mean_dim(1);
    let dx = u * r.clone() - x.clone() * (r.clone().powi_scalar(3) * mean_ux);
    let dweight = (grad * x * r).sum_dim(0).reshape([width]);
    (dx.into_primitive().tensor(), dweight.into_primitive().tensor())
}

/// [`DecoderKernels::rotate_half_seq_major`]'s default: burn's ops.
pub(crate) fn rotate_half_seq_major_composed<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
) -> FloatTensor<B> {
    let x = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(x));
    let [b, t, h, d] = x.dims();
    let table = |m: FloatTensor<B>| {
        let m = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(m));
        let rows = m.dims()[0];
        m.reshape([rows, t, 1, d])
            .repeat_dim(2, h)
            .reshape([rows, t * h * d])
    };
    rotate_half_rows(x, [b, t * h * d], table(cos), table(sin))
        .into_primitive()
        .tensor()
}

/// `x · cos + rotate_half(x) · sin`, with `x` seen as `rows` (each row a run of whole heads)
/// and the tables as one such row, shared by every row, or one for each: the composition of
/// [`DecoderKernels::rotate_half_seq_major`]'s default, and of a heads-major caller's.
///
/// A table shared row by row is a broadcast Flex vectorises, and `rotate_half(x)` is one
/// product with the signed permutation matrix over contiguous rows rather than two strided
/// slices, a negation and a concatenation. The product is exact: each output is one input
/// times ±1 plus zeros.
///
/// # Shapes
/// - x: `[.., head_dim]` of `rows[0] · rows[1]` values; cos, sin: `[1 or rows[0], rows[1]]`
pub fn rotate_half_rows<B: Backend>(
    x: Tensor<B, 4>,
    rows: [usize; 2],
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
) -> Tensor<B, 4> {
    let dims = x.dims();
    let d = dims[3];
    let rotated = x
        .clone()
        .reshape([rows[0] * rows[1] / d, d])
        .matmul(rotate_half_matrix(d, &x.device()))
        .reshape(rows);
    (x.reshape(rows) * cos + rotated * sin).reshape(dims)
}

/// The `[d, d]` matrix `R` with `x · R = rotate_half(x) = [−x[d/2..] | x[..d/2]]` for a row
/// `x`: `R[half + j][j] = −1` and `R[j][half + j] = 1`.
fn rotate_half_matrix<B: Backend>(d: usize, device: &B::Device) -> Tensor<B, 2> {
    let half = d / 2;
    let mut r = vec![0f32; d * d];
    for j in 0..half {
        r[(half + j) * d + j] = -1.0;
        r[j * d + half + j] = 1.0;
    }
    Tensor::from_data(TensorData::new(r, [d, d]), device)
}

#[cfg(feature = "flex")]
impl DecoderKernels for burn::backend::Flex {
    /// One pass over the rows (`decoder/flex.rs`).
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        flex::rms_norm(x, weight, eps)
    }

    /// One pass over the positions and heads (`decoder/flex.rs`).
    fn rotate_half_seq_major(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        flex::rotate_half_seq_major(x, cos, sin)
    }
}

// NdArray: the composed forms. The CubeCL backends run the norm in one kernel each way
// (`cubecl_norm.rs`), fusion the inner backend's (`fusion.rs`), and autodiff records the norm as
// one node where the inner backend says so (`autodiff.rs`).
default_kernel_impls!(@ndarray DecoderKernels);

#[cfg(feature = "cubecl")]
impl<R, F, I, BT> DecoderKernels for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    R::Server: burn_cubecl::cubecl::server::ComputeServer,
    R::Device: burn::tensor::backend::DeviceOps,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        cubecl_norm::rms_norm(&x, &weight, eps).unwrap_or_else(|| rms_norm_composed::<Self>(x, weight, eps))
    }

    fn rms_norm_node() -> bool {
        true
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        match cubecl_norm::rms_norm_backward(&x, &weight, &grad, eps) {
            // The weight's gradient is the column sums of the kernel's `grad · x · r`.
            Some((dx, scaled)) => (dx, cubecl_norm::column_sums::<Self>(scaled)),
            None => rms_norm_backward_composed::<Self>(x, weight, grad, eps),
        }
    }
}
