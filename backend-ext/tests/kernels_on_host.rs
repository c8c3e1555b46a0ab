//! The CUDA path's kernel source (`src/gemm/kernels.cu`) built by the host's C++ compiler with
//! stand-ins for NVRTC's built-ins (`tests/host/cuda_stub.h`), and its bf16 conversion run on
//! the host against the rounding written out (`tests/host/to_bf16.cpp`).
//!
//! Why here: NVRTC compiles the source only on a GPU machine, in a lent session's few minutes,
//! so a syntax error or a wrong conversion would cost one of them. This catches both on every
//! machine with a C++ compiler; what needs the device (the element-wise kernels against the
//! composed forms, every case in bf16) is `examples/gpu_check`'s.

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

#[test]
fn the_kernel_source_builds_and_its_bf16_conversion_rounds_to_nearest_even() {
    let Some(cxx) = compiler() else {
        // Rust's own linking needs a C compiler, not a C++ one: say so rather than fail.
        eprintln!("no C++ compiler (c++, g++, clang++) on the path: the kernel source is not checked here");
        return;
    };
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let harness = here.join("tests/host/to_bf16.cpp");
    let binary = Path::new(env!("CARGO_TARGET_TMPDIR")).join("to_bf16_on_host");
    let built = Command::new(cxx)
        .args([
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Werror",
            "-Wno-unused-function",
            "-o",
        ])
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
