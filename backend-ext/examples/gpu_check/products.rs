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
