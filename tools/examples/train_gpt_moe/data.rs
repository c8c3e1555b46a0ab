//! Byte-level text data: a corpus split into train and validation, and batches.

use std::path::{Path, PathBuf};

use mpipemoe::seeded_uniform;

/// A corpus of bytes, 90% for training and the last 10% held out.
pub struct Corpus {
    /// Where it came from.
    pub name: String,
    train: Vec<u8>,
    val: Vec<u8>,
}

impl Corpus {
    /// Any regular text file of at most 1 GiB (a FIFO or device is refused, not read forever).
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let bytes = mpipemoe::files::read_bounded(path, 1 << 30).map_err(|e| e.to_string())?;
        Self::new(path.display().to_string(), bytes)
    }

    /// The crate's own source code and documentation, read at run time: always present in a
    /// clone of the project.
    pub fn builtin() -> Result<Self, String> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = Vec::new();
        for dir in ["src", "examples", "tests", "docs", "benches", "backend-ext/src"] {
            collect(&root.join(dir), &mut files);
        }
        files.push(root.join("README.md"));
        files.sort();
        let mut bytes = Vec::new();
        for file in &files {
            if let Ok(text) = std::fs::read(file) {
                bytes.extend_from_slice(&text);
                bytes.push(b'\n');
            }
        }
        Self::new(format!("this crate's sources ({} files)", files.len()), bytes)
    }

    fn new(name: String, bytes: Vec<u8>) -> Result<Self, String> {
        if bytes.len() < 20_000 {
            return Err(format!(
                "{name}: {} bytes is too little text to train on (need 20 kB)",
                bytes.len()
            ));
        }
        let cut = bytes.len() * 9 / 10;
        Ok(Self {
            name,
            train: bytes[..cut].to_vec(),
            val: bytes[cut..].to_vec(),
        })
    }

    /// Bytes in the training split.
    pub fn train_len(&self) -> usize {
        self.train.len()
    }

    /// Entropy of the training split's byte frequencies, in nats: the loss of the best model
    /// that ignores context.
    pub fn unigram_entropy(&self) -> f64 {
        let mut counts = [0usize; 256];
        for &b in &self.train {
            counts[b as usize] += 1;
        }
        let n = self.train.len() as f64;
        counts
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / n;
                -p * p.ln()
            })
            .sum()
    }

    /// The global training batch of `step`: `batch` windows of `seq_len + 1` bytes at offsets
    /// drawn from the seeded stream (the same on every rank).
    pub fn batch(&self, seed: u64, step: usize, batch: usize, seq_len: usize) -> Vec<Vec<u8>> {
        let span = self.train.len() - seq_len - 1;
        seeded_uniform(seed, &format!("batch-{step}"), batch, 1.0)
            .into_iter()
            .map(|u| {
                let start = (((u as f64 + 1.0) / 2.0) * span as f64) as usize;
                self.train[start.min(span)..start.min(span) + seq_len + 1].to_vec()
            })
            .collect()
    }

    /// Held-out batch `i`: evenly spaced windows of the validation split.
    pub fn val_batch(&self, i: usize, batches: usize, batch: usize, seq_len: usize) -> Vec<Vec<u8>> {
        let span = self.val.len().saturating_sub(seq_len + 1);
        let total = batches * batch;
        (0..batch)
            .map(|j| {
                let start = span * (i * batch + j) / total.max(1);
                self.val[start..start + seq_len + 1].to_vec()
            })
            .collect()
    }
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs" || e == "md") {
            out.push(path);
        }
    }
}
