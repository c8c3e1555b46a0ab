//! The norm's kernels (`cubecl_norm.rs`) against the composed forms on WGPU, contiguous and
//! strided, at a width that is no multiple of the cube's threads and one far wider than them;
//! and the norm under `Autodiff<Wgpu>` (one node) against burn's ops recorded one by one:
//! output and both gradients. Attention's weights, the rotations and the dense blocks' SwiGLU
//! likewise.

use burn::backend::{Autodiff, Wgpu};
use burn::tensor::{Distribution, Tensor, TensorPrimitive};

use super::{rms_norm_backward_composed, rms_norm_composed, DecoderKernels, TailRotation};
use crate::cubecl_test_kernels::{close_within, p, strided};

fn random(shape: [usize; 2], scale: f64) -> Tensor<Wgpu, 2> {
    Tensor::random(shape, Distribution::Normal(0.0, scale), &Default::default())
}

/// A `[width]` weight as the kernels' operand, and as `[1, width]` for the comparison.
fn weight(width: usize) -> Tensor<Wgpu, 1> {
    Tensor::random([width], Distribution::Uniform(0.5, 1.5), &Default::default())
}

fn wide(t: burn::tensor::ops::FloatTensor<Wgpu>) -> burn::tensor::ops::FloatTensor<Wgpu> {
    let t = Tensor::<Wgpu, 1>::from_primitive(TensorPrimitive::Float(t));
    let width = t.dims()[0];
    t.reshape([1, width]).into_primitive().tensor()
}

#[test]
fn the_norm_kernels_match_the_composed_forms() {
    let eps = 1e-6;
    for (rows, width) in [(37, 29), (5, 1000)] {
        let x = random([rows, width], 2.0);
        let grad = random([rows, width], 1.0);
        let w = weight(width).into_primitive().tensor();
        for (layout, x, grad) in [
            ("contiguous", x.clone(), grad.clone()),
            ("strided", strided(&x), strided(&grad)),
        ] {
            let what = format!("[{rows}, {width}], {layout}");
            let want = rms_norm_composed::<Wgpu>(p(&x), w.clone(), eps);
            let got = super::cubecl_norm::rms_norm(&p(&x), &w, eps).expect("the kernel reads them");
            close_within(&what, got, want, 0.0);
            let (want_dx, want_dw) =
                rms_norm_backward_composed::<Wgpu>(p(&x), w.clone(), p(&grad), eps, true);
            let (got_dx, got_dw) =
                <Wgpu as DecoderKernels>::rms_norm_backward(p(&x), w.clone(), p(&grad), eps, true);
            close_within(&format!("{what}, dx"), got_dx, want_dx.clone(), 0.0);
            let (got_dw, want_dw) = (got_dw.expect("asked for"), want_dw.expect("asked for"));
            close_within(&format!("{what}, d weight"), wide(got_dw), wide(want_dw), 0.0);
            // A frozen weight: the same `dx`, and no weight gradient made.
            let (got_dx, got_dw) =
                <Wgpu as DecoderKernels>::rms_norm_backward(p(&x), w.clone(), p(&grad), eps, false);
            close_within(&format!("{what}, dx without d weight"), got_dx, want_dx, 0.0);
            assert!(got_dw.is_none(), "{what}: a weight gradient nobody asked for");
        }
    }
}

/// The node against the composed graph: output, `x`'s gradient and the weight's, for a loss
/// that weighs every output differently.
#[test]
fn the_norm_node_matches_burns_ops_recorded_one_by_one() {
    type A = Autodiff<Wgpu>;
    assert!(<A as DecoderKernels>::rms_norm_node());
    let (rows, width, eps) = (23, 96, 1e-5);
    let device = Default::default();
    let x0 = Tensor::<A, 2>::random([rows, width], Distribution::Normal(0.0, 3.0), &device);
    let w0 = Tensor::<A, 1>::random([width], Distribution::Uniform(0.5, 1.5), &device);
    let g = Tensor::<A, 2>::random([rows, width], Distribution::Default, &device);
    let run = |node: bool| {
        let (x, w) = (x0.clone().require_grad(), w0.clone().require_grad());
        let (xp, wp) = (
            x.clone().into_primitive().tensor(),
            w.clone().into_primitive().tensor(),
        );
        let y = match node {
            true => <A as DecoderKernels>::rms_norm(xp, wp, eps),
            false => rms_norm_composed::<A>(xp, wp, eps),
        };
        let y = Tensor::<A, 2>::from_primitive(TensorPrimitive::Float(y));
        let grads = (y.clone() * g.clone()).sum().backward();
        let dx = x.grad(&grads).expect("x's gradient");
        let dw = w.grad(&grads).expect("the weight's gradient").reshape([1, width]);
        [y.inner(), dx, dw].map(|t| t.into_primitive().tensor())
    };
    let [y, dx, dw] = run(true);
    let [want_y, want_dx, want_dw] = run(false);
    close_within("output", y, want_y, 0.0);
    close_within("x's gradient", dx, want_dx.clone(), 0.0);
    close_within("the weight's gradient", dw, want_dw, 0.0);
    // A frozen weight (as under adapters): the node asks for no weight gradient, and `x`'s is
    // the same.
    let x = x0.clone().require_grad();
    let y = <A as DecoderKernels>::rms_norm(
        x.clone().into_primitive().tensor(),
        w0.clone().into_primitive().tensor(),
        eps,
    );
    let grads = (Tensor::<A, 2>::from_primitive(TensorPrimitive::Float(y)) * g.clone())
        .sum()
        .backward();
    assert!(w0.grad(&grads).is_none(), "a frozen weight got a gradient");
    let dx = x.grad(&grads).expect("x's gradient").into_primitive().tensor();
    close_within("x's gradient, the weight frozen", dx, want_dx, 0.0);
}

