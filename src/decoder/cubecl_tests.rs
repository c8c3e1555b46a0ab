//! The norm's kernels (`cubecl_norm.rs`) against the composed forms on WGPU, contiguous and
//! strided, at a width that is no multiple of the cube's threads and one far wider than them;
//! and the norm under `Autodiff<Wgpu>` (one node) against burn's ops recorded one by one:
//! output and both gradients.

use burn::backend::{Autodiff, Wgpu};
use burn::tensor::{Distribution, Tensor, TensorPrimitive};

use super::{rms_norm_backward_composed, rms_norm_composed, DecoderKernels};
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
            let (want_dx, want_dw) = rms_norm_backward_composed::<Wgpu>(p(&x), w.clone(), p(&grad), eps);
            let (got_dx, got_dw) =
                <Wgpu as DecoderKernels>::rms_norm_backward(p(&x), w.clone(), p(&grad), eps);
            close_within(&format!("{what}, dx"), got_dx, want_dx, 0.0);
            close_within(&format!("{what}, d weight"), wide(got_dw), wide(want_dw), 0.0);
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
    close_within("x's gradient", dx, want_dx, 0.0);
    close_within("the weight's gradient", dw, want_dw, 0.0);
}
