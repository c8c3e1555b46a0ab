//! Experts with LoRA adapters on CUDA, in IEEE f32, against the same layer on the CPU.
//!
//! A device library takes whole partitions only for plain experts; experts with adapters run on
//! the primitives, whose products go through the library at the run's precision
//! (`mpipemoe`'s `exchange/products.rs`): with the cuBLAS path, each step's products of every
//! expert in one section (`ExpertPath::matmuls`), in IEEE f32. The CPU layer (NdArray, the same weights: every parameter is drawn on the host from the
//! seed) is the reference. Held to the cases' 1e-4: a product left on cubecl's kernels, which
//! multiply f32 in TF32, misses it by an order of magnitude (TF32's unit roundoff is 4.9e-4).
//! Three partitions with S4 (`T_M` recomputed, the adapters' term included), base weights
//! frozen; the output and every adapter gradient are compared.

use std::sync::Arc;

use burn::backend::{Autodiff, NdArray};
use burn::module::Param;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use mpipemoe::comm::SingleRank;
use mpipemoe::harness::relative_error;
use mpipemoe::{
    seeded_uniform, Activation, Communicator, ExchangePath, ExpertLoraSpec, GemmPrecision, LoraScaling,
    MemoryReuse, MoeBackend, MoeLayerConfig, Partitions,
};
use mpipemoe_cuda::{with_cublas, CudaMoe};

const TOKENS: usize = 40;
const D_MODEL: usize = 16;

fn config() -> MoeLayerConfig {
    MoeLayerConfig::new(D_MODEL, 24, 4, 2)
        .with_activation(Activation::SwiGlu)
        .with_bias(true)
        .with_seed(5)
        .with_gemm_precision(GemmPrecision::F32)
        .with_path(ExchangePath::Fused)
        .with_partitions(Partitions::Fixed(3))
        .with_memory_reuse(MemoryReuse::S4)
}

/// The output and the four adapter gradients (`w_in`'s a and b, `w_out`'s a and b) of
/// `loss = Σ output · g`, as host values.
fn run<B: AutodiffBackend + MoeBackend>(
    device: &B::Device,
    comm: Arc<dyn Communicator>,
) -> Result<Vec<Vec<f64>>, String>
where
    B::InnerBackend: MoeBackend,
{
    let spec = ExpertLoraSpec {
        rank: 3,
        alpha: 6.0,
        scaling: LoraScaling::Standard,
        w_in: true,
        w_out: true,
    };
    let mut layer = config()
        .init_rank::<B>(device, comm)
        .map_err(|e| e.to_string())?
        .freeze_all_but_adapters()
        .with_adapters(&spec, 9)
        .map_err(|e| e.to_string())?;
    // Fresh adapters have `b = 0`; these do not, the same on both sides.
    let adapters = layer.adapters.as_mut().ok_or("no adapters")?;
    for (key, lora) in [
        ("b_in", adapters.w_in.as_mut()),
        ("b_out", adapters.w_out.as_mut()),
    ] {
        let lora = lora.ok_or("an adapter is missing")?;
        let dims = lora.b.dims();
        let values = seeded_uniform(1, key, dims.iter().product(), 0.5);
        lora.b = Param::from_tensor(Tensor::from_data(TensorData::new(values, dims), device));
    }
    let host = |key: &str| {
        Tensor::<B, 2>::from_data(
            TensorData::new(seeded_uniform(2, key, TOKENS * D_MODEL, 1.0), [TOKENS, D_MODEL]),
            device,
        )
    };
    let out = layer.try_forward(host("x")).map_err(|e| e.to_string())?.output;
    let grads = (out.clone() * host("g")).sum().backward();
    let values = |t: Tensor<B::InnerBackend, 3>| -> Vec<f64> {
        t.into_data().convert::<f64>().to_vec().unwrap_or_default()
    };
    let adapters = layer.adapters.as_ref().ok_or("no adapters")?;
    let mut all = vec![out.into_data().convert::<f64>().to_vec().unwrap_or_default()];
    for lora in [adapters.w_in.as_ref(), adapters.w_out.as_ref()]
        .into_iter()
        .flatten()
    {
        for p in [&lora.a, &lora.b] {
            all.push(values(p.grad(&grads).ok_or("an adapter has no gradient")?));
        }
    }
    Ok(all)
}

/// The check: a label and `Ok(note)` or `Err(why)`.
pub(crate) fn checks() -> Vec<(String, Result<String, String>)> {
    let label = "cublas f32 LoRA experts (n=3, s4) against the CPU".to_string();
    let outcome = (|| {
        let want = run::<Autodiff<NdArray>>(&Default::default(), Arc::new(SingleRank))?;
        let comm = with_cublas(Arc::new(SingleRank), 0).map_err(|e| e.to_string())?;
        let got = run::<Autodiff<CudaMoe<f32>>>(&Default::default(), comm)?;
        let names = ["output", "w_in.a", "w_in.b", "w_out.a", "w_out.b"];
        let mut worst = 0.0f64;
        for ((name, g), w) in names.iter().zip(&got).zip(&want) {
            if g.len() != w.len() || g.is_empty() {
                return Err(format!("{name}: {} values against {}", g.len(), w.len()));
            }
            let err = relative_error(g, w);
            if err.is_nan() || err > 1e-4 {
                return Err(format!("{name} relative error {err:.2e}"));
            }
            worst = worst.max(err);
        }
        if got.len() != names.len() {
            return Err(format!("{} tensors compared of {}", got.len(), names.len()));
        }
        Ok(format!("max_rel_err={worst:.3e}"))
    })();
    vec![(label, outcome)]
}