/// The dense blocks' SwiGLU under `Autodiff<Wgpu>` as the models call it, on halves given apart
/// (`gated_silu_of`: one node over both) and on `[gate | up]` whole (`gated_silu`), against
/// burn's `silu(gate) · up` recorded one by one: output and both halves' gradients, for a loss
/// that weighs every output differently, at a width no multiple of a cube's threads.
#[test]
fn the_gated_silu_node_matches_burns_ops_recorded_one_by_one() {
    type A = Autodiff<Wgpu>;
    assert!(<A as DecoderKernels>::gated_silu_node() && <A as DecoderKernels>::gated_silu_pair_node());
    let device = Default::default();
    let random = |sd| Tensor::<A, 3>::random([3, 7, 45], Distribution::Normal(0.0, sd), &device);
    super::gated::assert_forms_agree(&random(3.0), &random(2.0), &random(1.0), 2e-6);
}

/// A `[rows, seq, keys]` mask that hides the keys after each query's column (the queries the
/// last `seq` of `keys` columns) and, row by row, a scattering of others, never a query's own
/// column: no row is hidden whole.
fn mask(rows: usize, seq: usize, keys: usize) -> Tensor<Wgpu, 3, burn::tensor::Bool> {
    let hidden: Vec<bool> = (0..rows * seq * keys)
        .map(|i| {
            let (r, q, k) = (i / (seq * keys), i / keys % seq, i % keys);
            let column = keys - seq + q;
            k > column || (k != column && (k * 7 + q * 3 + r * 5) % 4 == 0)
        })
        .collect();
    Tensor::from_data(
        burn::tensor::TensorData::new(hidden, [rows, seq, keys]),
        &Default::default(),
    )
}

fn flat(t: burn::tensor::ops::FloatTensor<Wgpu>) -> burn::tensor::ops::FloatTensor<Wgpu> {
    let t = Tensor::<Wgpu, 4>::from_primitive(TensorPrimitive::Float(t));
    let [b, h, q, k] = t.dims();
    t.reshape([b * h * q, k]).into_primitive().tensor()
}

/// Random scores of `shape` with standard deviation `sd`, contiguous and the same values in a
/// layout whose keys are not adjacent (a transposed view).
fn score_layouts(shape: [usize; 4], sd: f64) -> (Tensor<Wgpu, 4>, Tensor<Wgpu, 4>) {
    let device = Default::default();
    let contiguous = Tensor::<Wgpu, 4>::random(shape, Distribution::Normal(0.0, sd), &device);
    let transposed =
        Tensor::<Wgpu, 4>::from_data(contiguous.clone().swap_dims(2, 3).into_data(), &device).swap_dims(2, 3);
    (contiguous, transposed)
}

/// Attention's weights and their backward (`cubecl_softmax.rs`) against the composed forms:
/// one mask row for every batch row and one each, contiguous scores and a transposed view,
/// rows shorter than the cube's threads and longer, and scores whose scaled values overflow an
/// unshifted `exp`.
#[test]
fn the_attention_softmax_kernels_match_the_composed_forms() {
    use super::softmax::{attention_softmax_backward_composed, attention_softmax_composed};
    let device = Default::default();
    for (batch, heads, seq, keys, rows, sd) in [(2, 3, 5, 7, 1, 1.0), (2, 4, 6, 70, 2, 100.0)] {
        let scale = 0.3;
        let (contiguous, transposed) = score_layouts([batch, heads, seq, keys], sd);
        let hidden = mask(rows, seq, keys).into_primitive();
        let grad = Tensor::<Wgpu, 4>::random([batch, heads, seq, keys], Distribution::Default, &device);
        for (layout, scores) in [("contiguous", contiguous.clone()), ("strided", transposed)] {
            let what = format!("[{batch}, {heads}, {seq}, {keys}], mask rows {rows}, {layout}");
            let scores = scores.into_primitive().tensor();
            let want = attention_softmax_composed::<Wgpu>(scores.clone(), Some(hidden.clone()), scale);
            let got = super::cubecl_softmax::attention_softmax(&scores, &hidden, scale)
                .expect("the kernel reads them");
            close_within(&what, flat(got), flat(want.clone()), 0.0);
            let want_d = attention_softmax_backward_composed::<Wgpu>(
                want.clone(),
                grad.clone().into_primitive().tensor(),
                scale,
            );
            // The gradient as autodiff hands it over may be a view as well.
            let grad_t = Tensor::<Wgpu, 4>::from_data(grad.clone().swap_dims(2, 3).into_data(), &device)
                .swap_dims(2, 3);
            for (g_layout, g) in [("contiguous", grad.clone()), ("strided", grad_t)] {
                let got_d = <Wgpu as DecoderKernels>::attention_softmax_backward(
                    want.clone(),
                    g.into_primitive().tensor(),
                    scale,
                );
                close_within(
                    &format!("{what}, gradient {g_layout}"),
                    flat(got_d),
                    flat(want_d.clone()),
                    0.0,
                );
            }
        }
    }
}

