//! Choosing the backend at run time: `--backend flex|ndarray|wgpu` in the command-line tool,
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
    /// burn's WGPU backend (any Vulkan, Metal or DirectX GPU, or Mesa's software Vulkan driver);
    /// needs the `wgpu` feature of `mpipemoe-tools`.
    Wgpu,
}

impl BackendArg {
    /// Reads `MPIPEMOE_BACKEND` (for the benches, whose arguments belong to criterion); Flex
    /// when it is unset.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var("MPIPEMOE_BACKEND") {
            Err(_) => Ok(BackendArg::Flex),
            Ok(name) => BackendArg::from_str(&name, true)
                .map_err(|_| format!("MPIPEMOE_BACKEND={name:?}: expected flex, ndarray or wgpu")),
        }
    }
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
/// If `backend` is `wgpu` and this build has no WGPU support (the `wgpu` feature).
pub fn run_on<J: BackendJob>(backend: BackendArg, job: J) -> Result<J::Output, String> {
    match backend {
        BackendArg::Flex => Ok(job.run::<Autodiff<Flex>>(&Default::default())),
        BackendArg::Ndarray => Ok(job.run::<Autodiff<NdArray>>(&Default::default())),
        #[cfg(feature = "wgpu")]
        BackendArg::Wgpu => Ok(job.run::<Autodiff<burn::backend::Wgpu>>(&Default::default())),
        #[cfg(not(feature = "wgpu"))]
        BackendArg::Wgpu => Err(
            "this build has no WGPU backend: rebuild with `--features wgpu` (e.g. `cargo run --release --features wgpu ...`)"
                .to_string(),
        ),
    }
}
