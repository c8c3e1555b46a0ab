//! Files from strangers in, outputs out whole.
//!
//! Checkpoints, case files and profiles are often written by someone else, so every read here
//! refuses what is not a regular file (a FIFO would block forever, `/dev/zero` would never
//! end), is bounded by the file's length (and, for JSON, by a cap), and keeps names taken from
//! a file inside the folder they are meant to be in. Every write goes to a temporary file or
//! folder beside the target and is renamed into place once complete, so a failure leaves the
//! target as it was.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use memmap2::Mmap;

use crate::error::{MoeError, Result};

/// The largest JSON file read (`config.json`, an index, a profile): real ones are kilobytes
/// to a few megabytes (an index of a 1000-shard checkpoint), so 64 MiB is far beyond any.
pub const MAX_JSON_BYTES: u64 = 64 << 20;

/// The length of `path`, which must be a regular file (symbolic links are followed).
///
/// # Errors
/// [`MoeError::File`] naming `path` if it cannot be inspected or is not a regular file (a
/// folder, FIFO, socket or device).
pub fn regular_file_len(path: &Path) -> Result<u64> {
    let meta = std::fs::metadata(path).map_err(|e| MoeError::file(path, format!("cannot read: {e}")))?;
    if !meta.is_file() {
        let kind = if meta.is_dir() {
            "a folder"
        } else {
            "not a regular file (a FIFO, socket or device)"
        };
        return Err(MoeError::file(
            path,
            format!("is {kind}; expected a regular file"),
        ));
    }
    Ok(meta.len())
}

/// Reads a regular file of at most `max_bytes`, never more than its length said.
///
/// # Errors
/// [`MoeError::File`] naming `path` if it is not a regular file, is longer than `max_bytes`,
/// or cannot be read.
pub fn read_bounded(path: &Path, max_bytes: u64) -> Result<Vec<u8>> {
    let len = regular_file_len(path)?;
    if len > max_bytes {
        return Err(MoeError::file(
            path,
            format!("is {len} bytes, over the {max_bytes} bytes this file may have"),
        ));
    }
    let file = File::open(path).map_err(|e| MoeError::file(path, format!("cannot open: {e}")))?;
    // The length came from metadata; a file that grows while we read it is cut at that length
    // plus one byte, which is then reported, so no read runs away.
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(len + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| MoeError::file(path, format!("cannot read: {e}")))?;
    if bytes.len() as u64 != len {
        return Err(MoeError::file(path, "changed size while it was read"));
    }
    Ok(bytes)
}

/// Reads a UTF-8 JSON (or other text) file of at most [`MAX_JSON_BYTES`].
///
/// # Errors
/// As [`read_bounded`], and if the file is not UTF-8.
pub fn read_text(path: &Path) -> Result<String> {
    String::from_utf8(read_bounded(path, MAX_JSON_BYTES)?)
        .map_err(|_| MoeError::file(path, "is not UTF-8 text"))
}

/// Maps a regular file read-only.
///
/// # Errors
/// [`MoeError::File`] naming `path` if it is not a regular file or cannot be mapped.
pub fn map_regular(path: &Path) -> Result<Mmap> {
    regular_file_len(path)?;
    let file = File::open(path).map_err(|e| MoeError::file(path, format!("cannot open: {e}")))?;
    // SAFETY: the map is read-only and lives while we read it. Another process truncating
    // the file while we read it could fault, as with any memory-mapped loader (Hugging
    // Face's safetensors loader maps files the same way).
    unsafe { Mmap::map(&file) }.map_err(|e| MoeError::file(path, format!("cannot map: {e}")))
}

