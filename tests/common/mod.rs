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
