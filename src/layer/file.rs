//! The canonical layer file on disk: safetensors under the reference cases' tensor names and
//! layouts (see `crate::format`), read and written whole, and the checks every loader applies
//! to what it read (names, shapes).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::tensor::{DType, TensorData};
use safetensors::{Dtype, SafeTensors};

use super::{LayerMeta, MoeLayerConfig};
use crate::error::{MoeError, Result};

/// Tensors by name, as read from a file (always f32).
pub type TensorMap = BTreeMap<String, TensorData>;

/// The parameter tensors of a layer with `config` and their full (all-experts) shapes.
pub(crate) fn parameter_shapes(config: &MoeLayerConfig) -> Vec<(&'static str, Vec<usize>)> {
    let (e, m, h) = (config.n_experts, config.d_model, config.d_hidden);
    let f = config.activation.d_inner(h);
    let mut out = vec![("router.weight", vec![e, m])];
    if config.router_bias {
        out.push(("router.bias", vec![e]));
    }
    if config.score_bias {
        out.push(("router.score_bias", vec![e]));
    }
    out.push(("experts.w_in", vec![e, m, f]));
    if config.bias {
        out.push(("experts.b_in", vec![e, f]));
    }
    out.push(("experts.w_out", vec![e, h, m]));
    if config.bias {
        out.push(("experts.b_out", vec![e, m]));
    }
    if let Some(hs) = config.shared_expert {
        out.push(("shared.w_in", vec![m, 2 * hs]));
        out.push(("shared.w_out", vec![hs, m]));
        if config.shared_expert_gate {
            out.push(("shared.gate.weight", vec![1, m]));
        }
    }
    out
}

/// Reads every tensor of a safetensors file (as f32) and its `meta` JSON, if any. The file
/// must be a regular file; no more than its length is read.
///
/// # Errors
/// [`MoeError::File`] naming the file (and the tensor) if it is not a regular safetensors
/// file or holds a dtype other than F32 or F64.
pub fn read_safetensors(path: &Path) -> Result<(TensorMap, Option<String>)> {
    let bytes = crate::files::read_bounded(path, u64::MAX)?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| MoeError::file(path, format!("not a safetensors file: {e:?}")))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| MoeError::file(path, format!("bad safetensors header: {e:?}")))?;
    let meta = header.metadata().as_ref().and_then(|m| m.get("meta").cloned());
    let mut tensors = TensorMap::new();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let data = match view.dtype() {
            Dtype::F32 => TensorData::from_bytes_vec(view.data().to_vec(), shape, DType::F32),
            Dtype::F64 => {
                TensorData::from_bytes_vec(view.data().to_vec(), shape, DType::F64).convert::<f32>()
            }
            Dtype::BF16 => {
                TensorData::from_bytes_vec(view.data().to_vec(), shape, DType::BF16).convert::<f32>()
            }
            Dtype::F16 => {
                TensorData::from_bytes_vec(view.data().to_vec(), shape, DType::F16).convert::<f32>()
            }
            other => {
                return Err(MoeError::file(
                    path,
                    format!("tensor `{name}` has dtype {other:?}; F32, F64, BF16 and F16 are supported"),
                ))
            }
        };
        tensors.insert(name, data);
    }
    Ok((tensors, meta))
}

/// Writes `tensors` (f32) and the `meta` JSON to a safetensors file, whole: into a temporary
/// file beside `path`, then renamed over it (an existing file is replaced only then).
///
/// # Errors
/// [`MoeError::File`] naming `path` if a tensor cannot be encoded or the file written.
pub fn write_safetensors(path: &Path, tensors: &TensorMap, meta: &str) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(name, data)| {
            let view = safetensors::tensor::TensorView::new(Dtype::F32, data.shape.to_vec(), data.as_bytes())
                .map_err(|e| MoeError::file(path, format!("tensor `{name}`: {e:?}")))?;
            Ok((name.clone(), view))
        })
        .collect::<Result<Vec<_>>>()?;
    let info = HashMap::from([("meta".to_string(), meta.to_string())]);
    let bytes = safetensors::serialize(views, Some(info))
        .map_err(|e| MoeError::file(path, format!("cannot encode: {e:?}")))?;
    crate::files::write_whole(path, &bytes, true)
}

/// Reads the layer a canonical layer file describes: its `meta` parsed into a config, and every
/// parameter tensor that config needs checked for presence and shape, before anything uses
/// them. What `MoeLayer::load_safetensors`, `mpipemoe check` and `mpipemoe convert --to-hf`
/// all apply, so that a file whose meta disagrees with its tensors is refused the same way
/// everywhere.
///
/// # Errors
/// [`MoeError::File`] naming `path` and the missing key, the bad meta value, or the tensor
/// whose shape the meta contradicts.
pub fn layer_file_config(tensors: &TensorMap, meta: Option<&str>, path: &Path) -> Result<MoeLayerConfig> {
    let meta = meta.ok_or_else(|| MoeError::file(path, "no `meta` key in the safetensors metadata"))?;
    let meta = LayerMeta::parse(meta).map_err(|e| MoeError::file(path, e.to_string()))?;
    let n_tokens = tensors.get("x").map(|x| x.shape.to_vec()[0]);
    let config = meta
        .to_config(n_tokens)
        .map_err(|e| MoeError::file(path, e.to_string()))?;
    for (name, shape) in parameter_shapes(&config) {
        expect_tensor(tensors, name, &shape, path)?;
    }
    Ok(config)
}

/// Looks up `name` in `tensors` and checks its shape; errors name the file and the tensor.
pub(crate) fn expect_tensor<'a>(
    tensors: &'a TensorMap,
    name: &str,
    shape: &[usize],
    source: &Path,
) -> Result<&'a TensorData> {
    let data = tensors
        .get(name)
        .ok_or_else(|| MoeError::file(source, format!("missing tensor `{name}`")))?;
    if data.shape.to_vec() != shape {
        return Err(MoeError::file(
            source,
            format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                data.shape.to_vec()
            ),
        ));
    }
    Ok(data)
}

/// Rows `range` of a tensor along its first dimension.
pub(crate) fn slice_first_dim(data: &TensorData, range: std::ops::Range<usize>) -> TensorData {
    let dims = &data.shape.to_vec();
    let row: usize = dims[1..].iter().product::<usize>() * data.dtype.size();
    let bytes = data.as_bytes()[range.start * row..range.end * row].to_vec();
    let mut shape = dims.clone();
    shape[0] = range.len();
    TensorData::from_bytes_vec(bytes, shape, data.dtype)
}