/// `dir/name` for a file name taken from a file (`source`, for errors): one plain component,
/// so neither `..`, an absolute path nor a subfolder can lead out of `dir`; and if it is a
/// symbolic link, it must point inside `dir` too.
///
/// # Errors
/// [`MoeError::File`] naming `source` and the name if the name leaves `dir`.
pub fn file_in(dir: &Path, name: &str, source: &Path) -> Result<PathBuf> {
    let mut parts = Path::new(name).components();
    let plain = matches!((parts.next(), parts.next()), (Some(Component::Normal(_)), None));
    if !plain || name.contains('\\') {
        return Err(MoeError::file(
            source,
            format!(
                "file name {name:?} is not a plain file name inside {}",
                dir.display()
            ),
        ));
    }
    let path = dir.join(name);
    if path.is_symlink() {
        let (real, real_dir) = (path.canonicalize(), dir.canonicalize());
        if let (Ok(real), Ok(real_dir)) = (real, real_dir) {
            if !real.starts_with(&real_dir) {
                return Err(MoeError::file(
                    source,
                    format!(
                        "file {name:?} is a symbolic link out of {} (to {})",
                        dir.display(),
                        real.display()
                    ),
                ));
            }
        }
    }
    Ok(path)
}

/// `path` made absolute, with `.`, `..` and symbolic links resolved: its longest existing
/// prefix through the file system (so links count), the rest of it lexically (a `..` after a
/// folder that does not exist yet cancels that folder, as it will once the folder is made).
fn resolved(path: &Path) -> PathBuf {
    if let Ok(real) = path.canonicalize() {
        return real;
    }
    let absolute = match path.is_absolute() {
        true => path.to_path_buf(),
        false => std::env::current_dir().unwrap_or_default().join(path),
    };
    // The longest prefix that exists, canonicalised; then the remaining components.
    let parts: Vec<Component<'_>> = absolute.components().collect();
    let mut base = PathBuf::new();
    let mut rest = 0;
    for i in (0..=parts.len()).rev() {
        let prefix: PathBuf = parts[..i].iter().collect();
        if let Ok(real) = prefix.canonicalize() {
            base = real;
            rest = i;
            break;
        }
    }
    for part in &parts[rest..] {
        match part {
            Component::ParentDir => {
                base.pop();
            }
            Component::Normal(name) => base.push(name),
            Component::CurDir | Component::RootDir | Component::Prefix(_) => {}
        }
    }
    base
}

/// Refuses an output that would write over or around an input (a checkpoint folder, a data
/// file): `out` may be neither `input` itself, nor a folder that contains it (replacing that
/// folder as a whole would delete the input with it), nor anything inside it (a file of the
/// checkpoint replaced, or a stranger's file among its shards). Paths are compared after `.`, `..` and
/// symbolic links are resolved, so another spelling of the same folder is the same folder.
/// An in-place update, where the caller means to replace `input`, checks
/// [`same_folder`] itself before calling this for every other output.
///
/// # Errors
/// [`MoeError::File`] naming `out` (the `flag` that gave it) and `input`.
pub fn check_apart(input: &Path, out: &Path, flag: &str) -> Result<()> {
    let (input_real, out_real) = (resolved(input), resolved(out));
    let relation = if out_real == input_real {
        "is the input itself"
    } else if input_real.starts_with(&out_real) {
        "contains the input (replacing it would delete the input)"
    } else if out_real.starts_with(&input_real) {
        "lies inside the input"
    } else {
        return Ok(());
    };
    Err(MoeError::file(
        out,
        format!(
            "{flag} {relation} {}; write the output somewhere apart from the input",
            input.display()
        ),
    ))
}

/// Whether `a` and `b` name the same folder once `.`, `..` and symbolic links are resolved.
pub fn same_folder(a: &Path, b: &Path) -> bool {
    resolved(a) == resolved(b)
}

/// A name beside `target` for a temporary file or folder, unique to this process.
fn beside(target: &Path, what: &str) -> PathBuf {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let unique = format!(".{name}.{what}-{}", std::process::id());
    target.with_file_name(unique)
}

