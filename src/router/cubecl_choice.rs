//! The router's choice of experts on the CubeCL backends (CUDA, ROCm, WGPU): one kernel, one
//! thread per token, and only the choice read to the host.
//!
//! The host's choice ([`group_limited_top_k`](super::topk::group_limited_top_k)) needs every
//! token's `n_experts` values on the host: at 4,096 tokens a 128-expert router reads 2 MiB and
//! then scans them on the CPU (about 1.3 ms on two cores of a server CPU, BENCHMARKS §15),
//! while a GPU at one rank has nothing queued until the plan is made. Here the device makes
//! the choice and the host reads `top_k` indices a token (128 KiB at top-8).
//!
//! The kernel makes the host's choice exactly. It compares the same f32 values with the same
//! strict `>` in the same column order, so a tie goes to the lower column as in the definition
//! ([`group_limited_top_k_reference`](super::topk::group_limited_top_k_reference)); the group
//! scores are the same f32 sums of each group's two largest values. CUDA compiles it without
//! flushing subnormals (cubecl-cuda 0.10 passes NVRTC only the architecture and include paths,
//! `compute/context.rs` lines 148–159, and NVRTC's default is `-ftz=false`), so comparisons are
//! IEEE's there too. A row the kernel cannot choose as the host would is one with a value that
//! is not finite (a NaN compares false both ways): the kernel flags it, and the caller takes
//! the host's path for the batch (`router/module.rs`), which is where the input's finite check
//! lives. The tests hold the kernel to the host's choice on WGPU, ties and groups included
//! (`router/cubecl_tests.rs`).

use std::future::Future;
use std::pin::Pin;

use burn_cubecl::cubecl;
use burn_cubecl::cubecl::bytes::Bytes;
use burn_cubecl::cubecl::client::ComputeClient;
use burn_cubecl::cubecl::prelude::*;
use burn_cubecl::cubecl::server::{Handle, ServerError};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

use super::kernels::{ChoiceRead, DeviceChoice};
use super::RoutingRule;
use crate::cubecl_launch::{grid, kernel_float};

/// `(value, column)` into `best_*` (kept descending, the lower column first among equal
/// values), where it beats the last kept value. Every kept slot starts at `-inf` and every
/// value offered is finite, so the first `top_k` values are always taken: the host's
/// `largest`, without its count of filled slots.
///
/// The value takes the last slot and moves up past every kept value it exceeds: a new value
/// has the largest column so far, so it stays after the values it equals. The pairs above it
/// are already in order, so the pass over all of them swaps nothing there, and its length is
/// known when the kernel is compiled.
#[cube]
fn offer(
    best_v: &mut Array<f32>,
    best_c: &mut Array<u32>,
    value: f32,
    column: u32,
    #[comptime] top_k: usize,
) {
    if value > best_v[top_k - 1] {
        best_v[top_k - 1] = value;
        best_c[top_k - 1] = column;
        #[unroll]
        for i in 1..top_k {
            let at = top_k - i;
            if best_v[at] > best_v[at - 1] {
                let (v, c) = (best_v[at - 1], best_c[at - 1]);
                best_v[at - 1] = best_v[at];
                best_c[at - 1] = best_c[at];
                best_v[at] = v;
                best_c[at] = c;
            }
        }
    }
}

/// Whether `v` is neither NaN nor infinite.
#[cube]
fn finite(v: f32) -> bool {
    !(v.is_nan() || v.is_inf())
}

