//! The rotary embedding (sequence-major, the `rotate_half` form and Llama 4's pairs, and latent
//! attention's queries: a head's first values kept and the rest rotated, DeepSeek's pairs
//! written de-interleaved) on the CubeCL backends: one kernel forward and one for `x`'s
//! gradient, one thread per output value.
//!
//! Composed, a rotation is the tables repeated over the heads (two copies), `rotate_half` as a
//! product with a signed permutation matrix, two products and a sum forward, and about as many
//! backward under autodiff, for the queries and the keys of every attention layer of every
//! step. Each output here is one value of `x` times its cosine plus its partner in the other
//! half of the head times ±its sine, read at the tensors' strides, the tables' rows shared by
//! the heads (and by the batch rows where the tables have one row), as Flex's one pass does
//! (`decoder/flex.rs`). The backward is the rotation's transpose: the partner's sign flips and
//! the partner's sine is read, which holds for any tables, not only those whose halves repeat.
//!
//! Each thread computes in f32 whatever the tensors' float type. The tests hold both to the
//! composed forms on WGPU (`decoder/cubecl_tests.rs`).

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use super::TailRotation;
use crate::cubecl_launch::{grid, kernel_float, output};

#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
fn rotate_half_kernel<F: Float>(
    x: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    out: &mut Tensor<F>,
    seq: usize,
    heads: usize,
    head_dim: usize,
    tables_per_batch: usize,
    skip: usize,
    pass: usize,
    rotated: usize,
    #[comptime] transpose: bool,
    #[comptime] pairs: bool,
    #[comptime] interleave: bool,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= out.len() {
        terminate!();
    }
    let j = i % head_dim;
    let head = (i / head_dim) % heads;
    let position = (i / (head_dim * heads)) % seq;
    let batch = i / (head_dim * heads * seq);
    let row = batch * x.stride(0) + position * x.stride(1) + head * x.stride(2);
    // At the output's strides: contiguous, or (`to_heads`) a head-major buffer seen as
    // `[batch, seq, heads, head_dim]`.
    let o = batch * out.stride(0) + position * out.stride(1) + head * out.stride(2) + j * out.stride(3);
    // `x`'s first `skip` values of each head are not the op's: forward they are not read,
    // transposed their gradient is zero. `col`: this value's place after them.
    let mut col = j;
    let mut from_x = skip;
    if transpose {
        if j < skip {
            out[o] = F::new(0.0);
            terminate!();
        }
        col = j - skip;
        from_x = 0;
    }
    // Latent attention's queries keep each head's first `pass` values as they are.
    if col < pass {
        out[o] = x[row + (from_x + col) * x.stride(3)];
        terminate!();
    }
    let r = col - pass;
    let half = rotated / 2;
    // The value rotated with this one and the sign it takes, and where the angle's cosine and
    // sine are: for `rotate_half`, the other half's value of the same head and this value's
    // own table entries; for pairs, the pair's other value and the pair's angle. Indices are
    // within the rotated part.
    let mut own = r;
    let mut partner = r + half;
    let mut sign = f32::new(-1.0);
    let mut angle = r;
    if pairs {
        // `p`: this value's place among the pairs. DeepSeek's interleaved form writes the
        // pairs' first values then their second values (`interleave`): forward, this output
        // is that layout's `r`; transposed, the gradient is read from it.
        let mut p = r;
        if interleave && !transpose {
            p = 2 * r;
            if r >= half {
                p = 2 * (r - half) + 1;
            }
        }
        angle = p / 2;
        own = p;
        partner = p + 1;
        if p % 2 == 1 {
            partner = p - 1;
            sign = f32::new(1.0);
        }
        if interleave && transpose {
            own = p / 2 + (p % 2) * half;
            partner = partner / 2 + (partner % 2) * half;
        }
    } else if r >= half {
        partner = r - half;
        sign = f32::new(1.0);
    }
    let value = f32::cast_from(x[row + (from_x + pass + own) * x.stride(3)]);
    let other = f32::cast_from(x[row + (from_x + pass + partner) * x.stride(3)]);
    let table = batch * tables_per_batch;
    let (c_row, s_row) = (
        table * cos.stride(0) + position * cos.stride(1),
        table * sin.stride(0) + position * sin.stride(1),
    );
    let c = f32::cast_from(cos[c_row + angle * cos.stride(2)]);
    let mut rotated = sign * other * f32::cast_from(sin[s_row + angle * sin.stride(2)]);
    if transpose {
        // The rotation's transpose: the partner's sign flips. A pair shares its angle; for
        // `rotate_half` the partner's own sine scaled it in the forward.
        let mut from = angle;
        if !pairs {
            from = partner;
        }
        rotated = sign * f32::new(-1.0) * other * f32::cast_from(sin[s_row + from * sin.stride(2)]);
    }
    out[o] = F::cast_from(value * c + rotated);
}