/// Writes `bytes` to `path` whole: into a temporary file beside it, flushed, then renamed over
/// it. With `overwrite` false an existing `path` is an error and is left alone.
///
/// # Errors
/// [`MoeError::File`] naming `path` if it exists (without `overwrite`) or cannot be written;
/// the target is unchanged then.
pub fn write_whole(path: &Path, bytes: &[u8], overwrite: bool) -> Result<()> {
    if !overwrite && std::fs::symlink_metadata(path).is_ok() {
        return Err(MoeError::file(path, "exists; refusing to overwrite it"));
    }
    let partial = beside(path, "partial");
    let written = File::create(&partial)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&partial, path));
    written.map_err(|e| {
        let _ = std::fs::remove_file(&partial);
        MoeError::file(path, format!("cannot write: {e}"))
    })
}

/// A folder built beside its target and put in its place only when complete.
///
/// [`StagedDir::new`] makes an empty temporary folder; the caller writes into
/// [`StagedDir::path`]; [`StagedDir::commit`] replaces the target with it (the old target, if
/// any, is moved aside first and removed only after the new one is in place). Dropped without
/// a commit, the temporary folder is removed and the target is untouched.
#[derive(Debug)]
pub struct StagedDir {
    staging: PathBuf,
    target: PathBuf,
    committed: bool,
}

impl StagedDir {
    /// Starts a folder that will replace `target`.
    ///
    /// # Errors
    /// [`MoeError::File`] naming `target` if the temporary folder cannot be made beside it.
    pub fn new(target: &Path) -> Result<Self> {
        // `.` or `dir/..` has no name to put a sibling beside: work on the resolved path.
        let target = &resolved(target);
        let staging = beside(target, "staging");
        if staging.exists() {
            std::fs::remove_dir_all(&staging)
                .map_err(|e| MoeError::file(&staging, format!("cannot clear: {e}")))?;
        }
        std::fs::create_dir_all(&staging)
            .map_err(|e| MoeError::file(target, format!("cannot create a folder beside it: {e}")))?;
        Ok(Self {
            staging,
            target: target.to_path_buf(),
            committed: false,
        })
    }

    /// Where to write the folder's files.
    pub fn path(&self) -> &Path {
        &self.staging
    }

