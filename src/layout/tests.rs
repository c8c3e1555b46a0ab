//! The swap against burn's view, values and gradients, on Flex and under autodiff.

use burn::backend::flex::FlexTensor;
use burn::backend::{Autodiff, Flex};
use burn::tensor::{Tensor, TensorData};

use super::{swap_dims_contiguous, LayoutKernels};

fn values(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7919) % 1009) as f32 / 13.0 - 30.0).collect()
}

/// Contiguous inputs, a view that is itself swapped (a gradient's usual shape) and a
/// transposed last dimension: the same values as burn's `swap_dims`, in a contiguous tensor.
#[test]
fn the_swap_gives_burns_values_contiguously_from_any_layout() {
    let device = Default::default();
    let dims = [2, 5, 3, 7];
    let x = Tensor::<Flex, 4>::from_data(TensorData::new(values(2 * 5 * 3 * 7), dims), &device);
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
        (
            "offset",
            Tensor::cat(vec![x.clone(), x.clone()], 0).slice([1..3, 0..5, 0..3, 0..7]),
        ),
    ] {
        let want = input.clone().swap_dims(1, 2).into_data();
        let got: FlexTensor = <Flex as LayoutKernels>::swap_middle_dims(input.into_primitive().tensor());
        assert_eq!(
            got.layout().contiguous_offsets(),
            Some((0, 2 * 5 * 3 * 7)),
            "{name}: not contiguous"
        );
        assert_eq!(got.into_data(), want, "{name}");
    }
}

/// Under autodiff the gradient of `Σ w · swap(x)` is `swap(w)`, whichever order the weights
/// come in; a backward that forgot to swap back, or swapped twice, puts them elsewhere.
#[test]
fn the_swaps_gradient_is_the_swapped_gradient() {
    type B = Autodiff<Flex>;
    let device = Default::default();
    let x = Tensor::<B, 4>::from_data(TensorData::new(values(2 * 4 * 3 * 5), [2, 4, 3, 5]), &device)
        .require_grad();
    let w = Tensor::<B, 4>::from_data(TensorData::new(values(2 * 3 * 4 * 5), [2, 3, 4, 5]), &device);
    let swapped = swap_dims_contiguous(x.clone());
    assert_eq!(swapped.dims(), [2, 3, 4, 5]);
    let grads = (swapped * w.clone()).sum().backward();
    let got = x.grad(&grads).expect("a gradient").into_data();
    assert_eq!(got, w.inner().swap_dims(1, 2).into_data());
}
