//! The CUDA path's kernel source (`src/gemm/kernels.cu`) built by the host's C++ compiler with
//! stand-ins for NVRTC's built-ins (`tests/host/cuda_stub.h`), and its kernels run on the host,
//! every thread of their launch grid in turn: the bf16 conversion against rounding to nearest
//! even found by distance (`tests/host/to_bf16.cpp`), and the activations, their derivatives and
//! the output bias against their definitions in double (`tests/host/activations.cpp`).
//!
//! Why here: NVRTC compiles the source only on a GPU machine, in a lent session's few minutes,
//! so a syntax error, a wrong index or a wrong conversion would cost one of them. This catches
//! them on every machine with a C++ compiler; what needs the device (the kernels on real
//! buffers beside cuBLAS, every case in bf16) is `examples/gpu_check`'s.

use std::path::Path;
use std::process::Command;

/// The first C++ compiler found on the path.
fn compiler() -> Option<&'static str> {
    ["c++", "g++", "clang++"].into_iter().find(|cxx| {
        Command::new(cxx)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    })
}

/// Builds `tests/host/NAME.cpp` (which includes the kernel source) and runs it: it prints `ok`
/// and exits 0, or says what differed. Warnings are off: the source is written for NVRTC, and
/// another host compiler's warnings say nothing about it (a mistake shows in the values).
fn build_and_run(name: &str) {
    let Some(cxx) = compiler() else {
        // Rust's own linking needs a C compiler, not a C++ one: say so rather than fail.
        eprintln!("no C++ compiler (c++, g++, clang++) on the path: the kernel source is not checked here");
        return;
    };
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let harness = here.join(format!("tests/host/{name}.cpp"));
    let binary = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}_on_host"));
    let built = Command::new(cxx)
        .args(["-std=c++17", "-O1", "-w", "-o"])
        .arg(&binary)
        .arg(&harness)
        .output()
        .expect("the compiler runs");
    assert!(
        built.status.success(),
        "{cxx} could not build {} with the kernel source:\n{}",
        harness.display(),
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = Command::new(&binary).output().expect("the harness runs");
    let said = String::from_utf8_lossy(&ran.stdout);
    assert!(ran.status.success() && said.starts_with("ok"), "{said}");
}

#[test]
fn the_kernel_source_builds_and_its_bf16_conversion_rounds_to_nearest_even() {
    build_and_run("to_bf16");
}

#[test]
fn the_activation_and_bias_kernels_match_their_definitions_on_each_jobs_rows_alone() {
    build_and_run("activations");
}
