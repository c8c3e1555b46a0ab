//! Flex's decoder kernels against their compositions (the defaults, which `Autodiff` records
//! with their gradients).

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use super::{rms_norm_composed, rotate_half_seq_major_composed, DecoderKernels};

fn seeded<const D: usize>(dims: [usize; D], salt: usize) -> Tensor<Flex, D> {
    let n = dims.iter().product::<usize>();
    let values: Vec<f32> = (0..n)
        .map(|i| ((((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0) - 1.0) * (1.0 + (i % 7) as f32))
        .collect();
    Tensor::from_data(TensorData::new(values, dims), &Default::default())
}

fn values<const D: usize>(t: burn::tensor::ops::FloatTensor<Flex>) -> Vec<f32> {
    Tensor::<Flex, D>::from_primitive(TensorPrimitive::Float(t))
        .into_data()
        .to_vec()
        .unwrap()
}

/// Row by row within float rounding of the composition (its sums of squares add in another
/// order): a decode step's rows, a prefill's (over the pool), a strided view, a width short of
/// a lane block; and a wrong eps or weight shows.
#[test]
fn flex_rms_norm_equals_its_composition() {
    for (rows, width, transposed, scale) in [
        (1, 512, false, 1.0),
        (12, 64, false, 1.0),
        (300, 512, false, 1.0),
        (7, 13, false, 1.0),
        (40, 24, true, 1.0),
        // Mean squares near eps: a kernel that dropped or misplaced eps would miss by far.
        (3, 64, false, 1e-3),
    ] {
        let x = match transposed {
            false => seeded([rows, width], 1),
            true => seeded([width, rows], 1).transpose(),
        } * scale;
        let w = seeded([width], 2);
        let eps = 1e-6;
        let want = values::<2>(rms_norm_composed::<Flex>(
            x.clone().into_primitive().tensor(),
            w.clone().into_primitive().tensor(),
            eps,
        ));
        let got = values::<2>(Flex::rms_norm(
            x.into_primitive().tensor(),
            w.into_primitive().tensor(),
            eps,
        ));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs() / (1e-3 + w.abs()))
            .fold(0f32, f32::max);
        assert!(worst <= 1e-6, "{rows}×{width}: {worst:.1e}");
    }
}

/// Bit for bit the composition (the same two products and sum per value; the rotation exact
/// either way): one position's heads (a decode step), tables per batch row and shared, a
/// prefill's positions over the pool.
#[test]
fn flex_rotate_half_equals_its_composition() {
    for ([b, t, h, d], rows) in [
        ([1, 1, 8, 64], 1),
        ([2, 5, 3, 16], 2),
        ([2, 5, 3, 16], 1),
        ([1, 200, 8, 64], 1),
    ] {
        let x = seeded([b, t, h, d], 3);
        let (cos, sin) = (seeded([rows, t, d], 4), seeded([rows, t, d], 5));
        let args = || {
            (
                x.clone().into_primitive().tensor(),
                cos.clone().into_primitive().tensor(),
                sin.clone().into_primitive().tensor(),
            )
        };
        let (a, c, s) = args();
        let want = values::<4>(rotate_half_seq_major_composed::<Flex>(a, c, s));
        let (a, c, s) = args();
        let got = values::<4>(Flex::rotate_half_seq_major(a, c, s));
        assert!(got == want, "[{b}, {t}, {h}, {d}], {rows} table rows");
    }
}

/// The dense blocks' SwiGLU under `Autodiff<Flex>` (one node over the experts' kernel) as the
/// models call it, on halves given apart and on `[gate | up]` whole, against burn's
/// `silu(gate) · up` recorded one by one: output and both halves' gradients. Over the pool (more
/// rows than one task's) and at a width short of a lane block.
#[test]
fn flex_gated_silu_node_equals_burns_ops_recorded_one_by_one() {
    use burn::backend::Autodiff;
    type A = Autodiff<Flex>;
    assert!(<A as DecoderKernels>::gated_silu_node() && <A as DecoderKernels>::gated_silu_joins());
    for dims in [[2, 3, 13], [4, 300, 96]] {
        let tracked = |salt| Tensor::<A, 3>::from_inner(seeded(dims, salt));
        super::gated::assert_forms_agree(&tracked(6), &tracked(7), &tracked(8), 1e-6);
    }
}
