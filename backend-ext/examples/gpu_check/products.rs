//! The cuBLAS path's many products in one section (`ExpertPath::matmuls`, what the primitives'
//! experts with adapters multiply through) against one `matmul` each, the call every earlier
//! GPU run held to the cases: every result, at each GEMM precision, and the whole call one
//! section.
//!
//! The pairs mix what one step of the primitives queues and what a model's projections of one
//! input queue (`DenseProducts::matmuls`): equal shapes from different tensors (a batch through
//! pointer tables), one left operand against four slices of a stacked tensor (equal shapes
//! again; the shared operand does not step, so pointer tables too, as attention's k and v of
//! one input are), a left operand that is a transposed view (`xᵀ · v`), a right one that is
//! (`g · bᵀ`), a decode step's single row, an odd shape left alone, and an empty product.

use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{Distribution, Tensor, TensorPrimitive};
use mpipemoe::backend::ExpertPath;
use mpipemoe::harness::relative_error;
use mpipemoe::GemmPrecision;
use mpipemoe_cuda::{CublasExperts, CudaMoe};

type Inner = CudaMoe<f32>;
type Float = burn::tensor::ops::FloatTensor<Inner>;

fn random(rows: usize, cols: usize) -> Float {
    let device = Default::default();
    Tensor::<Inner, 2>::random([rows, cols], Distribution::Normal(0.0, 0.5), &device)
        .into_primitive()
        .tensor()
}

fn download(t: Float) -> Vec<f64> {
    Tensor::<Inner, 2>::from_primitive(TensorPrimitive::Float(t))
        .into_data()
        .to_vec::<f32>()
        .unwrap_or_else(|_| Vec::new())
        .into_iter()
        .map(f64::from)
        .collect()
}

/// The pairs of one step, as described in the module docs.
fn pairs() -> Vec<(Float, Float)> {
    let t = <Inner as FloatTensorOps<Inner>>::float_transpose;
    let mut pairs: Vec<(Float, Float)> = (0..4).map(|_| (random(40, 64), random(64, 16))).collect();
    // One left operand against four slices of one stacked `[4 · 64, 16]` weight.
    let stacked = random(4 * 64, 16);
    let x = random(24, 64);
    for e in 0..4 {
        let slice = <Inner as FloatTensorOps<Inner>>::float_slice(
            stacked.clone(),
            &[(e * 64..(e + 1) * 64).into(), (0..16).into()],
        );
        pairs.push((x.clone(), slice));
    }
    pairs.push((t(random(40, 64)), random(40, 16)));
    pairs.push((random(40, 32), t(random(16, 32))));
    pairs.push((random(1, 64), random(64, 48)));
    pairs.push((random(7, 9), random(9, 5)));
    pairs.push((random(0, 64), random(64, 16)));
    pairs
}

fn tolerance(precision: GemmPrecision) -> f64 {
    match precision {
        GemmPrecision::F32 => 1e-5,
        GemmPrecision::Tf32 | GemmPrecision::Bf16 => 1e-3,
    }
}

pub(crate) fn checks() -> Vec<(String, Result<String, String>)> {
    let path = match CublasExperts::new(0) {
        Ok(path) => path,
        Err(e) => {
            return vec![(
                "cublas matmuls against matmul".into(),
                Err(format!("no cuBLAS path: {e}")),
            )]
        }
    };
    GemmPrecision::ALL
        .iter()
        .map(|&precision| {
            let label = format!("cublas matmuls against matmul {precision}");
            let pairs = pairs();
            let outcome = (|| -> Result<String, String> {
                let want: Vec<Vec<f64>> = pairs
                    .iter()
                    .map(|(l, r)| path.matmul(l.clone(), r.clone(), precision).map(download))
                    .collect::<Result<_, _>>()
                    .map_err(|e| e.to_string())?;
                let before = path.calls();
                let got = path.matmuls(pairs, precision).map_err(|e| e.to_string())?;
                let calls = path.calls();
                if got.len() != want.len() {
                    return Err(format!("{} results for {} pairs", got.len(), want.len()));
                }
                if calls.sections != before.sections + 1 {
                    return Err(format!(
                        "{} sections for one call",
                        calls.sections - before.sections
                    ));
                }
                let mut worst = 0.0f64;
                for (i, (got, want)) in got.into_iter().map(download).zip(&want).enumerate() {
                    if got.len() != want.len() {
                        return Err(format!("pair {i}: {} values, {} expected", got.len(), want.len()));
                    }
                    if want.is_empty() {
                        continue;
                    }
                    let err = relative_error(&got, want);
                    if err.is_nan() || err > tolerance(precision) {
                        return Err(format!("pair {i}: relative error {err:.2e}"));
                    }
                    worst = worst.max(err);
                }
                Ok(format!(
                    "(worst {worst:.1e}; calls: {} strided, {} pointer tables, {} grouped, {} looped)",
                    calls.strided_batched - before.strided_batched,
                    calls.pointer_batched - before.pointer_batched,
                    calls.grouped - before.grouped,
                    calls.looped - before.looped,
                ))
            })();
            (label, outcome)
        })
        .collect()
}

