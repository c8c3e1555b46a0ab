//! A Hugging Face checkpoint folder: `config.json`, one `model.safetensors` or shards listed by
//! `model.safetensors.index.json`, read through memory maps.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use burn::tensor::{bf16, f16, DType, TensorData};
use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use super::fp8::{dequantize, is_fp8, scale_name};
use super::layout::HfEntry;
use super::quantization::Quantization;
use crate::error::{MoeError, Result};
use crate::files::{file_in, map_regular, read_text};

/// One tensor as stored: its dtype, and its values widened to f32 (exact for bf16, f16 and
/// f32) or dequantised (FP8, MXFP4: `quantized`; `dtype` is then the stored form's, float8 or
/// the uint8 of MXFP4's blocks).
#[derive(Debug, Clone)]
pub(crate) struct StoredTensor {
    pub dtype: Dtype,
    pub values: Vec<f32>,
    pub quantized: bool,
}

/// The name transformers gives a stored dtype (`config.json`'s `dtype`).
pub(crate) fn dtype_name(dtype: Dtype) -> String {
    match dtype {
        Dtype::F32 => "float32".into(),
        Dtype::BF16 => "bfloat16".into(),
        Dtype::F16 => "float16".into(),
        Dtype::F64 => "float64".into(),
        Dtype::F8_E4M3 => "float8_e4m3fn".into(),
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

/// What reading a checkpoint cost: the metadata parsed and the tensor bytes copied out of the
/// shards. [`HfCheckpoint::stats`](crate::hf::HfCheckpoint::stats) reports it, so a loader can
/// see that each shard is mapped, and its header parsed, once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReadStats {
    /// Shards memory-mapped (each at most once per open checkpoint).
    pub shards_mapped: usize,
    /// Bytes of JSON parsed: `config.json`, the index, and every mapped shard's header.
    pub metadata_bytes: u64,
    /// Bytes of tensor data copied out of the maps (the wanted tensors only).
    pub tensor_bytes: u64,
}

/// One mapped shard and its parsed header.
pub(crate) struct Shard {
    pub path: PathBuf,
    map: Mmap,
    /// Bytes before the tensor data: the 8-byte length and the header.
    data_start: usize,
    pub meta: Metadata,
}

impl Shard {
    /// The stored bytes of the tensor `info` describes. Its offsets were checked
    /// against the file's length when the header was parsed (`Metadata::validate`).
    pub(super) fn data(&self, info: &TensorInfo) -> &[u8] {
        let (start, end) = info.data_offsets;
        &self.map[self.data_start + start..self.data_start + end]
    }
}

/// The folder and where each tensor lives. Shards are mapped, and their headers parsed, the
/// first time a tensor of theirs is wanted, and kept for the checkpoint's life.
pub(crate) struct Checkpoint {
    pub dir: PathBuf,
    /// Tensor name → shard file name (relative to `dir`; a plain file name inside it).
    pub weight_map: BTreeMap<String, String>,
    /// What `quantization_config` says is quantised, if anything.
    pub quant: Option<Quantization>,
    shards: Mutex<BTreeMap<String, Arc<Shard>>>,
    stats: Mutex<ReadStats>,
}

impl Checkpoint {
    /// Opens `dir`: the index if there is one, else the single `model.safetensors`. Every
    /// shard name in the index must be a plain file name inside `dir` (no `..`, no absolute
    /// path, no symbolic link out of it).
    pub(crate) fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let ckpt = Self {
            dir: dir.to_path_buf(),
            weight_map: BTreeMap::new(),
            quant: None,
            shards: Mutex::default(),
            stats: Mutex::default(),
        };
        let weight_map = if index.exists() {
            let text = read_text(&index)?;
            ckpt.count(|s| s.metadata_bytes += text.len() as u64);
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
            ckpt.shard("model.safetensors")?
                .meta
                .tensors()
                .into_keys()
                .map(|n| (n, "model.safetensors".to_string()))
                .collect()
        };
        Ok(Self { weight_map, ..ckpt })
    }

    /// Adds to the read statistics.
    pub(crate) fn count(&self, add: impl FnOnce(&mut ReadStats)) {
        add(&mut self.stats.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
    }

    /// What has been read so far.
    pub(crate) fn stats(&self) -> ReadStats {
        *self.stats.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Shard `file`, mapped and its header parsed on first use.
    fn shard(&self, file: &str) -> Result<Arc<Shard>> {
        let mut shards = self
            .shards
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(shard) = shards.get(file) {
            return Ok(shard.clone());
        }
        let path = file_in(&self.dir, file, &self.listing())?;
        let map = map_regular(&path)?;
        let (header_len, meta) = header(&map, &path)?;
        self.count(|s| {
            s.shards_mapped += 1;
            s.metadata_bytes += header_len as u64;
        });
        let shard = Arc::new(Shard {
            path,
            map,
            data_start: 8 + header_len,
            meta,
        });
        shards.insert(file.to_string(), shard.clone());
        Ok(shard)
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

    /// The shard holding `name` and the tensor's header entry.
    pub(super) fn locate(&self, name: &str) -> Result<(Arc<Shard>, TensorInfo)> {
        let shard = self.shard(self.shard_of(name)?)?;
        let info = shard.meta.info(name).cloned().ok_or_else(|| {
            MoeError::file(
                &shard.path,
                format!("missing tensor `{name}` (the index puts it in this shard)"),
            )
        })?;
        Ok((shard, info))
    }

    /// The stored dtype and shape of each tensor in `names`, from the shards' headers only
    /// (no tensor data is read). A projection stored in MXFP4 has its logical shape and the
    /// blocks' dtype (uint8).
    ///
    /// # Errors
    /// [`MoeError::File`] naming the index or shard if a tensor is missing or a header is bad.
    pub(crate) fn header_shapes(&self, names: &[String]) -> Result<HashMap<String, (Dtype, Vec<usize>)>> {
        names
            .iter()
            .map(|name| {
                if let Some(packed) = self.mxfp4_header(name)? {
                    return Ok((name.clone(), packed));
                }
                let (_, info) = self.locate(name)?;
                Ok((name.clone(), (info.dtype, info.shape)))
            })
            .collect()
    }

    /// Reads the tensors `wanted` (name, expected shape, and the entries of its first
    /// dimension to read), copying out only those tensors, and of each only those entries.
    ///
    /// # Errors
    /// [`MoeError::File`] naming the shard and the tensor if a tensor is missing, has another
    /// shape than expected, a dtype other than f32, bf16, f16 or f64, or (unless
    /// `options.allow_nonfinite`) a NaN or infinite value; if part of an FP8 tensor is wanted.
    pub(crate) fn read(
        &self,
        wanted: &[HfEntry],
        options: &ImportOptions,
    ) -> Result<HashMap<String, StoredTensor>> {
        let mut out = HashMap::with_capacity(wanted.len());
        for entry in wanted {
            if let Some(tensor) = self.read_mxfp4(entry, options)? {
                out.insert(entry.name.clone(), tensor);
                continue;
            }
            let HfEntry { name, shape, rows } = entry;
            let (shard, info) = self.locate(name)?;
            let path = &shard.path;
            if info.shape != *shape {
                return Err(MoeError::file(
                    path,
                    format!(
                        "tensor `{name}` has shape {:?}, config.json implies {shape:?}",
                        info.shape
                    ),
                ));
            }
            let all_rows = shape.first().copied().unwrap_or(1);
            if rows.start > rows.end || rows.end > all_rows {
                return Err(MoeError::file(
                    path,
                    format!("tensor `{name}`: entries {rows:?} of its first dimension ({all_rows}) were asked for"),
                ));
            }
            let whole = rows.start == 0 && rows.end == all_rows;
            // The first dimension is outermost, so a range of it is one contiguous run of
            // the stored bytes; the header's offsets were checked against its shape.
            let bytes = shard.data(&info);
            let row_bytes = bytes.len() / all_rows.max(1);
            let bytes = &bytes[rows.start * row_bytes..rows.end * row_bytes];
            let mut read_shape = shape.clone();
            if let Some(first) = read_shape.first_mut() {
                *first = rows.len();
            }
            self.count(|s| s.tensor_bytes += bytes.len() as u64);
            let values = match (is_fp8(info.dtype), whole) {
                (true, true) => self.dequantize(name, &shard, &info)?,
                (true, false) => {
                    return Err(MoeError::file(
                        path,
                        format!("tensor `{name}` is float8_e4m3fn and stacked: block-scaled stacked experts are not supported"),
                    ))
                }
                (false, _) => widen(info.dtype, bytes, &read_shape)
                    .map_err(|reason| MoeError::file(path, format!("tensor `{name}`: {reason}")))?,
            };
            check_finite(name, &values, options, path)?;
            out.insert(
                name.clone(),
                StoredTensor {
                    dtype: info.dtype,
                    values,
                    quantized: is_fp8(info.dtype),
                },
            );
        }
        Ok(out)
    }
}

impl Checkpoint {
    /// FP8 weight `name` (in `shard`, described by `info`) times its block scales, in f32.
    ///
    /// # Errors
    /// [`MoeError::File`] naming the tensor if the checkpoint has no block size, the weight is
    /// not a matrix, or its scale is missing, not float32 / bfloat16, or of another shape than
    /// the block grid.
    fn dequantize(&self, name: &str, shard: &Shard, info: &TensorInfo) -> Result<Vec<f32>> {
        let path = &shard.path;
        let blocks = self.quant.and_then(Quantization::fp8).ok_or_else(|| {
            MoeError::file(
                path,
                format!("tensor `{name}` is float8_e4m3fn, but config.json has no `quantization_config` to give its block size"),
            )
        })?;
        let (shape, grid) = match (info.shape.as_slice(), blocks.grid(&info.shape)) {
            (&[rows, cols], Some(grid)) => ([rows, cols], grid),
            _ => {
                return Err(MoeError::file(
                    path,
                    format!(
                        "tensor `{name}` is float8_e4m3fn of shape {:?}: block scales need a matrix",
                        info.shape
                    ),
                ))
            }
        };
        let scale = scale_name(name);
        let (scale_shard, scale_info) = self.locate(&scale).map_err(|_| {
            MoeError::file(
                path,
                format!("tensor `{name}` is float8_e4m3fn, but its scale `{scale}` is missing"),
            )
        })?;
        if scale_info.shape != grid {
            return Err(MoeError::file(
                &scale_shard.path,
                format!(
                    "scale `{scale}` has shape {:?}; `{name}` {:?} in {} x {} blocks needs {grid:?}",
                    scale_info.shape, info.shape, blocks.rows, blocks.cols
                ),
            ));
        }
        if !matches!(scale_info.dtype, Dtype::F32 | Dtype::BF16) {
            return Err(MoeError::file(
                &scale_shard.path,
                format!(
                    "scale `{scale}` is {}: float32 or bfloat16 expected",
                    dtype_name(scale_info.dtype)
                ),
            ));
        }
        let scale_bytes = scale_shard.data(&scale_info);
        self.count(|s| s.tensor_bytes += scale_bytes.len() as u64);
        let scales = widen(scale_info.dtype, scale_bytes, &scale_info.shape)
            .map_err(|reason| MoeError::file(&scale_shard.path, format!("scale `{scale}`: {reason}")))?;
        Ok(dequantize(shard.data(info), shape, &scales, blocks))
    }
}

/// Refuses NaN or infinite `values` of tensor `name` (in the file `path`) unless
/// `options.allow_nonfinite`.
pub(super) fn check_finite(name: &str, values: &[f32], options: &ImportOptions, path: &Path) -> Result<()> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(at) if !options.allow_nonfinite => Err(MoeError::file(
            path,
            format!(
                "tensor `{name}` holds a non-finite value ({} at flat index {at}); pass --allow-nonfinite (ImportOptions::allow_nonfinite) to accept it",
                values[at]
            ),
        )),
        _ => Ok(()),
    }
}

/// Parses a mapped safetensors file.
pub(crate) fn parse<'a>(bytes: &'a [u8], path: &Path) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| MoeError::file(path, format!("not a safetensors file: {e:?}")))
}