/// The weights under `Autodiff<Wgpu>` (one node) against burn's ops recorded one by one: the
/// weights and the scores' gradient, for a loss that weighs every weight differently.
#[test]
fn the_attention_softmax_node_matches_burns_ops_recorded_one_by_one() {
    use super::softmax::attention_softmax_composed;
    type A = Autodiff<Wgpu>;
    assert!(<A as DecoderKernels>::attention_softmax_node());
    let (batch, heads, seq, keys, scale) = (3, 2, 9, 12, 0.25);
    let device = Default::default();
    let s0 = Tensor::<A, 4>::random([batch, heads, seq, keys], Distribution::Normal(0.0, 4.0), &device);
    let g = Tensor::<A, 4>::random([batch, heads, seq, keys], Distribution::Default, &device);
    let hidden = mask(batch, seq, keys).into_primitive();
    let run = |node: bool| {
        let s = s0.clone().require_grad();
        let sp = s.clone().into_primitive().tensor();
        let y = match node {
            true => <A as DecoderKernels>::attention_softmax(sp, Some(hidden.clone()), scale),
            false => attention_softmax_composed::<A>(sp, Some(hidden.clone()), scale),
        };
        let y = Tensor::<A, 4>::from_primitive(TensorPrimitive::Float(y));
        let grads = (y.clone() * g.clone()).sum().backward();
        let ds = s.grad(&grads).expect("the scores' gradient");
        [y.inner(), ds].map(|t| flat(t.into_primitive().tensor()))
    };
    let [y, ds] = run(true);
    let [want_y, want_ds] = run(false);
    close_within("weights", y, want_y, 0.0);
    close_within("scores' gradient", ds, want_ds, 0.0);
}

/// `[batch, heads, seq]` sink shares as `[batch · heads, seq]`.
fn flat3(t: burn::tensor::ops::FloatTensor<Wgpu>) -> burn::tensor::ops::FloatTensor<Wgpu> {
    let t = Tensor::<Wgpu, 3>::from_primitive(TensorPrimitive::Float(t));
    let [b, h, q] = t.dims();
    t.reshape([b * h, q]).into_primitive().tensor()
}

/// The weights with GPT-OSS's sinks and their backward (`cubecl_softmax.rs`'s second form)
/// against the composed forms, on the shapes and layouts of the test above: the weights, each
/// row's sink share, the scores' gradient and the sinks'. Each head's sink is set so that one
/// row's share is one half (asserted), so a kernel that left the sink out of the maximum or
/// the sum, or dropped its term of the gradient, fails.
#[test]
fn the_attention_softmax_sinks_kernels_match_the_composed_forms() {
    use super::softmax::{attention_softmax_sinks_backward_composed, attention_softmax_sinks_composed};
    let device = Default::default();
    for (batch, heads, seq, keys, rows, sd) in [(2, 3, 5, 7, 1, 1.0), (2, 4, 6, 70, 2, 100.0)] {
        let scale = 0.3;
        let (contiguous, transposed) = score_layouts([batch, heads, seq, keys], sd);
        // Each head's sink is the log-sum-exp of its last query's visible scaled scores in
        // batch row 0, so that row's share is one half whatever the draw.
        let values = contiguous.clone().into_data().to_vec::<f32>().unwrap();
        let last = seq - 1;
        let sinks: Vec<f32> = (0..heads)
            .map(|h| {
                let column = keys - seq + last;
                let visible: Vec<f64> = (0..keys)
                    .filter(|&k| !(k > column || (k != column && (k * 7 + last * 3) % 4 == 0)))
                    .map(|k| values[(h * seq + last) * keys + k] as f64 * scale)
                    .collect();
                let max = visible.iter().fold(f64::MIN, |m, &v| m.max(v));
                (max + visible.iter().map(|v| (v - max).exp()).sum::<f64>().ln()) as f32
            })
            .collect();
        let sinks = Tensor::<Wgpu, 1>::from_data(burn::tensor::TensorData::new(sinks, [heads]), &device)
            .into_primitive()
            .tensor();
        let hidden = mask(rows, seq, keys).into_primitive();
        let grad = Tensor::<Wgpu, 4>::random([batch, heads, seq, keys], Distribution::Default, &device)
            .into_primitive()
            .tensor();
        for (layout, scores) in [("contiguous", contiguous.clone()), ("strided", transposed)] {
            let what = format!("[{batch}, {heads}, {seq}, {keys}], mask rows {rows}, {layout}");
            let scores = scores.into_primitive().tensor();
            let (want, want_shares) = attention_softmax_sinks_composed::<Wgpu>(
                scores.clone(),
                Some(hidden.clone()),
                sinks.clone(),
                scale,
            );
            let shares = Tensor::<Wgpu, 3>::from_primitive(TensorPrimitive::Float(want_shares.clone()));
            let between = shares
                .into_data()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .filter(|&&p| (0.02..0.98).contains(&p))
                .count();
            assert!(between > 0, "{what}: no sink share is far from 0 and 1");
            let (got, got_shares) =
                super::cubecl_softmax::attention_softmax_sinks(&scores, &hidden, &sinks, scale)
                    .expect("the kernel reads them");
            close_within(&format!("{what}, weights"), flat(got), flat(want.clone()), 0.0);
            close_within(
                &format!("{what}, sink shares"),
                flat3(got_shares),
                flat3(want_shares.clone()),
                0.0,
            );
            let (want_ds, want_dsinks) = attention_softmax_sinks_backward_composed::<Wgpu>(
                want.clone(),
                want_shares.clone(),
                grad.clone(),
                scale,
            );
            let (got_ds, got_dsinks) = <Wgpu as DecoderKernels>::attention_softmax_sinks_backward(
                want.clone(),
                want_shares,
                grad.clone(),
                scale,
            );
            close_within(
                &format!("{what}, scores' gradient"),
                flat(got_ds),
                flat(want_ds),
                0.0,
            );
            close_within(
                &format!("{what}, sinks' gradient"),
                wide(got_dsinks),
                wide(want_dsinks),
                0.0,
            );
        }
    }
}

