//! The rotary embedding composed from burn's ops: the defaults of
//! [`DecoderKernels::rotate_half_seq_major`] and its backward, the twins Flex's pass and the
//! CubeCL kernels (`flex.rs`, `cubecl_rotary.rs`) are held to, the composition a heads-major
//! caller uses ([`rotate_half_rows`]), and latent attention's queries (a head's first values
//! kept, the rest rotated: [`DecoderKernels::rotate_tail_to_heads`]).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

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

/// Which values of each head latent attention's rotation
/// ([`DecoderKernels::rotate_tail_to_heads`]) reads and how it rotates them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TailRotation {
    /// DeepSeek's interleaved pairs, each rotated by one angle (the tables' first half) and
    /// written `[first values | second values]`; else the `rotate_half` form.
    pub interleaved: bool,
    /// The first values of each head that are not the op's: left out forward, a zero gradient
    /// backward (the keys' rotary part read where it lies after the latent).
    pub skip: usize,
    /// The values after them kept as they are (the query's part without rotary embedding).
    pub pass: usize,
}

/// [`DecoderKernels::rotate_tail_to_heads`]'s default: each head's `skip` values left out, the
/// next `pass` and the rest apart (slices), the rest rotated (`rotate_half` as the backend runs
/// it, or DeepSeek's interleaved pairs written out), joined again and seen head-major (burn's
/// `swap_dims`, a view).
pub(crate) fn rotate_tail_to_heads_composed<B: DecoderKernels>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    form: TailRotation,
) -> FloatTensor<B> {
    let TailRotation {
        interleaved,
        skip,
        pass,
    } = form;
    let x = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(x));
    let [b, t, h, width] = x.dims();
    let x = match skip {
        0 => x,
        _ => x.slice([0..b, 0..t, 0..h, skip..width]),
    };
    let d = width - skip;
    let tail = x.clone().slice([0..b, 0..t, 0..h, pass..d]);
    let rotated = match interleaved {
        false => Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(B::rotate_half_seq_major(
            tail.into_primitive().tensor(),
            cos,
            sin,
        ))),
        true => {
            let [even, odd] = pair_values(tail);
            Tensor::cat(
                rotate_pairs_by::<B>([even, odd], [cos, sin], d - pass, false).into(),
                3,
            )
        }
    };
    let out = match pass {
        0 => rotated,
        _ => Tensor::cat(vec![x.slice([0..b, 0..t, 0..h, 0..pass]), rotated], 3),
    };
    out.swap_dims(1, 2).into_primitive().tensor()
}

/// [`DecoderKernels::rotate_tail_to_heads_backward`]'s default: the head-major gradient seen
/// sequence-major, its first `pass` values as they are, the rest through the rotation's
/// transpose, joined after `skip` zeros.
pub(crate) fn rotate_tail_to_heads_backward_composed<B: DecoderKernels>(
    grad: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    form: TailRotation,
) -> FloatTensor<B> {
    let TailRotation {
        interleaved,
        skip,
        pass,
    } = form;
    let grad = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(grad)).swap_dims(1, 2);
    let [b, t, h, d] = grad.dims();
    let tail = grad.clone().slice([0..b, 0..t, 0..h, pass..d]);
    let rotated =
        match interleaved {
            false => Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(
                B::rotate_half_seq_major_backward(tail.into_primitive().tensor(), cos, sin),
            )),
            true => {
                // The forward wrote the pairs' first values, then their second values: each pair
                // rotated back by its angle and interleaved again.
                let half = (d - pass) / 2;
                let first = tail.clone().slice([0..b, 0..t, 0..h, 0..half]);
                let second = tail.slice([0..b, 0..t, 0..h, half..2 * half]);
                let back = rotate_pairs_by::<B>([first, second], [cos, sin], d - pass, true);
                Tensor::stack::<5>(back.into(), 4).reshape([b, t, h, 2 * half])
            }
        };
    let mut parts = Vec::with_capacity(3);
    if skip > 0 {
        parts.push(Tensor::<B, 4>::zeros(
            [b, t, h, skip],
            (&grad.device(), grad.dtype()),
        ));
    }
    if pass > 0 {
        parts.push(grad.slice([0..b, 0..t, 0..h, 0..pass]));
    }
    parts.push(rotated);
    match parts.len() {
        1 => parts.remove(0),
        _ => Tensor::cat(parts, 3),
    }
    .into_primitive()
    .tensor()
}

/// Each pair `(a, b)` rotated by its angle, `(a · cos − b · sin, b · cos + a · sin)`, or
/// (`transpose`) by the opposite one, `(a · cos + b · sin, b · cos − a · sin)`; the angles the
/// first half of `width`-wide tables, shared by the heads.
///
/// # Shapes
/// - a, b: `[batch, seq, heads, width / 2]`; cos, sin: `[rows, seq, width]`
fn rotate_pairs_by<B: Backend>(
    [a, b]: [Tensor<B, 4>; 2],
    [cos, sin]: [FloatTensor<B>; 2],
    width: usize,
    transpose: bool,
) -> [Tensor<B, 4>; 2] {
    let [cos, sin] = [cos, sin].map(|m| first_half_per_head::<B>(m, width));
    match transpose {
        false => [
            a.clone() * cos.clone() - b.clone() * sin.clone(),
            b * cos + a * sin,
        ],
        true => [
            a.clone() * cos.clone() + b.clone() * sin.clone(),
            b * cos - a * sin,
        ],
    }
}

/// A `[rows, seq, width]` table's first half (the pairs' angles, `cat(freqs, freqs)`), as
/// `[rows, seq, 1, width / 2]`: shared by the heads.
fn first_half_per_head<B: Backend>(m: FloatTensor<B>, width: usize) -> Tensor<B, 4> {
    let m = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(m));
    let [rows, seq, _] = m.dims();
    m.slice([0..rows, 0..seq, 0..width / 2]).unsqueeze_dim(2)
}

/// Each head's pairs `(x0, x1), (x2, x3), ...` apart: the first values and the second values.
///
/// # Shapes
/// - x: `[batch, seq, heads, 2 · half]` → two of `[batch, seq, heads, half]`
fn pair_values<B: Backend>(x: Tensor<B, 4>) -> [Tensor<B, 4>; 2] {
    let [b, t, h, d] = x.dims();
    let half = d / 2;
    let pairs = x.reshape([b, t, h, half, 2]);
    [0..1, 1..2].map(|which| {
        pairs
            .clone()
            .slice([0..b, 0..t, 0..h, 0..half, which])
            .reshape([b, t, h, half])
    })
}
