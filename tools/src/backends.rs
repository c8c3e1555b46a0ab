//! Choosing the backend at run time: `--backend flex|ndarray|wgpu|wgpu-fusion|cuda|cuda-fusion`
//! in the command-line tool,
//! the examples and the benches.

use burn::backend::{Autodiff, Flex, NdArray};
use burn::tensor::backend::AutodiffBackend;
use clap::ValueEnum;
use mpipemoe::MoeBackend;

/// A backend the tools can run the layer on.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendArg {
    /// The fast CPU backend.
    Flex,
    /// The exact reference CPU backend.
    Ndarray,
    /// burn's WGPU backend without fusion (any Vulkan, Metal or DirectX GPU, or Mesa's software
    /// Vulkan driver); needs the `wgpu` feature of `mpipemoe-tools`.
    Wgpu,
    /// burn's WGPU backend as burn's default features build it: wrapped in fusion, which fuses
    /// the element-wise work around the exchange. Needs the `wgpu` feature.
    WgpuFusion,
    /// burn's CUDA backend without fusion, with the NCCL row path; needs the `cuda` feature of
    /// `mpipemoe-tools` and an NVIDIA driver.
    Cuda,
    /// burn's CUDA backend as burn's default features build it (fusion). Needs the `cuda`
    /// feature and an NVIDIA driver.
    CudaFusion,
}

/// burn's `Wgpu` with burn's default features: the CubeCL WGPU backend inside fusion.
#[cfg(feature = "wgpu")]
pub type WgpuFusion =
    burn_fusion::Fusion<burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>>;

/// burn's `Cuda` with burn's default features: the CubeCL CUDA backend inside fusion.
#[cfg(feature = "cuda")]
pub type CudaFusion = burn_fusion::Fusion<mpipemoe_cuda::CudaMoe>;

impl BackendArg {
    /// Reads `MPIPEMOE_BACKEND` (for the benches, whose arguments belong to criterion); Flex
    /// when it is unset.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var("MPIPEMOE_BACKEND") {
            Err(_) => Ok(BackendArg::Flex),
            Ok(name) => BackendArg::from_str(&name, true).map_err(|_| {
                format!("MPIPEMOE_BACKEND={name:?}: expected flex, ndarray, wgpu, wgpu-fusion, cuda or cuda-fusion")
            }),
        }
    }

    /// Whether this is one of the CUDA backends (ranks may be GPUs joined by NCCL).
    pub fn is_cuda(self) -> bool {
        matches!(self, BackendArg::Cuda | BackendArg::CudaFusion)
    }

    /// Whether this build and this machine can run the backend: `Err` with a one-line reason
    /// (the feature to rebuild with, or the missing driver) where not. Callers exit with 2.
    pub fn available(self) -> Result<(), String> {
        match self {
            BackendArg::Flex | BackendArg::Ndarray => Ok(()),
            BackendArg::Wgpu | BackendArg::WgpuFusion if cfg!(feature = "wgpu") => Ok(()),
            BackendArg::Wgpu | BackendArg::WgpuFusion => Err(format!(
                "this build has no WGPU backend (--backend {}): rebuild with `--features wgpu` (e.g. `cargo run --release --features wgpu ...`)",
                self.name()
            )),
            BackendArg::Cuda | BackendArg::CudaFusion => cuda_available(self),
        }
    }

    /// The flag's spelling.
    pub fn name(self) -> String {
        self.to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    }
}

#[cfg(feature = "cuda")]
fn cuda_available(backend: BackendArg) -> Result<(), String> {
    mpipemoe_cuda::cuda_available().map_err(|e| format!("--backend {}: {e}", backend.name()))
}

#[cfg(not(feature = "cuda"))]
fn cuda_available(backend: BackendArg) -> Result<(), String> {
    Err(format!(
        "this build has no CUDA backend (--backend {}): rebuild with `--features cuda` on a machine with the CUDA toolkit (`cargo run --release --features cuda ...`)",
        backend.name()
    ))
}

/// Work that runs on whichever autodiff backend the user chose.
pub trait BackendJob {
    /// What the work returns.
    type Output;

    /// Runs the work on backend `B`; its inner backend (no autodiff, for evaluation and
    /// inference) runs the layer too.
    fn run<B>(self, device: &B::Device) -> Self::Output
    where
        B: AutodiffBackend + MoeBackend,
        B::InnerBackend: MoeBackend;
}

/// Runs `job` on the backend `backend` names, on its default device.
///
/// # Errors
/// If this build or machine cannot run `backend` ([`BackendArg::available`]).
pub fn run_on<J: BackendJob>(backend: BackendArg, job: J) -> Result<J::Output, String> {
    run_on_gpu(backend, 0, job)
}

/// Runs `job` on the backend `backend` names; on the CUDA backends on GPU `gpu` of this
/// machine (the rank's GPU), elsewhere on the default device.
///
/// # Errors
/// If this build or machine cannot run `backend` ([`BackendArg::available`]).
pub fn run_on_gpu<J: BackendJob>(backend: BackendArg, gpu: usize, job: J) -> Result<J::Output, String> {
    backend.available()?;
    let _ = gpu;
    match backend {
        BackendArg::Flex => Ok(job.run::<Autodiff<Flex>>(&Default::default())),
        BackendArg::Ndarray => Ok(job.run::<Autodiff<NdArray>>(&Default::default())),
        #[cfg(feature = "wgpu")]
        BackendArg::Wgpu => Ok(job.run::<Autodiff<burn::backend::Wgpu>>(&Default::default())),
        #[cfg(feature = "wgpu")]
        BackendArg::WgpuFusion => Ok(job.run::<Autodiff<WgpuFusion>>(&Default::default())),
        #[cfg(feature = "cuda")]
        BackendArg::Cuda => {
            Ok(job.run::<Autodiff<mpipemoe_cuda::CudaMoe>>(&burn::backend::cuda::CudaDevice::new(gpu)))
        }
        #[cfg(feature = "cuda")]
        BackendArg::CudaFusion => {
            Ok(job.run::<Autodiff<CudaFusion>>(&burn::backend::cuda::CudaDevice::new(gpu)))
        }
        // `available` refused every backend this build lacks.
        #[allow(unreachable_patterns)]
        _ => Err(format!("--backend {}: not in this build", backend.name())),
    }
}
