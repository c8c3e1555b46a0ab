//! `scripts/gpu/device-env.sh` chooses `CUDA_PATH` by its stated rule (a set CUDA_PATH with
//! headers, the `nvcc` on PATH, /usr/local/cuda, the highest /usr/local/cuda-13.x), checked
//! against fake directory trees; no GPU or CUDA toolkit needed.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A fresh empty folder under the target directory.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("device_env_{name}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// A toolkit at `root/rel`: with the runtime header where `headers`, with bin/nvcc always.
fn toolkit(root: &Path, rel: &str, headers: bool) -> PathBuf {
    let dir = root.join(rel);
    fs::create_dir_all(dir.join("bin")).unwrap();
    fs::write(dir.join("bin/nvcc"), "#!/bin/sh\n").unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        fs::set_permissions(dir.join("bin/nvcc"), fs::Permissions::from_mode(0o755)).unwrap();
    }
    if headers {
        fs::create_dir_all(dir.join("include")).unwrap();
        fs::write(dir.join("include/cuda_runtime.h"), "").unwrap();
    }
    dir
}

/// What the script chooses under `root`, with `path` as PATH and `cuda_path` as CUDA_PATH.
fn chosen(root: &Path, path: &str, cuda_path: Option<&Path>) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu/device-env.sh");
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(format!(
            ". '{}' >/dev/null 2>&1; printf '%s' \"${{CUDA_PATH:-unset}}\"",
            script.display()
        ))
        .env("DEVICE_ENV_ROOT", root)
        .env("PATH", format!("{path}:/usr/bin:/bin"))
        .env_remove("CUDA_PATH");
    if let Some(p) = cuda_path {
        cmd.env("CUDA_PATH", p);
    }
    let out = cmd.output().expect("bash runs");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn cuda_path_follows_the_stated_rule() {
    let root = scratch("rule");
    let s = |p: &Path| p.display().to_string();
    // Nothing with headers: unset.
    assert_eq!(chosen(&root, "", None), "unset");
    // 4. The highest 13.x with headers, not a 12.x and not a 13.x without headers; "13.10"
    //    sorts above "13.9" as a version, not as text.
    toolkit(&root, "usr/local/cuda-12.9", true);
    toolkit(&root, "usr/local/cuda-13.9", true);
    let best = toolkit(&root, "usr/local/cuda-13.10", true);
    toolkit(&root, "usr/local/cuda-13.11", false);
    assert_eq!(chosen(&root, "", None), s(&best));
    // 3. /usr/local/cuda wins over the versioned folders.
    let default = toolkit(&root, "usr/local/cuda", true);
    assert_eq!(chosen(&root, "", None), s(&default));
    // 2. The nvcc on PATH wins over /usr/local/cuda; one without headers does not count.
    let headerless = toolkit(&root, "opt/nvcc-only", false);
    assert_eq!(chosen(&root, &s(&headerless.join("bin")), None), s(&default));
    let on_path = toolkit(&root, "opt/toolkit", true);
    assert_eq!(chosen(&root, &s(&on_path.join("bin")), None), s(&on_path));
    // 1. A set CUDA_PATH with headers wins; one without headers is replaced by the rule.
    let set = toolkit(&root, "opt/mine", true);
    assert_eq!(chosen(&root, &s(&on_path.join("bin")), Some(&set)), s(&set));
    assert_eq!(
        chosen(&root, &s(&on_path.join("bin")), Some(&headerless)),
        s(&on_path)
    );
}
