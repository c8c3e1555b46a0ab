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
    pass: usize,
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
    // Latent attention's queries keep each head's first `pass` values as they are.
    if j < pass {
        out[o] = x[row + j * x.stride(3)];
        terminate!();
    }
    let r = j - pass;
    let half = (head_dim - pass) / 2;
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
    let value = f32::cast_from(x[row + (pass + own) * x.stride(3)]);
    let other = f32::cast_from(x[row + (pass + partner) * x.stride(3)]);
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
/// written de-interleaved) and how many values of each head come first unrotated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Form {
    pairs: bool,
    interleave: bool,
    pass: usize,
}

impl Form {
    const HALF: Self = Self {
        pairs: false,
        interleave: false,
        pass: 0,
    };
    const PAIRS: Self = Self {
        pairs: true,
        interleave: false,
        pass: 0,
    };

    fn new(pairs: bool) -> Self {
        match pairs {
            true => Self::PAIRS,
            false => Self::HALF,
        }
    }

    /// Latent attention's form: `rotate_half`, or (`interleaved`) DeepSeek's, after `pass`
    /// values kept.
    fn tail(interleaved: bool, pass: usize) -> Self {
        Self {
            pairs: interleaved,
            interleave: interleaved,
            pass,
        }
    }
}

/// Whether the kernel reads `x` `[batch, seq, heads, head_dim]` (an even number of rotated
/// values after `form.pass`) and the tables `[1 or batch, seq, head_dim − pass]`, all of one of
/// the kernels' float types.
fn fits<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    form: Form,
) -> Option<[usize; 4]> {
    let dims @ [batch, seq, _, head_dim] = <[usize; 4]>::try_from(x.meta.shape().to_vec()).ok()?;
    let rotated = head_dim.checked_sub(form.pass)?;
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
    ok.then_some(dims)
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

/// Latent attention's queries (DeepSeek): each head's first `pass` values as they are and the
/// rest rotated, `rotate_half` or (`interleaved`) DeepSeek's interleaved pairs written
/// de-interleaved, all written head-major in one kernel. Composed, that was the slices of the
/// two parts, the rotation, a copy to de-interleave it, the concatenation and the swap to
/// head-major (five launches), and in the backward as many more and the two parts' gradients
/// padded and added. `None` where the kernel does not read the tensors.
///
/// # Shapes
/// - x: `[batch, seq, heads, pass + rotated]`
/// - cos, sin: `[rows, seq, rotated]`, `rows` 1 or `batch` → `[batch, heads, seq, pass + rotated]`
pub(crate) fn rotate_tail_to_heads<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    interleaved: bool,
    pass: usize,
) -> Option<CubeTensor<R>> {
    into_heads(x, cos, sin, Form::tail(interleaved, pass))
}

/// The transpose of [`rotate_tail_to_heads`]: `x`'s gradient, sequence-major and contiguous,
/// from the head-major gradient of the output, read where it lies. `None` where the kernel
/// does not read the tensors.
///
/// # Shapes
/// - grad: `[batch, heads, seq, pass + rotated]`
/// - cos, sin: `[rows, seq, rotated]`, `rows` 1 or `batch` → `[batch, seq, heads, pass + rotated]`
pub(crate) fn rotate_tail_to_heads_backward<R: CubeRuntime>(
    grad: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    interleaved: bool,
    pass: usize,
) -> Option<CubeTensor<R>> {
    let mut seen = grad.clone();
    seen.meta.swap(1, 2);
    rotate(&seen, cos, sin, true, Form::tail(interleaved, pass))
}

/// The forward rotation in `form` written into a head-major buffer of its own.
fn into_heads<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    form: Form,
) -> Option<CubeTensor<R>> {
    let [batch, seq, heads, head_dim] = fits(x, cos, sin, form)?;
    let heads_major = output(x, [batch, heads, seq, head_dim]);
    // The same buffer seen sequence-major, which the kernel writes at its strides.
    let mut view = heads_major.clone();
    view.meta.swap(1, 2);
    rotate_into(x, cos, sin, false, form, view)?;
    Some(heads_major)
}

fn rotate<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    transpose: bool,
    form: Form,
) -> Option<CubeTensor<R>> {
    let dims = fits(x, cos, sin, form)?;
    rotate_into(x, cos, sin, transpose, form, output(x, dims))
}

/// Launches the kernel into `out`, `[batch, seq, heads, head_dim]` over a buffer of its own
/// (contiguous, or a permutation of a contiguous one); returns it.
fn rotate_into<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    transpose: bool,
    form: Form,
    out: CubeTensor<R>,
) -> Option<CubeTensor<R>> {
    let dims @ [batch, seq, heads, head_dim] = fits(x, cos, sin, form)?;
    debug_assert_eq!(out.meta.shape().to_vec(), dims, "the output's dims are x's");
    let tables_per_batch = usize::from(cos.meta.shape()[0] == batch && batch > 1);
    let (count, dim) = grid(x, dims.iter().product());
    // SAFETY: `x` is read at its strides within `[batch, seq, heads, head_dim]`, the tables at
    // theirs within `[rows, seq, head_dim − pass]` (row 0 alone where `tables_per_batch` is 0,
    // which `fits` and the line above give wherever `rows` is 1; the kernel's angles are below
    // `head_dim − pass`); `out` has those dims over a buffer of as many elements (its callers':
    // contiguous, or a permutation of contiguous), so each thread writes one element of it at
    // its strides, and threads past its length leave.
    unsafe {
        rotate_half_kernel::launch_unchecked(
            &x.client,
            count,
            dim,
            x.clone().into_tensor_arg(),
            cos.clone().into_tensor_arg(),
            sin.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            seq,
            heads,
            head_dim,
            tables_per_batch,
            form.pass,
            transpose,
            form.pairs,
            form.interleave,
            x.dtype.into(),
        )
    };
    Some(out)
}
