//! Detecting a usable CUDA driver before anything touches the device.

/// Why CUDA cannot be used here.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// `libcuda` could not be loaded: no NVIDIA driver on this machine.
    #[error(
        "no CUDA driver found (libcuda could not be loaded); run on a machine with an NVIDIA GPU and driver"
    )]
    NoDriver,
    /// `libnccl` could not be loaded: expert parallelism over NCCL is unavailable, while the
    /// layer on one GPU still works.
    #[error(
        "no NCCL library found (libnccl.so could not be loaded); install NCCL (e.g. the nvidia-nccl wheel) and put its lib folder on LD_LIBRARY_PATH"
    )]
    NoNccl,
    /// `libcupti` could not be loaded: the benchmark's count of driver calls (host waits,
    /// launches) is unavailable, while everything else runs.
    #[error(
        "no CUPTI library found (libcupti.so could not be loaded); install it (e.g. the nvidia-cuda-cupti wheel) and put its lib folder on LD_LIBRARY_PATH"
    )]
    NoCupti,
    /// CUPTI refused a call (another subscriber attached, a version it does not support).
    #[error("CUPTI refused the call count: {0}")]
    Cupti(String),
}

/// Checks that the CUDA driver library can be loaded.
///
/// Creating a burn CUDA tensor without a driver panics on cubecl's device thread; calling this
/// first turns that into an error the caller can report.
pub fn cuda_available() -> Result<(), CudaError> {
    // SAFETY: this only tries to dlopen libcuda and look up its symbols; it runs no CUDA
    // call and touches no device state.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::NoDriver)
    }
}

/// Checks that the NCCL library can be loaded.
///
/// cudarc loads `libnccl` on the first NCCL call and panics when it is missing
/// (`cudarc::nccl::sys` is a lazily loaded library); calling this first turns that into an error,
/// so a caller can run its single-GPU work and report NCCL as unavailable.
pub fn nccl_available() -> Result<(), CudaError> {
    // SAFETY: this only tries to dlopen libnccl and look up its symbols; no NCCL call runs.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::NoNccl)
    }
}
