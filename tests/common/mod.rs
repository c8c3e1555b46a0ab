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
    use mpipemoe::Scoring;
    let input = |at: usize, value: f32| {
        let mut values = vec![0.5f32; 24];
        values[at] = value;
        Tensor::<B, 2>::from_data(TensorData::new(values, [3, 8]), device)
    };
    // A router that chooses by its logits (the check reads them), and a sigmoid router with a
    // score bias (it chooses by scores, which a logit of -inf leaves finite, so the input's
    // own check is read with them).
    let plain = mpipemoe::MoeLayerConfig::new(8, 16, 4, 2);
    let biased = plain.clone().with_scoring(Scoring::Sigmoid).with_score_bias(true);
    for config in [plain, biased] {
        let layer = config.init::<B>(device);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in [0, 13, 23] {
                let err = match layer.try_forward(input(at, bad)) {
                    Ok(_) => panic!("{bad} at {at} was let through (score bias {})", config.score_bias),
                    Err(e) => e.to_string(),
                };
                assert!(err.contains("NaN or infinite"), "{err}");
            }
        }
        // f32::MAX overflows some logits to infinity: the input itself is then looked at,
        // and it is finite.
        for fine in [f32::MAX, -f32::MAX, f32::MIN_POSITIVE / 4.0, -0.0] {
            assert!(
                layer.try_forward(input(13, fine)).is_ok(),
                "the finite value {fine:e} was refused (score bias {})",
                config.score_bias
            );
        }
        // A finite input whose logits overflow: f32::MAX with the sign of each router weight
        // of the expert whose weights add up to the most in magnitude. The values read with
        // the routing are then not all finite, and the input itself must be looked at.
        let w = layer
            .router
            .weight
            .val()
            .into_data()
            .convert::<f32>()
            .to_vec::<f32>()
            .unwrap();
        let mass = |e: usize| w[e * 8..e * 8 + 8].iter().map(|v| v.abs() as f64).sum::<f64>();
        let e = (0..4).max_by(|&a, &b| mass(a).total_cmp(&mass(b))).unwrap();
        assert!(
            mass(e) > 1.01,
            "no expert's logit overflows (weights {:.3})",
            mass(e)
        );
        let mut values = vec![0.5f32; 24];
        for (d, value) in values[8..16].iter_mut().enumerate() {
            *value = f32::MAX.copysign(w[e * 8 + d]);
        }
        let overflowing = Tensor::<B, 2>::from_data(TensorData::new(values, [3, 8]), device);
        assert!(
            layer.try_forward(overflowing).is_ok(),
            "a finite input whose logits overflow was refused (score bias {})",
            config.score_bias
        );
    }
}