/// The weights with sinks under `Autodiff<Wgpu>` (one node over the scores and the sinks)
/// against burn's ops recorded one by one: the weights and both gradients.
#[test]
fn the_attention_softmax_sinks_node_matches_burns_ops_recorded_one_by_one() {
    use super::softmax::attention_softmax_sinks_composed;
    type A = Autodiff<Wgpu>;
    let (batch, heads, seq, keys, scale) = (3, 2, 9, 12, 0.25);
    let device = Default::default();
    let s0 = Tensor::<A, 4>::random([batch, heads, seq, keys], Distribution::Normal(0.0, 4.0), &device);
    let k0 = Tensor::<A, 1>::random([heads], Distribution::Normal(1.0, 1.0), &device);
    let g = Tensor::<A, 4>::random([batch, heads, seq, keys], Distribution::Default, &device);
    let hidden = mask(batch, seq, keys).into_primitive();
    let run = |node: bool| {
        let (s, k) = (s0.clone().require_grad(), k0.clone().require_grad());
        let (sp, kp) = (
            s.clone().into_primitive().tensor(),
            k.clone().into_primitive().tensor(),
        );
        let (y, _) = match node {
            true => <A as DecoderKernels>::attention_softmax_sinks(sp, Some(hidden.clone()), kp, scale),
            false => attention_softmax_sinks_composed::<A>(sp, Some(hidden.clone()), kp, scale),
        };
        let y = Tensor::<A, 4>::from_primitive(TensorPrimitive::Float(y));
        let grads = (y.clone() * g.clone()).sum().backward();
        let ds = s.grad(&grads).expect("the scores' gradient");
        let dk = k.grad(&grads).expect("the sinks' gradient");
        (
            [y.inner(), ds].map(|t| flat(t.into_primitive().tensor())),
            wide(dk.into_primitive().tensor()),
        )
    };
    let ([y, ds], dk) = run(true);
    let ([want_y, want_ds], want_dk) = run(false);
    close_within("weights", y, want_y, 0.0);
    close_within("scores' gradient", ds, want_ds, 0.0);
    close_within("sinks' gradient", dk, want_dk, 0.0);
}

/// `[rows, seq, head_dim]` tables whose halves differ (the kernels must read each value's own
/// sine, not rely on the halves repeating as the models' tables do).
fn table(rows: usize, seq: usize, head_dim: usize) -> burn::tensor::ops::FloatTensor<Wgpu> {
    Tensor::<Wgpu, 3>::random(
        [rows, seq, head_dim],
        Distribution::Uniform(-1.0, 1.0),
        &Default::default(),
    )
    .into_primitive()
    .tensor()
}

fn flat4(t: burn::tensor::ops::FloatTensor<Wgpu>) -> burn::tensor::ops::FloatTensor<Wgpu> {
    let t = Tensor::<Wgpu, 4>::from_primitive(TensorPrimitive::Float(t));
    let [b, s, h, d] = t.dims();
    t.reshape([b * s * h, d]).into_primitive().tensor()
}

type Rotation = fn(
    burn::tensor::ops::FloatTensor<Wgpu>,
    burn::tensor::ops::FloatTensor<Wgpu>,
    burn::tensor::ops::FloatTensor<Wgpu>,
) -> burn::tensor::ops::FloatTensor<Wgpu>;

