//! The swap on the CubeCL backends against burn's view: the same values, in a contiguous
//! tensor, from any layout, and under autodiff the gradient swapped back.

use burn::backend::{Autodiff, Wgpu};
use burn::tensor::{Tensor, TensorData};

use super::{swap_dims_contiguous, LayoutKernels};

fn values(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7919) % 1009) as f32 / 13.0 - 30.0).collect()
}

#[test]
fn the_swap_is_burns_view_written_contiguously() {
    let device = Default::default();
    let dims = [2, 5, 3, 7];
    let x = Tensor::<Wgpu, 4>::from_data(TensorData::new(values(2 * 5 * 3 * 7), dims), &device);
    for (name, input) in [
        ("contiguous", x.clone()),
        (
            "swapped view",
            x.clone().swap_dims(1, 2).reshape([2, 3, 5, 7]).swap_dims(1, 2),
        ),
        (
            "last dimension strided",
            x.clone().swap_dims(2, 3).reshape([2, 5, 3, 7]),
        ),
    ] {
        let want = input.clone().swap_dims(1, 2).into_data();
        let got = <Wgpu as LayoutKernels>::swap_middle_dims(input.into_primitive().tensor());
        assert!(got.is_contiguous(), "{name}: not contiguous");
        assert_eq!(got.meta.shape().to_vec(), [2, 3, 5, 7], "{name}");
        let got = Tensor::<Wgpu, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(got));
        assert_eq!(got.into_data(), want, "{name}");
    }
    // Under autodiff the gradient goes back through the same swap: `sum(w ⊙ swap(x))` has
    // the gradient `swap⁻¹(w)`.
    let x = Tensor::<Autodiff<Wgpu>, 4>::from_data(TensorData::new(values(2 * 5 * 3 * 7), dims), &device)
        .require_grad();
    let w = Tensor::<Autodiff<Wgpu>, 4>::from_data(
        TensorData::new(values(2 * 3 * 5 * 7).into_iter().rev().collect(), [2, 3, 5, 7]),
        &device,
    );
    let grads = (swap_dims_contiguous(x.clone()) * w.clone()).sum().backward();
    let got = x.grad(&grads).expect("x's gradient").into_data();
    assert_eq!(got, w.inner().swap_dims(1, 2).into_data());
}
