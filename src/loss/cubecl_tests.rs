//! The cross-entropy's kernels (`cubecl_cross_entropy.rs`) against the composed forms on WGPU:
//! a vocabulary narrower than the cube's threads and one many times wider, contiguous and
//! strided logits, ignored rows, and the NaN a target past the vocabulary gives.

use burn::backend::Wgpu;
use burn::tensor::{Distribution, Int, Tensor, TensorData, TensorPrimitive};

use super::{token_nll_backward_composed, token_nll_forward_composed, LossKernels};
use crate::cubecl_test_kernels::{close_within, p, strided};

fn column(t: burn::tensor::ops::FloatTensor<Wgpu>) -> burn::tensor::ops::FloatTensor<Wgpu> {
    let t = Tensor::<Wgpu, 1>::from_primitive(TensorPrimitive::Float(t));
    let n = t.dims()[0];
    t.reshape([n, 1]).into_primitive().tensor()
}

/// Targets through the vocabulary, rows 2 and 5 ignored (−1 and PyTorch's −100).
fn targets(n_tokens: usize, vocab: usize) -> Tensor<Wgpu, 1, Int> {
    let t: Vec<i32> = (0..n_tokens)
        .map(|r| match r {
            2 => -1,
            5 => -100,
            _ => ((r * 577 + 3) % vocab) as i32,
        })
        .collect();
    Tensor::from_data(TensorData::new(t, [n_tokens]), &Default::default())
}

#[test]
fn the_cross_entropy_kernels_match_the_composed_forms() {
    let device = Default::default();
    for (n_tokens, vocab) in [(9, 37), (7, 1000)] {
        // Spread wide, so that each row's shift by its maximum matters.
        let logits = Tensor::<Wgpu, 2>::random([n_tokens, vocab], Distribution::Normal(0.0, 30.0), &device);
        let targets = targets(n_tokens, vocab).into_primitive();
        let grad = Tensor::<Wgpu, 1>::random([n_tokens], Distribution::Uniform(0.5, 1.5), &device)
            .into_primitive()
            .tensor();
        for (layout, logits) in [("contiguous", logits.clone()), ("strided", strided(&logits))] {
            let what = format!("[{n_tokens}, {vocab}], {layout}");
            let (want_nll, want_lse) = token_nll_forward_composed::<Wgpu>(p(&logits), targets.clone());
            let (nll, lse) = <Wgpu as LossKernels>::token_nll_forward(p(&logits), targets.clone());
            close_within(&format!("{what}, nll"), column(nll), column(want_nll), 0.0);
            close_within(
                &format!("{what}, lse"),
                column(lse),
                column(want_lse.clone()),
                0.0,
            );
            let want = token_nll_backward_composed::<Wgpu>(
                p(&logits),
                targets.clone(),
                want_lse.clone(),
                grad.clone(),
            );
            let got = <Wgpu as LossKernels>::token_nll_backward(
                p(&logits),
                targets.clone(),
                want_lse,
                grad.clone(),
            );
            close_within(&format!("{what}, gradient"), got, want, 0.0);
        }
    }
}

/// A target at the vocabulary's size breaks the contract; the kernel cannot panic, so that
/// row's loss is NaN (and the other rows' stay what they are).
#[test]
fn a_target_past_the_vocabulary_gives_nan() {
    let device = Default::default();
    let logits = Tensor::<Wgpu, 2>::random([3, 10], Distribution::Default, &device);
    let targets = Tensor::<Wgpu, 1, Int>::from_data(TensorData::new(vec![4i32, 10, 0], [3]), &device);
    let (nll, _) = <Wgpu as LossKernels>::token_nll_forward(p(&logits), targets.into_primitive());
    let nll = Tensor::<Wgpu, 1>::from_primitive(TensorPrimitive::Float(nll))
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert!(
        nll[0].is_finite() && nll[1].is_nan() && nll[2].is_finite(),
        "{nll:?}"
    );
}
