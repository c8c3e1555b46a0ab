//! The experts' GEMMs on Flex, into an output allocated once.
//!
//! Flex's matmul allocates its output with `FlexTensor::empty`, which zero-fills a byte
//! vector and then copies it whole to re-align it (burn-flex 0.21 `tensor.rs` `empty`:
//! `Bytes::from_bytes_vec(vec![0u8; ..])`, whose `try_enforce_runtime_align` copies any
//! allocation made with byte alignment, cubecl-common 0.10 `bytes/base.rs` lines 254–262 and
//! 400–406): two passes over every product before the GEMM writes it, on the calling thread
//! while the pool waits. The experts' products are most of a MoE model's GEMM output — the
//! weight gradients alone are `n_experts · d_model · 3 · d_hidden` values per layer and step —
//! and those passes were about 8% of a Qwen3-MoE fine-tuning step. Here the output is an
//! `f32` vector zeroed once and handed to Flex without a copy (`TensorData::new` of a
//! `Vec<f32>` keeps the vector's own allocation), and `gemm` — the crate Flex calls, with the
//! same arguments and the same parallelism threshold — writes into it, so the numbers are
//! Flex's own.

use burn::backend::flex::{Flex, FlexTensor};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, TensorData};

/// Flex's threshold (burn-flex 0.21 `ops/matmul.rs` `PARALLEL_THRESHOLD`): products of at
/// least this many multiply-adds run on every core.
const PARALLEL_THRESHOLD: usize = 192 * 192 * 192;

/// `lhs · rhs` for two `f32` matrices of any strides (transposed views included); other
/// dtypes and ranks go to Flex's matmul.
///
/// # Shapes
/// - lhs: `[m, k]`, rhs: `[k, n]` → `[m, n]`
///
/// # Panics
/// If the inner dimensions differ (the same contract as `float_matmul`).
pub(crate) fn matmul(lhs: FlexTensor, rhs: FlexTensor) -> FlexTensor {
    let (l, r) = (lhs.layout().shape().to_vec(), rhs.layout().shape().to_vec());
    let plain = |t: &FlexTensor| t.dtype() == DType::F32 && t.layout().strides().iter().all(|&s| s >= 0);
    // Other dtypes, ranks and flipped (negative-stride) views: Flex's matmul.
    if !(plain(&lhs) && plain(&rhs)) || l.len() != 2 || r.len() != 2 {
        return Flex::float_matmul(lhs, rhs);
    }
    let (m, k, n) = (l[0], l[1], r[1]);
    assert_eq!(k, r[0], "expert matmul: inner dimensions {k} and {} differ", r[0]);
    let mut out = vec![0f32; m * n];
    if m * n > 0 {
        let (ls, rs) = (lhs.layout().strides(), rhs.layout().strides());
        let lhs_data = &lhs.storage::<f32>()[lhs.layout().start_offset()..];
        let rhs_data = &rhs.storage::<f32>()[rhs.layout().start_offset()..];
        let parallelism = match m.saturating_mul(n).saturating_mul(k) >= PARALLEL_THRESHOLD {
            true => gemm::Parallelism::Rayon(0),
            false => gemm::Parallelism::None,
        };
        // SAFETY: the operands' views lie inside their storages (Flex's layouts say where,
        // and the slices above start at their offsets), `out` holds `m · n` values written
        // with column stride 1 and row stride `n`, and `read_dst` is false, so `out` is only
        // written.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                false,
                lhs_data.as_ptr(),
                ls[1],
                ls[0],
                rhs_data.as_ptr(),
                rs[1],
                rs[0],
                0.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
    }
    FlexTensor::from_data(TensorData::new(out, Shape::new([m, n])))
}
