//! Step 6's weighted combine kernels (`cubecl_combine.rs`) against their composed twins on
//! WGPU: the output and both gradients, from contiguous tensors and from transposed views,
//! for top-1, 2 and 4 with dropped assignments, a width below and above a cube's 64 threads,
//! and more cubes than one launch dimension holds. Every reference case also runs through
//! them in the layer (`tests/wgpu.rs`).

use std::sync::Arc;

use burn::backend::Wgpu;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Distribution, Tensor};

use super::cubecl_combine as kernels;
use super::weighted_combine::{combine_weighted_backward_composed, combine_weighted_composed};
use crate::cubecl_test_kernels::{p, strided};
use crate::dispatch::{CombineMap, RowMap};

fn random(shape: [usize; 2]) -> Tensor<Wgpu, 2> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
}

/// A plan's map: each token's `top_k` distinct experts of 8, every fifth assignment dropped,
/// the rows ordered by expert and then by token as the dispatch plan orders them.
fn plan_map(n_tokens: usize, top_k: usize) -> Arc<CombineMap> {
    let n_experts = 8;
    let mut kept: Vec<(usize, usize)> = (0..n_tokens * top_k)
        .filter(|s| s % 5 != 3)
        .map(|s| (((s / top_k) * 7 + (s % top_k) * 3) % n_experts, s))
        .collect();
    kept.sort();
    let row_slot: Vec<usize> = kept.into_iter().map(|(_, s)| s).collect();
    let tokens = Arc::new(RowMap::new(
        row_slot.iter().map(|s| s / top_k).collect(),
        n_tokens,
    ));
    Arc::new(CombineMap::new(tokens, row_slot, top_k))
}

fn close(what: &str, got: FloatTensor<Wgpu>, want: FloatTensor<Wgpu>) {
    crate::cubecl_test_kernels::close_within(what, got, want, 0.0);
}

fn check(n_tokens: usize, top_k: usize, width: usize, layouts: &[&str]) {
    let map = plan_map(n_tokens, top_k);
    let rows = random([map.n_rows(), width]);
    let weights = random([n_tokens, top_k]);
    let grad = random([n_tokens, width]);
    for &layout in layouts {
        let (rows, weights, grad) = match layout {
            "strided" => (strided(&rows), strided(&weights), strided(&grad)),
            _ => (rows.clone(), weights.clone(), grad.clone()),
        };
        let what = format!("{n_tokens} tokens, top_k {top_k}, width {width}, {layout}");
        let got = kernels::combine_weighted(&p(&rows), &p(&weights), &map)
            .unwrap_or_else(|| panic!("{what}: the kernel handed the tensors back"));
        close(
            &what,
            got,
            combine_weighted_composed::<Wgpu>(p(&rows), p(&weights), &map),
        );
        let (d_rows, d_weights) =
            kernels::combine_weighted_backward(&p(&grad), &p(&rows), &p(&weights), &map)
                .unwrap_or_else(|| panic!("{what}: the backward kernel handed the tensors back"));
        let (want_rows, want_weights) =
            combine_weighted_backward_composed::<Wgpu>(p(&grad), p(&rows), p(&weights), &map);
        close(&format!("{what}, rows' gradient"), d_rows, want_rows);
        close(&format!("{what}, weights' gradient"), d_weights, want_weights);
    }
}

#[test]
fn the_weighted_combine_kernels_match_the_composed_forms() {
    for top_k in [1, 2, 4] {
        for width in [13, 130] {
            check(37, top_k, width, &["contiguous", "strided"]);
        }
    }
}

/// 70,000 slots are 70,000 cubes of the backward kernel, more than one dimension of a WGPU
/// launch holds (65,535): the cubes spread over two, and each must still find its slot.
#[test]
fn the_backward_kernel_finds_its_slot_past_one_launch_dimension() {
    check(35_000, 2, 3, &["contiguous"]);
}

/// Tensors the kernels do not read are handed back to the composed forms: no rows (every
/// assignment dropped), weights of another shape, another dtype.
#[test]
fn tensors_the_kernels_do_not_read_are_handed_back() {
    let map = plan_map(10, 2);
    let (rows, weights, grad) = (random([map.n_rows(), 4]), random([10, 2]), random([10, 4]));
    assert!(kernels::combine_weighted(&p(&rows), &p(&weights), &map).is_some());
    assert!(kernels::combine_weighted(&p(&rows), &p(&random([10, 3])), &map).is_none());
    let half = rows.clone().cast(burn::tensor::DType::F16);
    assert!(kernels::combine_weighted(&p(&half), &p(&weights), &map).is_none());
    assert!(kernels::combine_weighted_backward(&p(&random([9, 4])), &p(&rows), &p(&weights), &map).is_none());
    assert!(kernels::combine_weighted_backward(&p(&grad), &p(&rows), &p(&weights), &map).is_some());
    let none = Arc::new(CombineMap::new(
        Arc::new(RowMap::new(Vec::new(), 10)),
        Vec::new(),
        2,
    ));
    assert!(kernels::combine_weighted(&p(&random([0, 4])), &p(&weights), &none).is_none());
}
