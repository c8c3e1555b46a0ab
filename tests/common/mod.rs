//! Helpers shared by the integration tests of both crates (`tools/tests` includes this file by
//! path): scratch folders and copies of the checkpoint fixtures.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// An empty folder in the system's temporary folder, unique to `name` and this process.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mpipemoe-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Copies the files of folder `from` (not its subfolders) into `to`, creating it.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
}

/// The layer's finite check on backend `B`: an input with a NaN or an infinity anywhere is
/// refused by name, and one whose values are finite at their extremes (the largest magnitudes,
/// a subnormal, a negative zero) is not. The check multiplies the input by zero and sums it
/// (`layer/module.rs`); a backend that folded `x · 0` to zero would pass no NaN through and
/// fail the first half, and a check that flagged large values would fail the second.
pub fn holds_the_finite_check<B: mpipemoe::MoeBackend>(device: &B::Device) {
    use burn::tensor::{Tensor, TensorData};
    let layer = mpipemoe::MoeLayerConfig::new(8, 16, 4, 2).init::<B>(device);
    let input = |at: usize, value: f32| {
        let mut values = vec![0.5f32; 24];
        values[at] = value;
        Tensor::<B, 2>::from_data(TensorData::new(values, [3, 8]), device)
    };
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for at in [0, 13, 23] {
            let err = match layer.try_forward(input(at, bad)) {
                Ok(_) => panic!("{bad} at {at} was let through"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains("NaN or infinite"), "{err}");
        }
    }
    for fine in [f32::MAX, -f32::MAX, f32::MIN_POSITIVE / 4.0, -0.0] {
        assert!(
            layer.try_forward(input(13, fine)).is_ok(),
            "the finite value {fine:e} was refused"
        );
    }
}
