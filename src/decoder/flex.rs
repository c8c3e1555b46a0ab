//! [`DecoderKernels`](super::DecoderKernels) on Flex: each kernel one pass over its rows, the
//! same operations per value as the composition (the sums of squares excepted, which add in
//! eight lanes rather than in Flex's order), over the pool for a large input.

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, Shape, TensorData};
use rayon::prelude::*;

use super::{rms_norm_composed, rotate_half_seq_major_composed};

/// Values from which a kernel splits its rows over the pool.
const PARALLEL_VALUES: usize = 1 << 16;

/// `x · recip(sqrt(mean(x²) + eps)) · weight` per row; other dtypes and shapes composed.
///
/// # Shapes
/// - x: `[rows, width]`, weight: `[width]` → `[rows, width]`
pub(super) fn rms_norm(x: FlexTensor, weight: FlexTensor, eps: f64) -> FlexTensor {
    let dims = x.layout().shape().to_vec();
    let fits = dims.len() == 2
        && weight.layout().shape().to_vec() == [dims[1]]
        && x.dtype() == DType::F32
        && weight.dtype() == DType::F32
        && dims[1] > 0;
    if !fits {
        return rms_norm_composed::<burn::backend::Flex>(x, weight, eps);
    }
    let [rows, width] = [dims[0], dims[1]];
    let (x, weight) = (x.to_contiguous(), weight.to_contiguous());
    let xs = &x.storage::<f32>()[x.layout().start_offset()..][..rows * width];
    let w = &weight.storage::<f32>()[weight.layout().start_offset()..][..width];
    let (eps, n) = (eps as f32, width as f32);
    let mut out = vec![0f32; rows * width];
    let row = |(o, x): (&mut [f32], &[f32])| {
        let r = (sum_of_squares(x) / n + eps).sqrt().recip();
        for ((o, &x), &w) in o.iter_mut().zip(x).zip(w) {
            *o = x * r * w;
        }
    };
    match rows * width >= PARALLEL_VALUES {
        true => out.par_chunks_mut(width).zip(xs.par_chunks(width)).for_each(row),
        false => out.chunks_mut(width).zip(xs.chunks(width)).for_each(row),
    }
    FlexTensor::from_data(TensorData::new(out, Shape::new([rows, width])))
}

/// `Σ x²` in eight lanes (vectorisable), the lanes then added in order, the tail last.
fn sum_of_squares(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v * v;
        }
    }
    let mut sum = lanes.iter().sum::<f32>();
    for &v in chunks.remainder() {
        sum += v * v;
    }
    sum
}

/// `x · cos + rotate_half(x) · sin` per head; other dtypes, odd head sizes and table shapes
/// composed.
///
/// # Shapes
/// - x: `[batch, seq, heads, head_dim]`; cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch`
pub(super) fn rotate_half_seq_major(x: FlexTensor, cos: FlexTensor, sin: FlexTensor) -> FlexTensor {
    let dims = x.layout().shape().to_vec();
    let table = cos.layout().shape().to_vec();
    let fits = dims.len() == 4
        && x.dtype() == DType::F32
        && cos.dtype() == DType::F32
        && sin.dtype() == DType::F32
        && table.len() == 3
        && sin.layout().shape().to_vec() == table
        && (table[0] == 1 || table[0] == dims[0])
        && table[1..] == [dims[1], dims[3]]
        && dims[3].is_multiple_of(2);
    if !fits {
        return rotate_half_seq_major_composed::<burn::backend::Flex>(x, cos, sin);
    }
    let [b, t, h, d] = [dims[0], dims[1], dims[2], dims[3]];
    let half = d / 2;
    let (x, cos, sin) = (x.to_contiguous(), cos.to_contiguous(), sin.to_contiguous());
    let xs = &x.storage::<f32>()[x.layout().start_offset()..][..b * t * h * d];
    let cs = &cos.storage::<f32>()[cos.layout().start_offset()..][..table[0] * t * d];
    let ss = &sin.storage::<f32>()[sin.layout().start_offset()..][..table[0] * t * d];
    let mut out = vec![0f32; b * t * h * d];
    // One position of one batch row: its `h` heads against its tables' row.
    let position = |(p, o): (usize, &mut [f32])| {
        let (bi, ti) = (p / t, p % t);
        let at = if table[0] == 1 { ti * d } else { (bi * t + ti) * d };
        let (c, s) = (&cs[at..at + d], &ss[at..at + d]);
        let x = &xs[p * h * d..(p + 1) * h * d];
        for (o, x) in o.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            for j in 0..d {
                let rotated = if j < half { -x[j + half] } else { x[j - half] };
                o[j] = x[j] * c[j] + rotated * s[j];
            }
        }
    };
    match out.len() >= PARALLEL_VALUES {
        true => out.par_chunks_mut(h * d).enumerate().for_each(position),
        false => out.chunks_mut(h * d).enumerate().for_each(position),
    }
    FlexTensor::from_data(TensorData::new(out, Shape::new([b, t, h, d])))
}
