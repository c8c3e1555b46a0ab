//! The rotary embedding composed from burn's ops: the defaults of
//! [`DecoderKernels::rotate_half_seq_major`] and its backward, the twins Flex's pass and the
//! CubeCL kernels (`flex.rs`, `cubecl_rotary.rs`) are held to, and the composition a
//! heads-major caller uses ([`rotate_half_rows`]).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

#[cfg(doc)]
use super::DecoderKernels;

/// A `[rows, seq, head_dim]` table repeated over the heads, as `[rows, seq · heads · head_dim]`:
/// one row of it per sequence-major row of `x`.
fn per_head_table<B: Backend>(m: FloatTensor<B>, [t, h, d]: [usize; 3]) -> Tensor<B, 2> {
    let m = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(m));
    let rows = m.dims()[0];
    m.reshape([rows, t, 1, d])
        .repeat_dim(2, h)
        .reshape([rows, t * h * d])
}

/// The rotation composed from burn's ops (`pairs`: Llama 4's) and burn's `swap_dims` (a view):
/// the fallback of [`DecoderKernels::rotate_seq_major_to_heads`] where no kernel runs.
pub(crate) fn rotate_to_heads_composed<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    pairs: bool,
) -> FloatTensor<B> {
    let rotated = match pairs {
        true => rotate_pairs_seq_major_composed::<B>(x, cos, sin),
        false => rotate_half_seq_major_composed::<B>(x, cos, sin),
    };
    B::float_swap_dims(rotated, 1, 2)
}

/// [`DecoderKernels::rotate_half_seq_major`]'s default: burn's ops.
pub(crate) fn rotate_half_seq_major_composed<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
) -> FloatTensor<B> {
    let x = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(x));
    let [b, t, h, d] = x.dims();
    let table = |m| per_head_table::<B>(m, [t, h, d]);
    rotate_half_rows(x, [b, t * h * d], table(cos), table(sin))
        .into_primitive()
        .tensor()
}

/// [`DecoderKernels::rotate_half_seq_major_backward`]'s default: burn's ops, the tables
/// repeated over the heads as the forward's default does.
pub(crate) fn rotate_half_seq_major_backward_composed<B: Backend>(
    grad: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
) -> FloatTensor<B> {
    let grad = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(grad));
    let dims @ [b, t, h, d] = grad.dims();
    let table = |m| per_head_table::<B>(m, [t, h, d]);
    let grad = grad.reshape([b, t * h * d]);
    let by_sin = (grad.clone() * table(sin)).reshape([b * t * h, d]);
    let rotated = by_sin.matmul(rotate_half_matrix(d, &grad.device()));
    (grad * table(cos) - rotated.reshape([b, t * h * d]))
        .reshape(dims)
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

/// [`DecoderKernels::rotate_pairs_seq_major`]'s default: burn's ops, as Llama 4's models wrote
/// the complex form: each head's values as pairs `(re, im)`, each pair rotated by its
/// position's angle (the tables' first half), written back in place.
pub(crate) fn rotate_pairs_seq_major_composed<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
) -> FloatTensor<B> {
    let x = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(x));
    let [b, t, h, d] = x.dims();
    let half = d / 2;
    let pairs = x.reshape([b, t, h, half, 2]);
    let re = pairs.clone().slice([0..b, 0..t, 0..h, 0..half, 0..1]);
    let im = pairs.slice([0..b, 0..t, 0..h, 0..half, 1..2]);
    let table = |m: FloatTensor<B>| {
        let m = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(m));
        let rows = m.dims()[0];
        m.slice([0..rows, 0..t, 0..half]).reshape([rows, t, 1, half, 1])
    };
    let (cos, sin) = (table(cos), table(sin));
    let out_re = re.clone() * cos.clone() - im.clone() * sin.clone();
    let out_im = re * sin + im * cos;
    Tensor::cat(vec![out_re, out_im], 4)
        .reshape([b, t, h, d])
        .into_primitive()
        .tensor()
}

/// [`DecoderKernels::rotate_pairs_seq_major_backward`]'s default: the rotation by the opposite
/// angles (a rotation's transpose), the sines negated.
pub(crate) fn rotate_pairs_seq_major_backward_composed<B: Backend>(
    grad: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
) -> FloatTensor<B> {
    rotate_pairs_seq_major_composed::<B>(grad, cos, B::float_neg(sin))
}