/// Each rotation's kernels and composed twins, forward then transpose, by name.
fn rotations() -> [(&'static str, [Rotation; 4]); 2] {
    use super::{
        rotate_half_seq_major_backward_composed as half_back, rotate_half_seq_major_composed as half,
        rotate_pairs_seq_major_backward_composed as pairs_back, rotate_pairs_seq_major_composed as pairs,
    };
    [
        (
            "rotate_half",
            [
                <Wgpu as DecoderKernels>::rotate_half_seq_major,
                half::<Wgpu>,
                <Wgpu as DecoderKernels>::rotate_half_seq_major_backward,
                half_back::<Wgpu>,
            ],
        ),
        (
            "pairs",
            [
                <Wgpu as DecoderKernels>::rotate_pairs_seq_major,
                pairs::<Wgpu>,
                <Wgpu as DecoderKernels>::rotate_pairs_seq_major_backward,
                pairs_back::<Wgpu>,
            ],
        ),
    ]
}

/// A random `x` of `dims`, contiguous and as a view with other strides (the same values laid
/// out with the middle dimensions swapped), by name.
fn rotary_inputs(dims: [usize; 4]) -> [(&'static str, Tensor<Wgpu, 4>); 2] {
    let device = Default::default();
    let contiguous = Tensor::<Wgpu, 4>::random(dims, Distribution::Default, &device);
    let view =
        Tensor::<Wgpu, 4>::from_data(contiguous.clone().swap_dims(1, 2).into_data(), &device).swap_dims(1, 2);
    [("contiguous", contiguous), ("strided", view)]
}

/// Both rotations and their transposes (`cubecl_rotary.rs`) against the composed forms: tables
/// of one row and of one per batch row, `x` contiguous and a view with other strides.
#[test]
fn the_rotary_kernels_match_the_composed_forms() {
    for (name, [kernel, twin, kernel_back, twin_back]) in rotations() {
        rotary_kernels_match(name, kernel, twin, kernel_back, twin_back);
    }
}

fn rotary_kernels_match(
    name: &str,
    kernel: Rotation,
    twin: Rotation,
    kernel_back: Rotation,
    twin_back: Rotation,
) {
    for (batch, seq, heads, head_dim, rows) in [(2, 5, 3, 8, 1), (3, 7, 2, 12, 3)] {
        let (cos, sin) = (table(rows, seq, head_dim), table(rows, seq, head_dim));
        for (layout, x) in rotary_inputs([batch, seq, heads, head_dim]) {
            let what = format!("{name}, [{batch}, {seq}, {heads}, {head_dim}], table rows {rows}, {layout}");
            let x = x.into_primitive().tensor();
            let want = twin(x.clone(), cos.clone(), sin.clone());
            let got = kernel(x.clone(), cos.clone(), sin.clone());
            close_within(&what, flat4(got), flat4(want), 0.0);
            let want = twin_back(x.clone(), cos.clone(), sin.clone());
            let got = kernel_back(x, cos.clone(), sin.clone());
            close_within(&format!("{what}, transpose"), flat4(got), flat4(want), 0.0);
        }
    }
}

/// Both rotations written head-major in the kernel's pass (`rotate_to_heads`) against the
/// composed rotation and burn's swap, `x` contiguous and strided, tables of one row and of one
/// per batch row; the output is the kernel's own contiguous head-major tensor (not a view of a
/// fallback); and the transpose kernel on the head-major gradient seen sequence-major, as the
/// node's backward reads it, against the composed transpose.
#[test]
fn the_rotation_to_heads_writes_head_major_and_its_transpose_reads_it_there() {
    use burn::tensor::ops::FloatTensorOps;
    let device = Default::default();
    for ((name, [_, twin, kernel_back, twin_back]), pairs) in rotations().into_iter().zip([false, true]) {
        for (batch, seq, heads, head_dim, rows) in [(2, 5, 3, 8, 1), (3, 7, 2, 12, 3)] {
            let (cos, sin) = (table(rows, seq, head_dim), table(rows, seq, head_dim));
            for (layout, x) in rotary_inputs([batch, seq, heads, head_dim]) {
                let what =
                    format!("{name}, [{batch}, {seq}, {heads}, {head_dim}], table rows {rows}, {layout}");
                let x = x.into_primitive().tensor();
                let want = <Wgpu>::float_swap_dims(twin(x.clone(), cos.clone(), sin.clone()), 1, 2);
                let got =
                    <Wgpu as DecoderKernels>::rotate_seq_major_to_heads(x, cos.clone(), sin.clone(), pairs);
                assert!(
                    got.is_contiguous(),
                    "{what}: the kernel's output is head-major and whole"
                );
                assert_eq!(got.meta.shape().to_vec(), [batch, heads, seq, head_dim], "{what}");
                close_within(&what, flat4(got), flat4(want), 0.0);
            }
            let grad =
                Tensor::<Wgpu, 4>::random([batch, heads, seq, head_dim], Distribution::Default, &device)
                    .into_primitive()
                    .tensor();
            let seen = <Wgpu>::float_swap_dims(grad, 1, 2);
            let want = twin_back(seen.clone(), cos.clone(), sin.clone());
            let got = kernel_back(seen, cos, sin);
            close_within(
                &format!("{name}, head-major gradient"),
                flat4(got),
                flat4(want),
                0.0,
            );
        }
    }
}

/// The rotation under `Autodiff<Wgpu>` (one node, sequence- or head-major) against burn's ops
/// recorded one by one: output and `x`'s gradient; and with tracked tables, recorded composed, so that the tables
/// get their gradient.
#[test]
fn the_rotary_node_matches_burns_ops_recorded_one_by_one() {
    type A = Autodiff<Wgpu>;
    assert!(<A as DecoderKernels>::rotary_node());
    use burn::tensor::ops::FloatTensorOps;
    let ops: [(&str, TrackedRotation, TrackedRotation); 4] = [
        (
            "rotate_half",
            <A as DecoderKernels>::rotate_half_seq_major,
            super::rotate_half_seq_major_composed::<A>,
        ),
        (
            "pairs",
            <A as DecoderKernels>::rotate_pairs_seq_major,
            super::rotate_pairs_seq_major_composed::<A>,
        ),
        (
            "rotate_half to heads",
            |x, c, s| <A as DecoderKernels>::rotate_seq_major_to_heads(x, c, s, false),
            |x, c, s| A::float_swap_dims(super::rotate_half_seq_major_composed::<A>(x, c, s), 1, 2),
        ),
        (
            "pairs to heads",
            |x, c, s| <A as DecoderKernels>::rotate_seq_major_to_heads(x, c, s, true),
            |x, c, s| A::float_swap_dims(super::rotate_pairs_seq_major_composed::<A>(x, c, s), 1, 2),
        ),
    ];
    for (name, node_op, composed) in ops {
        rotary_node_matches(name, node_op, composed, (0, 0));
    }
}

/// A rotation under `Autodiff<Wgpu>`: `(x, cos, sin) → rotated`.
type TrackedRotation = fn(
    burn::tensor::ops::FloatTensor<Autodiff<Wgpu>>,
    burn::tensor::ops::FloatTensor<Autodiff<Wgpu>>,
    burn::tensor::ops::FloatTensor<Autodiff<Wgpu>>,
) -> burn::tensor::ops::FloatTensor<Autodiff<Wgpu>>;

/// `(skip, pass)`: the values of each head the op leaves out, and those after them it keeps
/// unrotated (the tables are as wide as the rest).
fn rotary_node_matches(
    name: &str,
    node_op: TrackedRotation,
    composed: TrackedRotation,
    (skip, pass): (usize, usize),
) {
    type A = Autodiff<Wgpu>;
    let (batch, seq, heads, head_dim) = (2, 6, 4, 10);
    let rotated = head_dim - skip - pass;
    let device = Default::default();
    let x0 = Tensor::<A, 4>::random([batch, seq, heads, head_dim], Distribution::Default, &device);
    let g = Tensor::<A, 4>::random(
        [batch, seq, heads, head_dim - skip],
        Distribution::Default,
        &device,
    );
    let tables = [table(1, seq, rotated), table(1, seq, rotated)]
        .map(|t| Tensor::<A, 3>::from_inner(Tensor::from_primitive(TensorPrimitive::Float(t))));
    let run = |node: bool, track_tables: bool| {
        let x = x0.clone().require_grad();
        let [cos, sin] = tables.clone().map(|t| match track_tables {
            true => t.require_grad(),
            false => t,
        });
        let [xp, c, s] = [
            x.clone().into_primitive().tensor(),
            cos.clone().into_primitive().tensor(),
            sin.clone().into_primitive().tensor(),
        ];
        let y = match node {
            true => node_op(xp, c, s),
            false => composed(xp, c, s),
        };
        let y = Tensor::<A, 4>::from_primitive(TensorPrimitive::Float(y));
        // The same weights by position whatever the output's layout (sequence- or head-major).
        let g = g.clone().reshape(y.dims());
        let grads = (y.clone() * g).sum().backward();
        let dx = x.grad(&grads).expect("x's gradient");
        let dsin = sin
            .grad(&grads)
            .map(|d| d.reshape([seq, rotated]).into_primitive().tensor());
        ([y.inner(), dx].map(|t| flat4(t.into_primitive().tensor())), dsin)
    };
    let ([y, dx], none) = run(true, false);
    assert!(none.is_none(), "untracked tables got a gradient");
    let ([want_y, want_dx], _) = run(false, false);
    close_within(&format!("{name}: output"), y, want_y, 0.0);
    close_within(&format!("{name}: x's gradient"), dx, want_dx, 0.0);
    let (_, dsin) = run(true, true);
    let (_, want_dsin) = run(false, true);
    close_within(
        &format!("{name}: the sine table's gradient"),
        dsin.expect("tracked tables get a gradient"),
        want_dsin.unwrap(),
        0.0,
    );
}

/// Latent attention's rotations (`rotate_tail_to_heads`: a head's first `skip` values left
/// out, the next `pass` kept, the rest rotated in the `rotate_half` form or DeepSeek's
/// interleaved one, written head-major) against their composed twin built from burn's ops: the
/// kernel's output (its own contiguous head-major tensor) for `x` contiguous and strided,
/// tables of one row and of one per batch row; and the transpose kernel on a head-major
/// gradient against the composed transpose (zeros where the values were left out). A kernel
/// that rotated the kept values, read the wrong half of the tables, left DeepSeek's pairs
/// interleaved, or read the values it should leave out fails.
#[test]
fn the_tail_rotation_kernels_match_the_composed_forms() {
    use super::rotary::rotate_tail_to_heads_backward_composed;
    let device = Default::default();
    for interleaved in [false, true] {
        for (skip, pass) in [(0, 0), (0, 6), (4, 0), (3, 2)] {
            let form = TailRotation {
                interleaved,
                skip,
                pass,
            };
            for (batch, seq, heads, rotated, rows) in [(2, 5, 3, 8, 1), (3, 7, 2, 12, 3)] {
                let (width, out) = (skip + pass + rotated, pass + rotated);
                let (cos, sin) = (table(rows, seq, rotated), table(rows, seq, rotated));
                let what = format!("{form:?}, [{batch}, {seq}, {heads}, {width}], table rows {rows}");
                for (layout, x) in rotary_inputs([batch, seq, heads, width]) {
                    let x = x.into_primitive().tensor();
                    let want = tail_reference::<Wgpu>(x.clone(), cos.clone(), sin.clone(), form);
                    let got =
                        <Wgpu as DecoderKernels>::rotate_tail_to_heads(x, cos.clone(), sin.clone(), form);
                    assert!(
                        got.is_contiguous(),
                        "{what}, {layout}: the kernel's output is head-major and whole"
                    );
                    assert_eq!(got.meta.shape().to_vec(), [batch, heads, seq, out], "{what}");
                    close_within(&format!("{what}, {layout}"), flat4(got), flat4(want), 0.0);
                }
                let grad =
                    Tensor::<Wgpu, 4>::random([batch, heads, seq, out], Distribution::Default, &device)
                        .into_primitive()
                        .tensor();
                let want = rotate_tail_to_heads_backward_composed::<Wgpu>(
                    grad.clone(),
                    cos.clone(),
                    sin.clone(),
                    form,
                );
                let got = <Wgpu as DecoderKernels>::rotate_tail_to_heads_backward(grad, cos, sin, form);
                assert_eq!(got.meta.shape().to_vec(), [batch, seq, heads, width], "{what}");
                close_within(&format!("{what}, transpose"), flat4(got), flat4(want), 0.0);
            }
        }
    }
}

/// The composed rotation with the `rotate_half` form composed too (the default runs the
/// backend's rotation, which on WGPU is the kernel under test).
fn tail_reference<B: DecoderKernels>(
    x: burn::tensor::ops::FloatTensor<B>,
    cos: burn::tensor::ops::FloatTensor<B>,
    sin: burn::tensor::ops::FloatTensor<B>,
    form: TailRotation,
) -> burn::tensor::ops::FloatTensor<B> {
    if form.interleaved {
        return super::rotate_tail_to_heads_composed::<B>(x, cos, sin, form);
    }
    let TailRotation { skip, pass, .. } = form;
    let x = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(x));
    let [b, t, h, d] = x.dims();
    let tail = x
        .clone()
        .slice([0..b, 0..t, 0..h, skip + pass..d])
        .into_primitive()
        .tensor();
    let rotated = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(
        super::rotate_half_seq_major_composed::<B>(tail, cos, sin),
    ));
    let out = match pass {
        0 => rotated,
        _ => Tensor::cat(vec![x.slice([0..b, 0..t, 0..h, skip..skip + pass]), rotated], 3),
    };
    out.swap_dims(1, 2).into_primitive().tensor()
}