/// How the kernel rotates: the form (`rotate_half`, Llama 4's `pairs`, or DeepSeek's pairs
/// written de-interleaved), how many values of each head of `x` are not the op's (`skip`:
/// not read forward, a zero gradient transposed), and how many come first unrotated (`pass`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Form {
    pairs: bool,
    interleave: bool,
    skip: usize,
    pass: usize,
}

impl Form {
    const HALF: Self = Self {
        pairs: false,
        interleave: false,
        skip: 0,
        pass: 0,
    };
    const PAIRS: Self = Self {
        pairs: true,
        interleave: false,
        skip: 0,
        pass: 0,
    };

    fn new(pairs: bool) -> Self {
        match pairs {
            true => Self::PAIRS,
            false => Self::HALF,
        }
    }

    /// Latent attention's form: `rotate_half`, or DeepSeek's interleaved pairs, after the
    /// values left out and those kept.
    fn tail(form: TailRotation) -> Self {
        Self {
            pairs: form.interleaved,
            interleave: form.interleaved,
            skip: form.skip,
            pass: form.pass,
        }
    }
}

/// The output's dims and the rotated width where the kernel reads the tensors: `x`
/// `[batch, seq, heads, width]` of one of the kernels' float types, of which forward the first
/// `form.skip` values a head are left out (the output is that much narrower) and transposed
/// (`x` the output's gradient) that many zeros come first (the output is that much wider); an
/// even number of rotated values after `form.pass`; the tables `[1 or batch, seq, rotated]` of
/// `x`'s type.
fn fits<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    form: Form,
    transpose: bool,
) -> Option<([usize; 4], usize)> {
    let dims @ [batch, seq, heads, width] = <[usize; 4]>::try_from(x.meta.shape().to_vec()).ok()?;
    let (out_width, ours) = match transpose {
        true => (width.checked_add(form.skip)?, width),
        false => (width.checked_sub(form.skip)?, width - form.skip),
    };
    let rotated = ours.checked_sub(form.pass)?;
    let table = cos.meta.shape().to_vec();
    let ok = kernel_float(x)
        && cos.dtype == x.dtype
        && sin.dtype == x.dtype
        && sin.meta.shape().to_vec() == table
        && table.len() == 3
        && (table[0] == 1 || table[0] == batch)
        && table[1..] == [seq, rotated]
        && rotated > 0
        && rotated.is_multiple_of(2)
        && dims.iter().product::<usize>() > 0;
    ok.then_some(([batch, seq, heads, out_width], rotated))
}

/// The rotation of `x` (`transpose` false) or its transpose, `x` then being the output's
/// gradient (`transpose` true), in one kernel; `None` where the kernel does not read the
/// tensors (the caller composes it then).
///
/// # Shapes
/// - x: `[batch, seq, heads, head_dim]`
/// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch` → `[batch, seq, heads, head_dim]`
pub(crate) fn rotate_half<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    transpose: bool,
) -> Option<CubeTensor<R>> {
    rotate(x, cos, sin, transpose, Form::HALF)
}

/// Llama 4's rotation of `x`'s pairs (`transpose` false), or its transpose (`transpose` true,
/// `x` then being the output's gradient), in one kernel; `None` where the kernel does not read
/// the tensors.
///
/// # Shapes
/// - x: `[batch, seq, heads, head_dim]`
/// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch` → `[batch, seq, heads, head_dim]`
pub(crate) fn rotate_pairs<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    transpose: bool,
) -> Option<CubeTensor<R>> {
    rotate(x, cos, sin, transpose, Form::PAIRS)
}

/// The rotation of `x` (the `rotate_half` form, or Llama 4's `pairs`) written head-major, as
/// attention's products read it: the sequence-major rotation and the swap of the middle
/// dimensions that followed it (a copy of the queries or the keys each way) in one kernel.
/// The backward needs no form of its own: the transpose kernel reads the head-major gradient
/// at its strides. `None` where the kernel does not read the tensors.
///
/// # Shapes
/// - x: `[batch, seq, heads, head_dim]`
/// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch` → `[batch, heads, seq, head_dim]`
pub(crate) fn rotate_to_heads<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    pairs: bool,
) -> Option<CubeTensor<R>> {
    into_heads(x, cos, sin, Form::new(pairs))
}

