//! The toy's output folder, checked before training starts.

use std::path::{Path, PathBuf};

/// Makes `--out` (a folder) if needed and checks that the load chart can be written there:
/// a file in its place, a folder where the chart goes, or a folder that refuses a new file is
/// an error naming the path, before any training. Returns the chart's path.
pub fn check_out(out: &Path) -> Result<PathBuf, String> {
    let named = |path: &Path, why: String| format!("--out {}: {why}", path.display());
    if out.exists() && !out.is_dir() {
        return Err(named(out, "exists and is not a folder".into()));
    }
    std::fs::create_dir_all(out).map_err(|e| named(out, format!("cannot create the folder: {e}")))?;
    let png = out.join("load.png");
    if png.exists() && !png.is_file() {
        return Err(named(
            &png,
            "exists and is not a file, so the load chart cannot go there".into(),
        ));
    }
    // A probe file proves the folder takes new files (permissions, a read-only mount).
    let probe = out.join(format!(".write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| named(out, format!("cannot write into the folder: {e}")))?;
    std::fs::remove_file(&probe).map_err(|e| named(&probe, format!("cannot remove the probe: {e}")))?;
    Ok(png)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_or_a_folder_in_the_charts_place_is_refused_before_training() {
        let dir = std::env::temp_dir().join(format!("mpipemoe-out-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("a-file");
        std::fs::write(&file, b"x").unwrap();
        let err = check_out(&file).unwrap_err();
        assert!(err.contains("a-file") && err.contains("not a folder"), "{err}");
        let taken = dir.join("taken");
        std::fs::create_dir_all(taken.join("load.png")).unwrap();
        let err = check_out(&taken).unwrap_err();
        assert!(err.contains("load.png"), "{err}");
        let fresh = dir.join("new/nested");
        assert_eq!(check_out(&fresh).unwrap(), fresh.join("load.png"));
        assert!(fresh.is_dir());
        std::fs::remove_dir_all(&dir).ok();
    }
}