/// The rotation under `Autodiff<Wgpu>` (one node) against its composition recorded op by op:
/// output, `x`'s gradient (zero where values are left out), and with tracked tables (recorded
/// composed) the sine table's gradient.
#[test]
fn the_tail_rotation_node_matches_burns_ops_recorded_one_by_one() {
    type A = Autodiff<Wgpu>;
    const HALF_KEPT: TailRotation = TailRotation {
        interleaved: false,
        skip: 0,
        pass: 4,
    };
    const INTERLEAVED_KEPT: TailRotation = TailRotation {
        interleaved: true,
        skip: 0,
        pass: 4,
    };
    const HALF_LEFT_OUT: TailRotation = TailRotation {
        interleaved: false,
        skip: 4,
        pass: 0,
    };
    const INTERLEAVED_LEFT_OUT: TailRotation = TailRotation {
        interleaved: true,
        skip: 4,
        pass: 0,
    };
    let ops: [(&str, TrackedRotation, TrackedRotation, TailRotation); 4] = [
        (
            "rotate_half after 4 kept",
            |x, c, s| <A as DecoderKernels>::rotate_tail_to_heads(x, c, s, HALF_KEPT),
            |x, c, s| tail_reference::<A>(x, c, s, HALF_KEPT),
            HALF_KEPT,
        ),
        (
            "interleaved after 4 kept",
            |x, c, s| <A as DecoderKernels>::rotate_tail_to_heads(x, c, s, INTERLEAVED_KEPT),
            |x, c, s| tail_reference::<A>(x, c, s, INTERLEAVED_KEPT),
            INTERLEAVED_KEPT,
        ),
        (
            "rotate_half after 4 left out",
            |x, c, s| <A as DecoderKernels>::rotate_tail_to_heads(x, c, s, HALF_LEFT_OUT),
            |x, c, s| tail_reference::<A>(x, c, s, HALF_LEFT_OUT),
            HALF_LEFT_OUT,
        ),
        (
            "interleaved after 4 left out",
            |x, c, s| <A as DecoderKernels>::rotate_tail_to_heads(x, c, s, INTERLEAVED_LEFT_OUT),
            |x, c, s| tail_reference::<A>(x, c, s, INTERLEAVED_LEFT_OUT),
            INTERLEAVED_LEFT_OUT,
        ),
    ];
    for (name, node_op, composed, form) in ops {
        rotary_node_matches(name, node_op, composed, (form.skip, form.pass));
    }
}

