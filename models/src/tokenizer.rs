//! A folder's `tokenizer.json`, read with Hugging Face's `tokenizers` crate: the text side of
//! `generate --prompt` and of fine-tuning on a text file.

use std::path::{Path, PathBuf};

use mpipemoe::{MoeError, Result};

/// The largest `tokenizer.json` read. Published ones are a few MiB to about 30 MiB (Llama 4's
/// is 27 MiB); the bound keeps a stranger's file from taking the memory.
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// A Hugging Face tokenizer whose ids are checked against the model's vocabulary.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    vocab_size: usize,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl TextTokenizer {
    /// The file name a Hugging Face folder keeps its tokenizer under.
    pub const FILE: &'static str = "tokenizer.json";

    /// The tokenizer of the folder `dir`, or `None` if it has no `tokenizer.json`.
    /// `vocab_size` is the model's: an id the tokenizer gives at or above it is an error.
    ///
    /// # Errors
    /// As [`from_file`](Self::from_file).
    pub fn from_dir(dir: impl AsRef<Path>, vocab_size: usize) -> Result<Option<Self>> {
        let path = dir.as_ref().join(Self::FILE);
        match path.try_exists() {
            Ok(false) => Ok(None),
            Ok(true) => Self::from_file(path, vocab_size).map(Some),
            Err(e) => Err(MoeError::file(&path, e.to_string())),
        }
    }

    /// The tokenizer in the file `path` (a `tokenizer.json`).
    ///
    /// # Errors
    /// [`MoeError::File`] naming `path` if it is not a regular file, cannot be read, is larger
    /// than [`MAX_TOKENIZER_BYTES`], or is not a tokenizer `tokenizers` reads.
    pub fn from_file(path: impl AsRef<Path>, vocab_size: usize) -> Result<Self> {
        let path = path.as_ref();
        let bytes = mpipemoe::files::read_bounded(path, MAX_TOKENIZER_BYTES)?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| MoeError::file(path, format!("not a tokenizer: {e}")))?;
        Ok(Self {
            inner,
            path: path.to_path_buf(),
            vocab_size,
        })
    }

    /// The ids of `text`; with `special_tokens`, the tokenizer's own template adds what it
    /// adds (a beginning-of-sequence id for Llama's and Mistral's tokenizers), as
    /// transformers' `tokenizer(text)` does.
    ///
    /// # Errors
    /// [`MoeError::Input`] if the tokenizer fails on the text or gives an id that is not in
    /// the model's vocabulary (a tokenizer of another model).
    pub fn encode(&self, text: &str, special_tokens: bool) -> Result<Vec<usize>> {
        let encoding = self
            .inner
            .encode(text, special_tokens)
            .map_err(|e| MoeError::Input(format!("{}: cannot encode the text: {e}", self.path.display())))?;
        let ids: Vec<usize> = encoding.get_ids().iter().map(|&id| id as usize).collect();
        if let Some(bad) = ids.iter().find(|&&id| id >= self.vocab_size) {
            return Err(MoeError::Input(format!(
                "{} gives token id {bad}, outside the model's vocabulary of {}: a tokenizer of another model",
                self.path.display(),
                self.vocab_size
            )));
        }
        Ok(ids)
    }

    /// The text of `ids`, special tokens left out (as transformers'
    /// `decode(ids, skip_special_tokens=True)`).
    ///
    /// # Errors
    /// [`MoeError::Input`] if an id does not fit the tokenizer's id type or the tokenizer
    /// cannot decode the ids.
    pub fn decode(&self, ids: &[usize]) -> Result<String> {
        let ids = ids
            .iter()
            .map(|&id| u32::try_from(id).map_err(|_| MoeError::Input(format!("token id {id} is too large"))))
            .collect::<Result<Vec<u32>>>()?;
        self.inner
            .decode(&ids, true)
            .map_err(|e| MoeError::Input(format!("{}: cannot decode: {e}", self.path.display())))
    }

    /// The file read.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