/// Latent attention's rotations (DeepSeek): each head's first `form.pass` values as they are and
/// the rest rotated, `rotate_half` or (`form.interleaved`) DeepSeek's interleaved pairs written
/// de-interleaved, all written head-major in one kernel, after `form.skip` values of `x` left out
/// (the keys' rotary part read where it lies in the compression). Composed, the query's was
/// the slices of the two parts, the rotation, a copy to de-interleave it, the concatenation
/// and the swap to head-major (five launches), and in the backward as many more and the two
/// parts' gradients padded and added. `None` where the kernel does not read the tensors.
///
/// # Shapes
/// - x: `[batch, seq, heads, skip + pass + rotated]`
/// - cos, sin: `[rows, seq, rotated]`, `rows` 1 or `batch` → `[batch, heads, seq, pass + rotated]`
pub(crate) fn rotate_tail_to_heads<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    form: TailRotation,
) -> Option<CubeTensor<R>> {
    into_heads(x, cos, sin, Form::tail(form))
}

/// The transpose of [`rotate_tail_to_heads`]: `x`'s gradient, sequence-major and contiguous
/// (zero in the `form.skip` values left out), from the head-major gradient of the output, read
/// where it lies. `None` where the kernel does not read the tensors.
///
/// # Shapes
/// - grad: `[batch, heads, seq, pass + rotated]`
/// - cos, sin: `[rows, seq, rotated]`, `rows` 1 or `batch` →
///   `[batch, seq, heads, skip + pass + rotated]`
pub(crate) fn rotate_tail_to_heads_backward<R: CubeRuntime>(
    grad: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    form: TailRotation,
) -> Option<CubeTensor<R>> {
    let mut seen = grad.clone();
    seen.meta.swap(1, 2);
    rotate(&seen, cos, sin, true, Form::tail(form))
}

/// The forward rotation in `form` written into a head-major buffer of its own.
fn into_heads<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    form: Form,
) -> Option<CubeTensor<R>> {
    let ([batch, seq, heads, width], rotated) = fits(x, cos, sin, form, false)?;
    let heads_major = output(x, [batch, heads, seq, width]);
    // The same buffer seen sequence-major, which the kernel writes at its strides.
    let mut view = heads_major.clone();
    view.meta.swap(1, 2);
    rotate_into(x, cos, sin, (false, form, rotated), view);
    Some(heads_major)
}

fn rotate<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    transpose: bool,
    form: Form,
) -> Option<CubeTensor<R>> {
    let (dims, rotated) = fits(x, cos, sin, form, transpose)?;
    let out = output(x, dims);
    rotate_into(x, cos, sin, (transpose, form, rotated), out.clone());
    Some(out)
}

/// Launches the kernel into `out`, the dims [`fits`] gave for `x` over a buffer of its own
/// (contiguous, or a permutation of a contiguous one).
fn rotate_into<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    (transpose, form, rotated): (bool, Form, usize),
    out: CubeTensor<R>,
) {
    let dims @ [batch, seq, heads, head_dim] =
        <[usize; 4]>::try_from(out.meta.shape().to_vec()).expect("`fits` gave the output four dimensions");
    let tables_per_batch = usize::from(cos.meta.shape()[0] == batch && batch > 1);
    let (count, dim) = grid(x, dims.iter().product());
    // SAFETY: `x` is read at its strides within its dims (`fits`: forward, the values after the
    // `skip` left out; transposed, every value), the tables at theirs within `[rows, seq,
    // rotated]` (row 0 alone where `tables_per_batch` is 0, which `fits` and the line above
    // give wherever `rows` is 1; the kernel's angles are below `rotated`); `out` has the dims
    // its index is split by over a buffer of as many elements (its callers': contiguous, or a
    // permutation of contiguous), so each thread writes one element of it at its strides, and
    // threads past its length leave.
    unsafe {
        rotate_half_kernel::launch_unchecked(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            cos.clone().into_tensor_arg(),
            sin.clone().into_tensor_arg(),
            out.into_tensor_arg(),
            seq,
            heads,
            head_dim,
            tables_per_batch,
            form.skip,
            form.pass,
            rotated,
            transpose,
            form.pairs,
            form.interleave,
            x.dtype.into(),
        )
    };
}
