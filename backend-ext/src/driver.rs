//! Detecting a usable CUDA driver before anything touches the device.

/// Why CUDA cannot be used here.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// `libcuda` could not be loaded: no NVIDIA driver on this machine.
    #[error(
        "no CUDA driver found (libcuda could not be loaded); run on a machine with an NVIDIA GPU and driver"
    )]
    NoDriver,
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