#[cube(launch_unchecked)]
fn choose_kernel<F: Float>(
    values: &Tensor<F>,
    logits: &Tensor<F>,
    out: &mut Array<u32>,
    n_tokens: usize,
    width: usize,
    lowest: f32,
    tag: u32,
    #[comptime] top_k: usize,
    #[comptime] n_group: usize,
    #[comptime] topk_group: usize,
    #[define(F)] _dtype: StorageType,
) {
    let t = ABSOLUTE_POS;
    if t >= n_tokens {
        terminate!();
    }
    let (row, column) = (t * values.stride(0), values.stride(1));
    let (l_row, l_column) = (t * logits.stride(0), logits.stride(1));
    let mut all_finite = true;
    for e in 0..width {
        let v = f32::cast_from(values[row + e * column]);
        let l = f32::cast_from(logits[l_row + e * l_column]);
        all_finite = all_finite && finite(v) && finite(l);
    }
    if !all_finite {
        // `width` is no column: the host sees the flag and chooses the batch itself.
        for j in 0..top_k {
            out[t * top_k + j] = u32::cast_from(width) ^ tag;
        }
        terminate!();
    }
    let mut best_v = Array::<f32>::new(top_k);
    let mut best_c = Array::<u32>::new(top_k);
    for j in 0..top_k {
        best_v[j] = lowest;
        best_c[j] = 0u32;
    }
    if comptime![topk_group < n_group] {
        // The best `topk_group` groups by the sums of their two largest values (the host's
        // `top_two_sum`, the lone value of a one-expert group), the lower group on a tie.
        let per_group = width / n_group;
        let mut group_v = Array::<f32>::new(topk_group);
        let mut group_c = Array::<u32>::new(topk_group);
        for j in 0..topk_group {
            group_v[j] = lowest;
            group_c[j] = 0u32;
        }
        for g in 0..n_group {
            let mut first = lowest;
            let mut second = lowest;
            for c in g * per_group..(g + 1) * per_group {
                let v = f32::cast_from(values[row + c * column]);
                if v > first {
                    second = first;
                    first = v;
                } else if v > second {
                    second = v;
                }
            }
            let mut score = first;
            if per_group > 1 {
                score = first + second;
            }
            offer(&mut group_v, &mut group_c, score, u32::cast_from(g), topk_group);
        }
        // The kept groups' columns in increasing order, so that a tie still goes to the lower
        // column.
        for g in 0..n_group {
            let mut kept = false;
            for j in 0..topk_group {
                kept = kept || group_c[j] == u32::cast_from(g);
            }
            if kept {
                for c in g * per_group..(g + 1) * per_group {
                    let v = f32::cast_from(values[row + c * column]);
                    offer(&mut best_v, &mut best_c, v, u32::cast_from(c), top_k);
                }
            }
        }
    } else {
        for c in 0..width {
            let v = f32::cast_from(values[row + c * column]);
            offer(&mut best_v, &mut best_c, v, u32::cast_from(c), top_k);
        }
    }
    for j in 0..top_k {
        out[t * top_k + j] = best_c[j] ^ tag;
    }
}

/// XOR-ed into every column the kernel writes, so that memory it did not write reads as no
/// column: a kernel that failed to compile (as one did on WGPU, which then wrote nothing and
/// reported nothing) leaves zeros or stale bytes, which decode to columns far past any router's
/// `n_experts` (below 2^16, checked before the launch), and the host chooses instead.
const TAG: u32 = 0x5A5A_0000;

/// The readable shape of a router tensor: a float of the kernels' dtypes with two dimensions.
fn dims<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<[usize; 2]> {
    let dims = <[usize; 2]>::try_from(t.meta.shape().to_vec()).ok()?;
    kernel_float(t).then_some(dims)
}

/// Each token's `rule.top_k` experts by `values` (best first), chosen on the device, the
/// read in flight: its `wait` gives the choice, `NotFinite` where a value or a logit of some
/// token is not finite, or `None` where the read is not what the kernel writes. `None` here
/// where the kernel does not apply: a tensor it does not read, no token, a rule the host would
/// refuse (the host's choice then holds the contract and panics as it does), or 2^16 experts
/// or more (see [`TAG`]).
///
/// # Shapes
/// - values, logits: `[n_tokens, n_experts]`; the choice holds `n_tokens · top_k` columns
pub(crate) fn choose<R: CubeRuntime>(
    values: &CubeTensor<R>,
    logits: &CubeTensor<R>,
    rule: &RoutingRule,
) -> Option<ChoiceRead> {
    let shape @ [n_tokens, width] = dims(values)?;
    let (k, groups, kept) = (rule.top_k, rule.n_group, rule.topk_group);
    let allowed = match kept < groups {
        true => kept * (width / groups.max(1)),
        false => width,
    };
    let valid = groups >= 1 && width.is_multiple_of(groups) && (1..=groups).contains(&kept) && k <= allowed;
    if dims(logits)? != shape || n_tokens == 0 || k == 0 || !valid || width >= 1 << 16 {
        return None;
    }
    let len = n_tokens * k;
    let out = values.client.empty(len * size_of::<u32>());
    let (count, dim) = grid(values, n_tokens);
    // SAFETY: `values` and `logits` are read at their strides within `[n_tokens, width]`;
    // `out` holds `n_tokens · top_k` u32s, each thread writing its token's `top_k`; the kernel
    // bounds its token by `n_tokens`; every group lies inside the row (`width` a multiple of
    // `n_group`, checked above).
    unsafe {
        choose_kernel::launch_unchecked(
            &values.client,
            count,
            dim,
            values.clone().into_tensor_arg(),
            logits.clone().into_tensor_arg(),
            ArrayArg::from_raw_parts(out.clone(), len),
            n_tokens,
            width,
            // -inf as an argument: cubecl writes a float constant as its Rust `Debug` text,
            // and `-inf` is no literal in WGSL (cubecl-wgpu 0.10 `compiler/wgsl/base.rs`,
            // `Variable::Constant`; cubecl-ir `variable.rs`), so such a kernel fails to
            // compile there and writes nothing.
            f32::NEG_INFINITY,
            TAG,
            k,
            groups,
            kept,
            values.dtype.into(),
        )
    };
    // The read is issued now, behind the kernel: cubecl's `read_async` submits the copy to
    // the device thread at once (cubecl-runtime 0.10 `client.rs`, `do_read`), and on CUDA its
    // future waits on an event recorded right after the copy (cubecl-cuda `compute/command.rs`,
    // `read_async`, and `compute/sync/fence.rs`), not on the stream: what the caller issues
    // before `wait` runs on the device while the host waits.
    let read = InFlight::new(values.client.clone(), out);
    Some(ChoiceRead::new(move || {
        let bytes = read.wait()?;
        decode(u32::from_bytes(&bytes), len, width)
    }))
}