/// The norm of each row's first columns (`rms_norm_columns`: DeepSeek's latent, read where it
/// lies in its compression) against burn's slice and the composed norm: the output, `x`'s
/// gradient over the whole width (zero after the norm's columns) and the weight's, for `x`
/// contiguous and strided; and under `Autodiff<Wgpu>` (one node) against the slice and the
/// composed norm recorded op by op. A kernel that read past the norm's columns, left the rest
/// of the gradient unwritten or wrote the gradient at the narrower pitch fails.
#[test]
fn the_norm_of_the_first_columns_matches_the_slice_and_the_composed_norm() {
    use burn::tensor::ops::FloatTensorOps;
    let eps = 1e-6;
    let slice = |x: burn::tensor::ops::FloatTensor<Wgpu>, rows: usize, width: usize| {
        <Wgpu as FloatTensorOps<Wgpu>>::float_slice(x, &[(0..rows).into(), (0..width).into()])
    };
    for (rows, width, total) in [(37, 29, 33), (5, 1000, 1064)] {
        let x = random([rows, total], 2.0);
        let grad = random([rows, width], 1.0);
        let w = weight(width).into_primitive().tensor();
        for (layout, x) in [("contiguous", x.clone()), ("strided", strided(&x))] {
            let what = format!("[{rows}, {width} of {total}], {layout}");
            let want = rms_norm_composed::<Wgpu>(slice(p(&x), rows, width), w.clone(), eps);
            let got = <Wgpu as DecoderKernels>::rms_norm_columns(p(&x), w.clone(), eps);
            close_within(&what, got, want, 0.0);
            let (front_dx, want_dw) =
                rms_norm_backward_composed::<Wgpu>(slice(p(&x), rows, width), w.clone(), p(&grad), eps, true);
            let zeros = Tensor::<Wgpu, 2>::zeros([rows, total - width], &Default::default());
            let want_dx = Tensor::cat(
                vec![
                    Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(front_dx)),
                    zeros,
                ],
                1,
            )
            .into_primitive()
            .tensor();
            let (got_dx, got_dw) =
                <Wgpu as DecoderKernels>::rms_norm_columns_backward(p(&x), w.clone(), p(&grad), eps, true);
            close_within(&format!("{what}, dx"), got_dx, want_dx, 0.0);
            close_within(
                &format!("{what}, d weight"),
                wide(got_dw.expect("asked for")),
                wide(want_dw.expect("asked for")),
                0.0,
            );
        }
    }
    type A = Autodiff<Wgpu>;
    let (rows, width, total) = (11, 40, 52);
    let x0 = Tensor::<A, 2>::from_inner(random([rows, total], 2.0));
    let w0 = Tensor::<A, 1>::from_inner(weight(width));
    let weigh = Tensor::<A, 2>::from_inner(random([rows, width], 1.0));
    let run = |node: bool| {
        let (x, w) = (x0.clone().require_grad(), w0.clone().require_grad());
        let (xp, wp) = (
            x.clone().into_primitive().tensor(),
            w.clone().into_primitive().tensor(),
        );
        let y = match node {
            true => <A as DecoderKernels>::rms_norm_columns(xp, wp, eps),
            false => rms_norm_composed::<A>(
                <A as FloatTensorOps<A>>::float_slice(xp, &[(0..rows).into(), (0..width).into()]),
                wp,
                eps,
            ),
        };
        let y = Tensor::<A, 2>::from_primitive(TensorPrimitive::Float(y));
        let grads = (y.clone() * weigh.clone()).sum().backward();
        let dx = x.grad(&grads).expect("x's gradient").into_primitive().tensor();
        let dw = wide(
            w.grad(&grads)
                .expect("the weight's gradient")
                .into_primitive()
                .tensor(),
        );
        [y.inner().into_primitive().tensor(), dx, dw]
    };
    let (got, want) = (run(true), run(false));
    for ((name, got), want) in ["output", "x's gradient", "the weight's gradient"]
        .into_iter()
        .zip(got)
        .zip(want)
    {
        close_within(&format!("node: {name}"), got, want, 0.0);
    }
}
