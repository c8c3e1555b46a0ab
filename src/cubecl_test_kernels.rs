//! What the tests of the crate's CubeCL kernels share (with `wgpu`): a transposed view of a
//! tensor, and a kernel's output held to its composed twin's.

use burn::backend::Wgpu;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

/// `t`'s primitive, for the kernels and the twins.
pub(crate) fn p(t: &Tensor<Wgpu, 2>) -> FloatTensor<Wgpu> {
    t.clone().into_primitive().tensor()
}

/// `t` laid out as the transpose of a contiguous tensor: the same values at other strides.
pub(crate) fn strided(t: &Tensor<Wgpu, 2>) -> Tensor<Wgpu, 2> {
    let [rows, columns] = t.dims();
    let flipped = Tensor::<Wgpu, 2>::from_data(t.clone().transpose().into_data(), &Default::default());
    let view = flipped.transpose();
    assert_eq!(view.dims(), [rows, columns]);
    view
}

/// The kernel's output against the composed twin's, within 2e-6 of the twin's largest value
/// or of `floor`, whichever is larger. A `floor` of 0 asks for a twin that is not all zeros
/// (a test whose twin is zero would hold any kernel that writes zeros); a larger one is for
/// a twin that is zero but for rounding.
pub(crate) fn close_within(what: &str, got: FloatTensor<Wgpu>, want: FloatTensor<Wgpu>, floor: f32) {
    let got = Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(got));
    let want = Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(want));
    assert_eq!(got.dims(), want.dims(), "{what}");
    let (got, want) = (
        got.into_data().to_vec::<f32>().unwrap(),
        want.into_data().to_vec::<f32>().unwrap(),
    );
    let scale = want.iter().fold(floor, |m, v| m.max(v.abs()));
    assert!(scale > 0.0, "{what}: the twin's output is all zeros");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 2e-6 * scale,
            "{what}: element {i} is {g}, not {w}"
        );
    }
}