/// Parses only the header of a mapped safetensors file (the safetensors crate bounds its
/// length and checks every tensor's offsets against the file).
pub(crate) fn header(bytes: &[u8], path: &Path) -> Result<(usize, Metadata)> {
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
        // The values of an FP8 weight were rounded to float8_e4m3fn values by
        // `fp8::quantize`; this only stores their bits.
        Dtype::F8_E4M3 => {
            return values
                .iter()
                .map(|&v| {
                    let bits = super::fp8::f32_to_e4m3(v);
                    match super::fp8::e4m3_to_f32(bits) == v || v.is_nan() {
                        true => Ok(bits),
                        false => Err(format!("{v} is not a float8_e4m3fn value")),
                    }
                })
                .collect();
        }
        // MXFP4's blocks and scales: bytes that `mxfp4::quantize` computed, carried as the
        // integers they are.
        Dtype::U8 => {
            return values
                .iter()
                .map(|&v| match v.fract() == 0.0 && (0.0..=255.0).contains(&v) {
                    true => Ok(v as u8),
                    false => Err(format!("{v} is not a byte")),
                })
                .collect();
        }
        other => return Err(format!("dtype {other:?} is not supported (f32, bf16, f16, f64)")),
    };
    Ok(data.as_bytes().to_vec())
}
