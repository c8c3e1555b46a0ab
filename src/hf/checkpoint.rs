//! A Hugging Face checkpoint folder: `config.json`, one `model.safetensors` or shards listed by
//! `model.safetensors.index.json`, read through memory maps.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::tensor::{bf16, f16, DType, TensorData};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::error::{MoeError, Result};
use crate::files::{file_in, map_regular, read_text};

/// One tensor as stored: its dtype, and its values widened to f32 (exact for bf16, f16 and
/// f32).
#[derive(Debug, Clone)]
pub(crate) struct StoredTensor {
    pub dtype: Dtype,
    pub values: Vec<f32>,
}

/// The name transformers gives a stored dtype (`config.json`'s `dtype`).
pub(crate) fn dtype_name(dtype: Dtype) -> String {
    match dtype {
        Dtype::F32 => "float32".into(),
        Dtype::BF16 => "bfloat16".into(),
        Dtype::F16 => "float16".into(),
        Dtype::F64 => "float64".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// Options of an import.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImportOptions {
    /// Accept NaN or infinite weights. Off by default: a checkpoint with them is almost always
    /// broken (a diverged run, a bad conversion), and they would poison every output.
    pub allow_nonfinite: bool,
}

/// The folder and where each tensor lives.
#[derive(Debug, Clone)]
pub(crate) struct Checkpoint {
    pub dir: PathBuf,
    /// Tensor name → shard file name (relative to `dir`; a plain file name inside it).
    pub weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir`: the index if there is one, else the single `model.safetensors`. Every
    /// shard name in the index must be a plain file name inside `dir` (no `..`, no absolute
    /// path, no symbolic link out of it).
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let weight_map = if index.exists() {
            let text = read_text(&index)?;
            let json: Value =
                serde_json::from_str(&text).map_err(|e| MoeError::file(&index, format!("not JSON: {e}")))?;
            let map = json
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| MoeError::file(&index, "no `weight_map` object"))?;
            map.iter()
                .map(|(name, file)| {
                    let file = file.as_str().ok_or_else(|| {
                        MoeError::file(
                            &index,
                            format!("`weight_map` entry of `{name}` is not a file name"),
                        )
                    })?;
                    file_in(dir, file, &index)?;
                    Ok((name.clone(), file.to_string()))
                })
                .collect::<Result<_>>()?
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(MoeError::file(
                    dir,
                    "no model.safetensors.index.json and no model.safetensors: not a Hugging Face checkpoint folder",
                ));
            }
            let map = map_regular(&single)?;
            let (_, header) = header(&map, &single)?;
            header
                .tensors()
                .into_keys()
                .map(|n| (n, "model.safetensors".to_string()))
                .collect()
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            weight_map,
        })
    }

    /// The index file if there is one, else the single file: what an error about a missing
    /// tensor names.
    fn listing(&self) -> PathBuf {
        let index = self.dir.join("model.safetensors.index.json");
        if index.exists() {
            index
        } else {
            self.dir.join("model.safetensors")
        }
    }

    /// The shard holding `name`.
    ///
    /// # Errors
    /// [`MoeError::File`] naming the index (or the single file) if no shard holds it.
    pub(crate) fn shard_of(&self, name: &str) -> Result<&str> {
        self.weight_map
            .get(name)
            .map(String::as_str)
            .ok_or_else(|| MoeError::file(self.listing(), format!("missing tensor `{name}`")))
    }

    /// The stored dtype and shape of each tensor in `names`, from the shards' headers only
    /// (no tensor data is read).
    ///
    /// # Errors
    /// [`MoeError::File`] naming the index or shard if a tensor is missing or a header is bad.
    pub(crate) fn header_shapes(&self, names: &[String]) -> Result<HashMap<String, (Dtype, Vec<usize>)>> {
        let mut by_shard: BTreeMap<&str, Vec<&String>> = BTreeMap::new();
        for name in names {
            by_shard.entry(self.shard_of(name)?).or_default().push(name);
        }
        let mut out = HashMap::with_capacity(names.len());
        for (shard, names) in by_shard {
            let path = file_in(&self.dir, shard, &self.listing())?;
            let map = map_regular(&path)?;
            let (_, header) = header(&map, &path)?;
            let infos = header.tensors();
            for name in names {
                let info = infos.get(name.as_str()).ok_or_else(|| {
                    MoeError::file(
                        &path,
                        format!("missing tensor `{name}` (the index puts it in this shard)"),
                    )
                })?;
                out.insert(name.clone(), (info.dtype, info.shape.clone()));
            }
        }
        Ok(out)
    }

    /// Reads the tensors `wanted` (name → expected shape), mapping each shard once and
    /// copying out only those tensors.
    ///
    /// # Errors
    /// [`MoeError::File`] naming the shard and the tensor if a tensor is missing, has another
    /// shape than expected, a dtype other than f32, bf16, f16 or f64, or (unless
    /// `options.allow_nonfinite`) a NaN or infinite value.
    pub(crate) fn read(
        &self,
        wanted: &[(String, Vec<usize>)],
        options: &ImportOptions,
    ) -> Result<HashMap<String, StoredTensor>> {
        let mut by_shard: BTreeMap<&str, Vec<&(String, Vec<usize>)>> = BTreeMap::new();
        for entry in wanted {
            by_shard.entry(self.shard_of(&entry.0)?).or_default().push(entry);
        }
        let mut out = HashMap::with_capacity(wanted.len());
        for (shard, entries) in by_shard {
            let path = file_in(&self.dir, shard, &self.listing())?;
            let map = map_regular(&path)?;
            let st = parse(&map, &path)?;
            for (name, shape) in entries {
                let view = st.tensor(name).map_err(|_| {
                    MoeError::file(
                        &path,
                        format!("missing tensor `{name}` (the index puts it in this shard)"),
                    )
                })?;
                if view.shape() != shape.as_slice() {
                    return Err(MoeError::file(
                        &path,
                        format!(
                            "tensor `{name}` has shape {:?}, config.json implies {shape:?}",
                            view.shape()
                        ),
                    ));
                }
                let values = widen(view.dtype(), view.data(), shape)
                    .map_err(|reason| MoeError::file(&path, format!("tensor `{name}`: {reason}")))?;
                if !options.allow_nonfinite {
                    if let Some(at) = values.iter().position(|v| !v.is_finite()) {
                        return Err(MoeError::file(
                            &path,
                            format!(
                                "tensor `{name}` holds a non-finite value ({} at flat index {at}); pass --allow-nonfinite (ImportOptions::allow_nonfinite) to accept it",
                                values[at]
                            ),
                        ));
                    }
                }
                out.insert(
                    name.clone(),
                    StoredTensor {
                        dtype: view.dtype(),
                        values,
                    },
                );
            }
        }
        Ok(out)
    }
}

/// Parses a mapped safetensors file.
pub(crate) fn parse<'a>(bytes: &'a [u8], path: &Path) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| MoeError::file(path, format!("not a safetensors file: {e:?}")))
}

/// Parses only the header of a mapped safetensors file (the safetensors crate bounds its
/// length and checks every tensor's offsets against the file).
pub(crate) fn header(bytes: &[u8], path: &Path) -> Result<(usize, safetensors::tensor::Metadata)> {
    SafeTensors::read_metadata(bytes)
        .map_err(|e| MoeError::file(path, format!("not a safetensors file: {e:?}")))
}

/// The values of a stored tensor as f32.
fn widen(dtype: Dtype, bytes: &[u8], shape: &[usize]) -> std::result::Result<Vec<f32>, String> {
    let burn_dtype = match dtype {
        Dtype::F32 => DType::F32,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        Dtype::F64 => DType::F64,
        other => return Err(format!("dtype {other:?} is not supported (f32, bf16, f16, f64)")),
    };
    TensorData::from_bytes_vec(bytes.to_vec(), shape.to_vec(), burn_dtype)
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| format!("cannot read values: {e:?}"))
}

/// `values` in the stored `dtype`, as little-endian bytes (f32 → bf16/f16 rounds to nearest,
/// which gives back the stored bits for values that were widened from that dtype).
pub(crate) fn narrow(values: &[f32], dtype: Dtype) -> std::result::Result<Vec<u8>, String> {
    let data = TensorData::new(values.to_vec(), [values.len()]);
    let data = match dtype {
        Dtype::F32 => data,
        Dtype::BF16 => data.convert::<bf16>(),
        Dtype::F16 => data.convert::<f16>(),
        Dtype::F64 => data.convert::<f64>(),
        other => return Err(format!("dtype {other:?} is not supported (f32, bf16, f16, f64)")),
    };
    Ok(data.as_bytes().to_vec())
}