    /// Puts the folder in place of the target.
    ///
    /// # Errors
    /// [`MoeError::File`] naming the target if a rename fails; the old target is restored.
    pub fn commit(mut self) -> Result<()> {
        let old = beside(&self.target, "old");
        let had_target = self.target.exists();
        if had_target {
            if old.exists() {
                std::fs::remove_dir_all(&old)
                    .map_err(|e| MoeError::file(&old, format!("cannot clear: {e}")))?;
            }
            std::fs::rename(&self.target, &old)
                .map_err(|e| MoeError::file(&self.target, format!("cannot move aside: {e}")))?;
        }
        if let Err(e) = std::fs::rename(&self.staging, &self.target) {
            if had_target {
                let _ = std::fs::rename(&old, &self.target);
            }
            return Err(MoeError::file(&self.target, format!("cannot put in place: {e}")));
        }
        self.committed = true;
        if had_target {
            std::fs::remove_dir_all(&old).map_err(|e| {
                MoeError::file(
                    &old,
                    format!("the new folder is in place; cannot remove the old one: {e}"),
                )
            })?;
        }
        Ok(())
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty folder in the system's temporary folder, removed when the test ends (a test
    /// that panics leaves it, for a look at what it held).
    struct Scratch(PathBuf);

    impl std::ops::Deref for Scratch {
        type Target = PathBuf;
        fn deref(&self) -> &PathBuf {
            &self.0
        }
    }

    impl AsRef<Path> for Scratch {
        fn as_ref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            if !std::thread::panicking() {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    fn scratch(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("mpipemoe-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    #[test]
    fn names_that_leave_the_folder_are_refused() {
        let dir = scratch("names");
        let src = dir.join("index.json");
        for bad in [
            "../x.safetensors",
            "/etc/passwd",
            "a/b.safetensors",
            "..",
            ".",
            "",
            "a\\..\\b",
        ] {
            let err = file_in(&dir, bad, &src).unwrap_err().to_string();
            assert!(err.contains("index.json"), "{bad}: {err}");
        }
        assert_eq!(
            file_in(&dir, "model-1.safetensors", &src).unwrap(),
            dir.join("model-1.safetensors")
        );
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("/etc/hostname", dir.join("out.safetensors")).unwrap();
            let err = file_in(&dir, "out.safetensors", &src).unwrap_err().to_string();
            assert!(err.contains("symbolic link out of"), "{err}");
            std::fs::write(dir.join("real"), b"x").unwrap();
            std::os::unix::fs::symlink(dir.join("real"), dir.join("in.safetensors")).unwrap();
            assert!(file_in(&dir, "in.safetensors", &src).is_ok());
        }
    }

    /// An output is held apart from its input however it is spelled: `.` and `..`, a folder
    /// that does not exist yet followed by `..`, a symbolic link to the input.
    #[test]
    fn outputs_are_held_apart_from_the_input_however_spelled() {
        let dir = scratch("apart");
        let input = dir.join("model");
        std::fs::create_dir_all(&input).unwrap();
        let err = |out: &Path| check_apart(&input, out, "--out").unwrap_err().to_string();
        assert!(err(&input.join(".")).contains("is the input itself"));
        assert!(err(&dir.join("new/../model")).contains("is the input itself"));
        assert!(err(&dir).contains("contains the input"));
        assert!(err(&input.join("a/b")).contains("lies inside"));
        assert!(err(&input.join("new/../../model/x")).contains("lies inside"));
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(&input, dir.join("link")).unwrap();
            assert!(err(&dir.join("link")).contains("is the input itself"));
            assert!(same_folder(&dir.join("link"), &input));
        }
        // Beside it, or a sibling whose name merely starts the same, is apart.
        assert!(check_apart(&input, &dir.join("model-tuned"), "--out").is_ok());
        assert!(check_apart(&input, &dir.join("out/x"), "--out").is_ok());
        assert!(!same_folder(&dir.join("model-tuned"), &input));
    }

    #[test]
    fn reads_refuse_what_is_not_a_regular_file_or_too_long() {
        let dir = scratch("reads");
        assert!(read_bounded(&dir, 10)
            .unwrap_err()
            .to_string()
            .contains("a folder"));
        #[cfg(unix)]
        assert!(read_bounded(Path::new("/dev/zero"), 10)
            .unwrap_err()
            .to_string()
            .contains("not a regular file"));
        let f = dir.join("f");
        std::fs::write(&f, [1u8; 11]).unwrap();
        assert!(read_bounded(&f, 10)
            .unwrap_err()
            .to_string()
            .contains("over the 10 bytes"));
        assert_eq!(read_bounded(&f, 11).unwrap(), vec![1u8; 11]);
    }

    #[test]
    fn writes_are_whole_and_do_not_overwrite_unless_asked() {
        let dir = scratch("writes");
        let f = dir.join("out.json");
        write_whole(&f, b"one", false).unwrap();
        assert!(write_whole(&f, b"two", false)
            .unwrap_err()
            .to_string()
            .contains("exists"));
        assert_eq!(std::fs::read(&f).unwrap(), b"one");
        write_whole(&f, b"two", true).unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"two");
        // Only the target is left: no temporary file beside it.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    }

    #[test]
    fn a_staged_folder_replaces_its_target_only_on_commit() {
        let dir = scratch("staged");
        let target = dir.join("ckpt");
        std::fs::create_dir_all(&target).unwrap();
        std::fs::write(target.join("old.safetensors"), b"old").unwrap();
        {
            let staged = StagedDir::new(&target).unwrap();
            std::fs::write(staged.path().join("new.safetensors"), b"new").unwrap();
            // Dropped without commit: the target is as it was, nothing is left beside it.
        }
        assert!(target.join("old.safetensors").is_file());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        let staged = StagedDir::new(&target).unwrap();
        std::fs::write(staged.path().join("new.safetensors"), b"new").unwrap();
        staged.commit().unwrap();
        assert!(!target.join("old.safetensors").exists());
        assert!(target.join("new.safetensors").is_file());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    }
}
