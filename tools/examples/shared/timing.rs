//! Helpers the checkpoint examples (`hf_layers`, `hf_mxfp4`) share: medians of timed rounds,
//! and the check that two folders hold the same files.

use std::path::Path;
use std::time::Instant;

use mpipemoe::MoeError;

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Milliseconds since `start`.
pub fn ms(start: Instant) -> f64 {
    start.elapsed().as_secs_f64() * 1e3
}

/// Every file of `a` is in `b` with the same bytes; the error names the first that is not.
pub fn same_files(a: &Path, b: &Path) -> mpipemoe::Result<()> {
    for entry in std::fs::read_dir(a).map_err(|e| MoeError::file(a, e.to_string()))? {
        let name = entry.map_err(|e| MoeError::file(a, e.to_string()))?.file_name();
        match (std::fs::read(a.join(&name)), std::fs::read(b.join(&name))) {
            (Ok(x), Ok(y)) if x == y => {}
            _ => {
                return Err(MoeError::file(
                    b.join(&name),
                    format!("differs from {}", a.join(&name).display()),
                ))
            }
        }
    }
    Ok(())
}