/// A `[.., rows, cols]` operand's values as a batch of row-major matrices, whatever its layout.
fn host_matrices(t: &Float, dims: &[usize]) -> Vec<f64> {
    Tensor::<Inner, 4>::from_primitive(TensorPrimitive::Float(t.clone()))
        .reshape([dims[0], dims[1], dims[2], dims[3]])
        .into_data()
        .to_vec::<f32>()
        .unwrap_or_default()
        .into_iter()
        .map(f64::from)
        .collect()
}

fn random4(dims: [usize; 4]) -> Float {
    Tensor::<Inner, 4>::random(dims, Distribution::Normal(0.0, 0.5), &Default::default())
        .into_primitive()
        .tensor()
}

/// The operand pairs attention's per-head products see: both contiguous (the weights against
/// the values), the right one the keys' swapped view (the scores), the left one a swapped view
/// (a backward's `lhsᵀ · g`), a right one sliced along its last dimension (DeepSeek-V3's
/// values, made contiguous by the path), and a batch of one matrix.
fn head_pairs() -> Vec<(&'static str, Float, Float)> {
    let swap = |t: Float| <Inner as FloatTensorOps<Inner>>::float_swap_dims(t, 2, 3);
    let sliced = <Inner as FloatTensorOps<Inner>>::float_slice(
        random4([2, 3, 8, 12]),
        &[(0..2).into(), (0..3).into(), (0..8).into(), (2..9).into()],
    );
    vec![
        ("contiguous", random4([2, 3, 5, 8]), random4([2, 3, 8, 7])),
        ("keys' view", random4([2, 3, 5, 8]), swap(random4([2, 3, 7, 8]))),
        ("left view", swap(random4([2, 3, 8, 5])), random4([2, 3, 8, 7])),
        ("sliced right", random4([2, 3, 5, 8]), sliced),
        ("one matrix", random4([1, 1, 6, 8]), random4([1, 1, 8, 4])),
    ]
}

/// The cuBLAS path's per-head products (`ExpertPath::heads_matmul`) against the products in
/// f64 on the host, at each GEMM precision, each call one section.
pub(crate) fn heads_checks() -> Vec<(String, Result<String, String>)> {
    let path = match CublasExperts::new(0) {
        Ok(path) => path,
        Err(e) => {
            return vec![(
                "cublas per-head products".into(),
                Err(format!("no cuBLAS path: {e}")),
            )]
        }
    };
    GemmPrecision::ALL
        .iter()
        .map(|&precision| {
            let label = format!("cublas per-head products {precision}");
            let outcome = (|| -> Result<String, String> {
                let mut worst = 0.0f64;
                for (what, lhs, rhs) in head_pairs() {
                    let (ld, rd) = (lhs.meta.shape().to_vec(), rhs.meta.shape().to_vec());
                    let (m, k, n, batch) = (ld[2], ld[3], rd[3], ld[0] * ld[1]);
                    let (a, b) = (host_matrices(&lhs, &ld), host_matrices(&rhs, &rd));
                    let want: Vec<f64> = (0..batch * m * n)
                        .map(|i| {
                            let (p, r, c) = (i / (m * n), i / n % m, i % n);
                            (0..k)
                                .map(|j| a[p * m * k + r * k + j] * b[p * k * n + j * n + c])
                                .sum()
                        })
                        .collect();
                    let before = path.calls();
                    let got = path
                        .heads_matmul(lhs, rhs, precision)
                        .map_err(|e| format!("{what}: {e}"))?;
                    let sections = path.calls().sections - before.sections;
                    if sections != 1 {
                        return Err(format!("{what}: {sections} sections for one call"));
                    }
                    let got = host_matrices(&got, &[ld[0], ld[1], m, n]);
                    let err = relative_error(&got, &want);
                    if err.is_nan() || err > tolerance(precision) {
                        return Err(format!("{what}: relative error {err:.2e}"));
                    }
                    worst = worst.max(err);
                }
                Ok(format!("(worst {worst:.1e})"))
            })();
            (label, outcome)
        })
        .collect()
}
