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

/// The CubeCL WGPU backend that burn's default `Wgpu` puts inside fusion.
#[cfg(feature = "wgpu")]
pub type WgpuInner = burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, f32, i32, u32>;

/// burn's `Wgpu` with burn's default features: the CubeCL WGPU backend inside fusion.
#[cfg(feature = "wgpu")]
pub type WgpuFusion = burn_fusion::Fusion<WgpuInner>;

/// burn's `Cuda` with burn's default features: the CubeCL CUDA backend inside fusion.
#[cfg(feature = "cuda")]
pub type CudaFusion = mpipemoe_cuda::CudaMoeFusion;

impl BackendArg {
    /// Each of `ranks` ranks' share of the memory the machine has available now, where this
    /// backend keeps its tensors in this process's memory (the CPU backends); `None` on a
    /// device, whose memory is its own, or where the available memory is not known. What the
    /// models' host-memory floors are checked against (`mpipemoe_models::check_host_bytes`).
    pub fn host_bytes_per_rank(self, ranks: usize) -> Option<u64> {
        match self {
            BackendArg::Flex | BackendArg::Ndarray => {
                crate::heap::available_host_bytes().map(|b| b / ranks.max(1) as u64)
            }
            _ => None,
        }
    }

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

/// `--gemm-precision`: the experts' GEMM precision where the backend has a device library
/// (`cuda`, `cuda-fusion`: cuBLAS); every other backend multiplies as it always does.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PrecisionArg {
    /// IEEE f32 (PyTorch's default): the reference cases hold to 1e-4.
    #[default]
    F32,
    /// TF32 tensor cores, f32 accumulation.
    Tf32,
    /// bf16 tensor cores on bf16 copies of the operands, f32 accumulation.
    Bf16,
}

impl PrecisionArg {
    /// The layer config's precision.
    pub fn precision(self) -> mpipemoe::GemmPrecision {
        match self {
            PrecisionArg::F32 => mpipemoe::GemmPrecision::F32,
            PrecisionArg::Tf32 => mpipemoe::GemmPrecision::Tf32,
            PrecisionArg::Bf16 => mpipemoe::GemmPrecision::Bf16,
        }
    }
}

/// `--gemm`: which library runs the experts' GEMMs on the CUDA backends.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GemmArg {
    /// cuBLAS (`mpipemoe_cuda::CublasExperts`), at `--gemm-precision`, with the layer's
    /// router and shared expert: the fast path.
    #[default]
    Cublas,
    /// cubecl's kernels (burn's matmul, f32 in TF32 on CUDA): the twin the GPU check holds
    /// cuBLAS to.
    Cubecl,
}

/// A communicator with the device library's paths for the chosen backend added (rank by rank).
pub type AddPaths = std::sync::Arc<
    dyn Fn(std::sync::Arc<dyn mpipemoe::Communicator>) -> std::sync::Arc<dyn mpipemoe::Communicator>
        + Send
        + Sync,
>;

/// The paths `--gemm` asks for on `backend` and GPU `gpu`: cuBLAS's expert path on the CUDA
/// backends (made once, shared by every rank thread on that GPU), with the page-locked host
/// rows and offload where a communicator has none of its own; nothing elsewhere.
///
/// # Errors
/// Where the backend is not available ([`BackendArg::available`], naming `--backend`), or
/// cuBLAS is asked for and cannot be used (no library, no NVRTC): a usage error naming `--gemm`.
pub fn device_paths(backend: BackendArg, gemm: GemmArg, gpu: usize) -> Result<AddPaths, String> {
    let unchanged: AddPaths = std::sync::Arc::new(|comm| comm);
    if !backend.is_cuda() || gemm == GemmArg::Cubecl {
        return Ok(unchanged);
    }
    // A build or machine without CUDA says so by the backend's flag first.
    backend.available()?;
    cublas_paths(gpu)
}

#[cfg(feature = "cuda")]
fn cublas_paths(gpu: usize) -> Result<AddPaths, String> {
    let path = mpipemoe_cuda::CublasExperts::new(gpu)
        .map_err(|e| format!("--gemm cublas: {e} (--gemm cubecl runs without cuBLAS)"))?;
    // The experts, and the page-locked host rows and offload where a communicator has none
    // (thread ranks; NCCL's ranks keep their own).
    Ok(std::sync::Arc::new(move |comm| path.adding_to(comm)))
}

#[cfg(not(feature = "cuda"))]
fn cublas_paths(_gpu: usize) -> Result<AddPaths, String> {
    Err("this build has no CUDA backend: rebuild with `--features cuda`".into())
}
