//! The rotary embedding (sequence-major, the `rotate_half` form and Llama 4's pairs) on the
//! CubeCL backends: one kernel forward and one for `x`'s gradient, one thread per output value.
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
    #[comptime] transpose: bool,
    #[comptime] pairs: bool,
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
    let half = head_dim / 2;
    // The value rotated with this one and the sign it takes, and where the angle's cosine and
    // sine are: for `rotate_half`, the other half's value of the same head and this value's
    // own table entries; for pairs, the pair's other value and the pair's angle.
    let mut partner = j + half;
    let mut sign = f32::new(-1.0);
    let mut angle = j;
    if pairs {
        angle = j / 2;
        partner = j + 1;
        if j % 2 == 1 {
            partner = j - 1;
            sign = f32::new(1.0);
        }
    } else if j >= half {
        partner = j - half;
        sign = f32::new(1.0);
    }
    let row = batch * x.stride(0) + position * x.stride(1) + head * x.stride(2);
    let table = batch * tables_per_batch;
    let (c_row, s_row) = (
        table * cos.stride(0) + position * cos.stride(1),
        table * sin.stride(0) + position * sin.stride(1),
    );
    let value = f32::cast_from(x[row + j * x.stride(3)]);
    let other = f32::cast_from(x[row + partner * x.stride(3)]);
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
    // At the output's strides: contiguous, or (`to_heads`) a head-major buffer seen as
    // `[batch, seq, heads, head_dim]`.
    let o = batch * out.stride(0) + position * out.stride(1) + head * out.stride(2) + j * out.stride(3);
    out[o] = F::cast_from(value * c + rotated);
}

/// Whether the kernel reads `x` `[batch, seq, heads, head_dim]` (an even `head_dim`) and the
/// tables `[1 or batch, seq, head_dim]`, all of one of the kernels' float types.
fn fits<R: CubeRuntime>(x: &CubeTensor<R>, cos: &CubeTensor<R>, sin: &CubeTensor<R>) -> Option<[usize; 4]> {
    let dims @ [batch, seq, _, head_dim] = <[usize; 4]>::try_from(x.meta.shape().to_vec()).ok()?;
    let table = cos.meta.shape().to_vec();
    let ok = kernel_float(x)
        && cos.dtype == x.dtype
        && sin.dtype == x.dtype
        && sin.meta.shape().to_vec() == table
        && table.len() == 3
        && (table[0] == 1 || table[0] == batch)
        && table[1..] == [seq, head_dim]
        && head_dim.is_multiple_of(2)
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
    rotate(x, cos, sin, transpose, false)
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
    rotate(x, cos, sin, transpose, true)
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
    let [batch, seq, heads, head_dim] = fits(x, cos, sin)?;
    let heads_major = output(x, [batch, heads, seq, head_dim]);
    // The same buffer seen sequence-major, which the kernel writes at its strides.
    let mut view = heads_major.clone();
    view.meta.swap(1, 2);
    rotate_into(x, cos, sin, false, pairs, view)?;
    Some(heads_major)
}

fn rotate<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    transpose: bool,
    pairs: bool,
) -> Option<CubeTensor<R>> {
    let dims = fits(x, cos, sin)?;
    rotate_into(x, cos, sin, transpose, pairs, output(x, dims))
}

/// Launches the kernel into `out`, `[batch, seq, heads, head_dim]` over a buffer of its own
/// (contiguous, or a permutation of a contiguous one); returns it.
fn rotate_into<R: CubeRuntime>(
    x: &CubeTensor<R>,
    cos: &CubeTensor<R>,
    sin: &CubeTensor<R>,
    transpose: bool,
    pairs: bool,
    out: CubeTensor<R>,
) -> Option<CubeTensor<R>> {
    let dims @ [batch, seq, heads, head_dim] = fits(x, cos, sin)?;
    debug_assert_eq!(out.meta.shape().to_vec(), dims, "the output's dims are x's");
    let tables_per_batch = usize::from(cos.meta.shape()[0] == batch && batch > 1);
    let (count, dim) = grid(x, dims.iter().product());
    // SAFETY: `x` is read at its strides within `[batch, seq, heads, head_dim]`, the tables at
    // theirs within `[rows, seq, head_dim]` (row 0 alone where `tables_per_batch` is 0, which
    // `fits` and the line above give wherever `rows` is 1); `out` has those dims over a buffer
    // of as many elements (its callers': contiguous, or a permutation of contiguous), so each
    // thread writes one element of it at its strides, and threads past its length leave.
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
            transpose,
            pairs,
            x.dtype.into(),
        )
    };
    Some(out)
}
