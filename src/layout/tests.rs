//! The swap against burn's view, values and gradients, on Flex and on WGPU (raw CubeCL), and
//! under autodiff on each.

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use super::{swap_dims_contiguous, LayoutKernels};

fn values(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7919) % 1009) as f32 / 13.0 - 30.0).collect()
}

/// Contiguous inputs, a view that is itself swapped (a gradient's usual shape), a transposed
/// last dimension and a view at an offset: the same values as burn's `swap_dims`, in a tensor
/// that `contiguous` says is whole.
fn the_swap_gives_burns_values_contiguously<B: LayoutKernels>(contiguous: fn(&FloatTensor<B>) -> bool) {
    let device = Default::default();
    let dims = [2, 5, 3, 7];
    let x = Tensor::<B, 4>::from_data(TensorData::new(values(2 * 5 * 3 * 7), dims), &device);
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
        let got = B::swap_middle_dims(input.into_primitive().tensor());
        assert!(contiguous(&got), "{name}: not contiguous");
        let got = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(got));
        assert_eq!(got.dims(), [2, 3, 5, 7], "{name}");
        assert_eq!(got.into_data(), want, "{name}");
    }
}

/// Under autodiff the gradient of `Σ w · swap(x)` is `swap(w)`, whichever order the weights
/// come in; a backward that forgot to swap back, or swapped twice, puts them elsewhere.
fn the_swaps_gradient_is_the_swapped_gradient<B: LayoutKernels + Backend>() {
    let device = Default::default();
    let x =
        Tensor::<Autodiff<B>, 4>::from_data(TensorData::new(values(2 * 4 * 3 * 5), [2, 4, 3, 5]), &device)
            .require_grad();
    let w =
        Tensor::<Autodiff<B>, 4>::from_data(TensorData::new(values(2 * 3 * 4 * 5), [2, 3, 4, 5]), &device);
    let swapped = swap_dims_contiguous(x.clone());
    assert_eq!(swapped.dims(), [2, 3, 4, 5]);
    let grads = (swapped * w.clone()).sum().backward();
    let got = x.grad(&grads).expect("a gradient").into_data();
    assert_eq!(got, w.inner().swap_dims(1, 2).into_data());
}

#[cfg(feature = "flex")]
mod flex {
    use burn::backend::Flex;

    #[test]
    fn the_swap_gives_burns_values_contiguously_from_any_layout() {
        super::the_swap_gives_burns_values_contiguously::<Flex>(|t| {
            t.layout().contiguous_offsets() == Some((0, t.layout().num_elements()))
        });
    }

    #[test]
    fn the_swaps_gradient_is_the_swapped_gradient() {
        super::the_swaps_gradient_is_the_swapped_gradient::<Flex>();
    }
}

/// The CubeCL backends' swap is one copy kernel (burn's view made contiguous).
#[cfg(feature = "wgpu")]
mod wgpu {
    use burn::backend::Wgpu;

    #[test]
    fn the_swap_gives_burns_values_contiguously_from_any_layout() {
        super::the_swap_gives_burns_values_contiguously::<Wgpu>(|t| t.is_contiguous());
    }

    #[test]
    fn the_swaps_gradient_is_the_swapped_gradient() {
        super::the_swaps_gradient_is_the_swapped_gradient::<Wgpu>();
    }
}
