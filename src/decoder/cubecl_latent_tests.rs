//! Latent attention's keys and values (`cubecl_latent.rs`) against their composed forms on
//! WGPU, each way, the expanded product contiguous and strided; and under `Autodiff<Wgpu>` (one
//! node each) against the composition recorded op by op: outputs and both inputs' gradients.

use burn::backend::{Autodiff, Wgpu};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Distribution, Tensor, TensorPrimitive};

use super::latent::{
    latent_keys_backward_composed, latent_keys_composed, latent_values_backward_composed,
    latent_values_composed,
};
use super::DecoderKernels;
use crate::cubecl_test_kernels::close_within;

/// `[batch, seq, heads, nope, v, rope]`: widths no multiple of a cube's threads, one head and
/// several.
const SHAPES: [[usize; 6]; 2] = [[2, 5, 3, 4, 6, 2], [1, 7, 1, 8, 3, 4]];

fn random<const D: usize>(dims: [usize; D]) -> Tensor<Wgpu, D> {
    Tensor::random(dims, Distribution::Default, &Default::default())
}

fn flat(t: FloatTensor<Wgpu>) -> FloatTensor<Wgpu> {
    let t = Tensor::<Wgpu, 4>::from_primitive(TensorPrimitive::Float(t));
    let [a, b, c, d] = t.dims();
    t.reshape([a * b * c, d]).into_primitive().tensor()
}

/// A random `[batch, seq, heads, width]` tensor contiguous, and the same values as a view of a
/// head-major buffer (other strides), by name.
fn layouts(dims: [usize; 4]) -> [(&'static str, FloatTensor<Wgpu>); 2] {
    let contiguous = random(dims);
    let view = Tensor::<Wgpu, 4>::from_data(
        contiguous.clone().swap_dims(1, 2).into_data(),
        &Default::default(),
    )
    .swap_dims(1, 2);
    [
        ("contiguous", contiguous.into_primitive().tensor()),
        ("strided", view.into_primitive().tensor()),
    ]
}

/// Both ops and both backwards against the composed forms. A kernel that took the values for
/// the keys, read the rotary key of another head or position, or left a gradient's other part
/// unzeroed fails.
#[test]
fn the_latent_kernels_match_the_composed_forms() {
    for [batch, seq, heads, nope, v, rope] in SHAPES {
        let what = format!("[{batch}, {seq}, {heads}], nope {nope}, v {v}, rope {rope}");
        let k_rot = random([batch, 1, seq, rope]).into_primitive().tensor();
        for (layout, kv) in layouts([batch, seq, heads, nope + v]) {
            let keys = <Wgpu as DecoderKernels>::latent_keys(kv.clone(), k_rot.clone(), nope);
            assert!(
                keys.is_contiguous(),
                "{what}, {layout}: the keys are written whole"
            );
            let want = latent_keys_composed::<Wgpu>(kv.clone(), k_rot.clone(), nope);
            close_within(&format!("{what}, {layout}: keys"), flat(keys), flat(want), 0.0);
            let values = <Wgpu as DecoderKernels>::latent_values(kv.clone(), nope);
            assert!(
                values.is_contiguous(),
                "{what}, {layout}: the values are written whole"
            );
            let want = latent_values_composed::<Wgpu>(kv, nope);
            close_within(
                &format!("{what}, {layout}: values"),
                flat(values),
                flat(want),
                0.0,
            );
        }
        for (layout, grad) in layouts([batch, heads, seq, nope + rope]) {
            let (dkv, dk_rot) = <Wgpu as DecoderKernels>::latent_keys_backward(grad.clone(), nope, v);
            let (want_kv, want_rot) = latent_keys_backward_composed::<Wgpu>(grad, nope, v);
            close_within(
                &format!("{what}, {layout}: kv from the keys"),
                flat(dkv),
                flat(want_kv),
                0.0,
            );
            close_within(
                &format!("{what}, {layout}: the rotary key"),
                flat(dk_rot),
                flat(want_rot),
                0.0,
            );
        }
        for (layout, grad) in layouts([batch, heads, seq, v]) {
            let dkv = <Wgpu as DecoderKernels>::latent_values_backward(grad.clone(), nope);
            let want = latent_values_backward_composed::<Wgpu>(grad, nope);
            close_within(
                &format!("{what}, {layout}: kv from the values"),
                flat(dkv),
                flat(want),
                0.0,
            );
        }
    }
}

/// The keys and the values under `Autodiff<Wgpu>` (one node each) against the composition
/// recorded op by op, for a loss that weighs every key and value differently: both outputs,
/// the expanded product's gradient (the sum of the two ops') and the rotary key's.
#[test]
fn the_latent_nodes_match_the_composition_recorded_op_by_op() {
    type A = Autodiff<Wgpu>;
    assert!(<A as DecoderKernels>::latent_node());
    for [batch, seq, heads, nope, v, rope] in SHAPES {
        let what = format!("[{batch}, {seq}, {heads}], nope {nope}, v {v}, rope {rope}");
        let kv0 = Tensor::<A, 4>::from_inner(random([batch, seq, heads, nope + v]));
        let rot0 = Tensor::<A, 4>::from_inner(random([batch, 1, seq, rope]));
        let weigh_keys = Tensor::<A, 4>::from_inner(random([batch, heads, seq, nope + rope]));
        let weigh_values = Tensor::<A, 4>::from_inner(random([batch, heads, seq, v]));
        let run = |node: bool| {
            let (kv, rot) = (kv0.clone().require_grad(), rot0.clone().require_grad());
            let (kp, rp) = (
                kv.clone().into_primitive().tensor(),
                rot.clone().into_primitive().tensor(),
            );
            let (keys, values) = match node {
                true => (
                    <A as DecoderKernels>::latent_keys(kp.clone(), rp, nope),
                    <A as DecoderKernels>::latent_values(kp, nope),
                ),
                false => (
                    latent_keys_composed::<A>(kp.clone(), rp, nope),
                    latent_values_composed::<A>(kp, nope),
                ),
            };
            let [keys, values] =
                [keys, values].map(|t| Tensor::<A, 4>::from_primitive(TensorPrimitive::Float(t)));
            let loss =
                (keys.clone() * weigh_keys.clone()).sum() + (values.clone() * weigh_values.clone()).sum();
            let grads = loss.backward();
            let dkv = kv.grad(&grads).expect("kv's gradient");
            let drot = rot.grad(&grads).expect("the rotary key's gradient");
            [keys.inner(), values.inner(), dkv, drot].map(|t| flat(t.into_primitive().tensor()))
        };
        let (got, want) = (run(true), run(false));
        for ((name, got), want) in ["keys", "values", "kv's gradient", "the rotary key's gradient"]
            .into_iter()
            .zip(got)
            .zip(want)
        {
            close_within(&format!("{what}: {name}"), got, want, 0.0);
        }
    }
}
