//! Attention's batched products of a decode step on Flex: each head's few query rows against
//! its keys (`q · Kᵀ`) and its weights against its values (`p · V`), read where the cache
//! holds them.
//!
//! Flex's batched matmul hands each head's product to `gemm`, which packs the cached keys or
//! values into a buffer of its own before multiplying one or two rows by them: in a decode
//! step of the 163 M Qwen3-MoE those products were 4.6% of the step, most of it packing
//! (BENCHMARKS §13m). Here each head's product goes to the few-row kernels the projections use
//! (`flex_gemm.rs` [`few_rows`]): `p · V` on the streaming kernel (the values' rows read in
//! order), `q · Kᵀ` on the dot kernel (each key's row read once, `flex_dot.rs`).

use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorData};

use rayon::prelude::*;

use super::flex_gemm::{few_rows, Operands, Shared, FEW_ROWS};

/// Multiply-adds from which a batch of heads splits over the pool: about 20 µs of work on one
/// core, against a few microseconds to hand half of it to a thread kept awake.
const PARALLEL_MULTIPLY_ADDS: usize = 1 << 16;

/// `lhs · rhs` over matching batch dimensions, each batch's product on [`few_rows`] where
/// `lhs` has at most [`FEW_ROWS`] rows; other products (more rows, broadcast batches, other
/// dtypes, flipped views) as Flex's matmul.
///
/// # Shapes
/// - lhs: `[.., m, k]`, rhs: `[.., k, n]` → `[.., m, n]`
pub(crate) fn heads_matmul(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    let (l, r) = (lhs.layout().shape().to_vec(), rhs.layout().shape().to_vec());
    let d = l.len();
    let fits = d >= 2
        && r.len() == d
        && l[..d - 2] == r[..d - 2]
        && l[d - 1] == r[d - 2]
        && l[d - 2] <= FEW_ROWS
        && lhs.dtype() == DType::F32
        && rhs.dtype() == DType::F32
        && lhs
            .layout()
            .strides()
            .iter()
            .chain(rhs.layout().strides())
            .all(|&s| s >= 0);
    if !fits {
        return Flex::float_matmul(lhs, rhs);
    }
    let (m, k, n) = (l[d - 2], l[d - 1], r[d - 1]);
    let batch = &l[..d - 2];
    let batches: usize = batch.iter().product();
    let mut out = vec![0f32; batches * m * n];
    if m * n > 0 {
        let (ls, rs) = (lhs.layout().strides(), rhs.layout().strides());
        let lhs_start = Shared(lhs.storage::<f32>()[lhs.layout().start_offset()..].as_ptr());
        let rhs_start = Shared(rhs.storage::<f32>()[rhs.layout().start_offset()..].as_ptr());
        let head = |(b, out): (usize, &mut [f32])| {
            // The batch index's offset in each operand, from its strides.
            let (mut lo, mut ro, mut rest) = (0isize, 0isize, b);
            for i in (0..d - 2).rev() {
                let at = (rest % batch[i]) as isize;
                rest /= batch[i];
                lo += at * ls[i];
                ro += at * rs[i];
            }
            // SAFETY: the offsets stay inside the views, which lie inside their storages
            // (Flex's layouts), alive until this function returns.
            let operands = unsafe {
                Operands::at(
                    (lhs_start.get().offset(lo), [ls[d - 2], ls[d - 1]]),
                    (rhs_start.get().offset(ro), [rs[d - 2], rs[d - 1]]),
                    [m, k, n],
                )
            };
            few_rows(&operands, out);
        };
        // The heads over the pool where there is enough of them to share (a decode step's
        // scores and weights against a long cache); each head's values are its own product's
        // on any thread.
        match batches > 1 && batches * m * k * n >= PARALLEL_MULTIPLY_ADDS && rayon::current_num_threads() > 1
        {
            true => out.par_chunks_exact_mut(m * n).enumerate().for_each(head),
            false => out.chunks_exact_mut(m * n).enumerate().for_each(head),
        }
    }
    let mut shape = l;
    shape[d - 1] = n;
    FlexTensor::from_data(TensorData::new(out, Shape::from(shape)))
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::Flex;
    use burn::tensor::{Tensor, TensorData, TensorPrimitive};

    use super::heads_matmul;

    fn seeded(dims: [usize; 4], salt: usize) -> Tensor<Flex, 4> {
        let n = dims.iter().product::<usize>();
        let values: Vec<f32> = (0..n)
            .map(|i| (((i * 7919 + salt * 104_729) % 2003) as f32 / 1001.0) - 1.0)
            .collect();
        Tensor::from_data(TensorData::new(values, dims), &Default::default())
    }

    fn product(a: Tensor<Flex, 4>, b: Tensor<Flex, 4>) -> Vec<f32> {
        let out = heads_matmul(a.into_primitive().tensor(), b.into_primitive().tensor());
        Tensor::<Flex, 4>::from_primitive(TensorPrimitive::Float(out))
            .into_data()
            .to_vec()
            .unwrap()
    }

    /// Against Flex's own batched matmul (the reference twin), as attention calls it in a
    /// decode step: queries of 1 to 16 rows against a cache with room to spare (views of its
    /// first slots), keys transposed (the dot kernel up to four rows, `gemm` above) and values
    /// as they lie (the streaming kernel); and a prefill's many rows (Flex's matmul itself).
    #[test]
    fn heads_products_equal_flexs_matmul_on_cache_views() {
        for (rows, len) in [(1, 37), (2, 300), (4, 5), (5, 64), (16, 129), (64, 64)] {
            let (b, h, capacity, d) = (2, 3, 320, 24);
            let q = seeded([b, h, rows, d], 1);
            let keys = seeded([b, h, capacity, d], 2).slice([0..b, 0..h, 0..len, 0..d]);
            let values = seeded([b, h, capacity, d], 3).slice([0..b, 0..h, 0..len, 0..d]);
            let weights = seeded([b, h, rows, len], 4);
            for (lhs, rhs) in [(q, keys.swap_dims(2, 3)), (weights, values)] {
                let want: Vec<f32> = lhs.clone().matmul(rhs.clone()).into_data().to_vec().unwrap();
                let got = product(lhs, rhs);
                assert_eq!(got.len(), want.len());
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
                    .fold(0f32, f32::max);
                assert!(worst <= 1e-5, "{rows} rows, {len} cached: {worst:.1e}");
            }
        }
    }
}
