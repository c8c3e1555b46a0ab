//! The canonical layer file on disk: safetensors under the reference cases' tensor names and
//! layouts (see `crate::format`), read and written whole, and the checks every loader applies
//! to what it read (names, shapes).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::tensor::{DType, TensorData};
use safetensors::{Dtype, SafeTensors};

use super::MoeLayerConfig;
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
            other => {
                return Err(MoeError::file(
                    path,
                    format!("tensor `{name}` has dtype {other:?}; F32 and F64 are supported"),
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