/// What cubecl's `read_async` returns: a future of the read's bytes.
type ReadFuture<'a> = Pin<Box<dyn Future<Output = Result<Vec<Bytes>, ServerError>> + Send + 'a>>;

/// A read issued and not yet waited for, with the client its future was made from.
///
/// `ComputeClient::read_async` takes `&self` and, in cubecl-runtime 0.10's edition 2024,
/// its returned future may hold that borrow, so the future cannot outlive the client it was
/// called on. The client is kept here, boxed (its address fixed however the struct moves),
/// and the future is dropped before it (fields drop in declaration order).
struct InFlight<R: CubeRuntime> {
    /// Dropped first: it may borrow `*client`.
    read: ReadFuture<'static>,
    /// Never moved out of its box or dropped while `read` lives.
    client: Box<ComputeClient<R>>,
}

impl<R: CubeRuntime> InFlight<R> {
    /// Issues the read of `handle`'s bytes at once.
    fn new(client: ComputeClient<R>, handle: Handle) -> Self {
        let client = Box::new(client);
        let read: ReadFuture<'_> = Box::pin(client.read_async(vec![handle]));
        // SAFETY: the future borrows at most `*client`, which lives on the heap at a fixed
        // address inside `Self` and is dropped after `read` (declaration order); nothing moves
        // the client out of its box or touches it mutably while `read` lives. So extending
        // the borrow to the struct's lifetime never lets it dangle.
        let read = unsafe { std::mem::transmute::<ReadFuture<'_>, ReadFuture<'static>>(read) };
        Self { read, client }
    }

    /// Waits for the read; `None` if it failed.
    fn wait(self) -> Option<Bytes> {
        let Self { read, client } = self;
        let bytes = burn_cubecl::cubecl::future::block_on(read);
        drop(client);
        bytes.ok()?.into_iter().next()
    }
}

/// The kernel's `len` columns, untagged; `None` where they are not what it writes.
fn decode(read: &[u32], len: usize, width: usize) -> Option<DeviceChoice> {
    if read.len() < len {
        return None;
    }
    // One pass: the columns untagged and widened, the largest kept. Past `width` the kernel
    // did not write them; at `width` it flagged a token whose values are not all finite.
    let mut largest = 0u32;
    let indices: Vec<usize> = read[..len]
        .iter()
        .map(|&v| {
            let c = v ^ TAG;
            largest = largest.max(c);
            c as usize
        })
        .collect();
    match (largest as usize).cmp(&width) {
        std::cmp::Ordering::Less => Some(DeviceChoice::Chosen(indices)),
        std::cmp::Ordering::Equal => Some(DeviceChoice::NotFinite),
        std::cmp::Ordering::Greater => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the host makes of a read: the kernel's tagged columns, its flag, and memory it did
    /// not write (zeros, untagged columns, a short read).
    #[test]
    fn a_read_is_a_choice_only_where_the_kernel_wrote_it() {
        let tagged = |columns: &[u32]| columns.iter().map(|c| c ^ TAG).collect::<Vec<_>>();
        assert_eq!(
            decode(&tagged(&[3, 0, 7, 2]), 4, 8),
            Some(DeviceChoice::Chosen(vec![3, 0, 7, 2]))
        );
        assert_eq!(
            decode(&tagged(&[3, 0, 8, 8]), 4, 8),
            Some(DeviceChoice::NotFinite)
        );
        assert_eq!(decode(&[0; 4], 4, 8), None, "zeros: a kernel that did not run");
        assert_eq!(decode(&[3, 0, 7, 2], 4, 8), None, "untagged columns");
        assert_eq!(decode(&tagged(&[3, 0, 7]), 4, 8), None, "a short read");
        assert_eq!(decode(&tagged(&[3, 0, 9, 2]), 4, 8), None, "past the flag");
    }
}
