//! One reference case: a layer, an input, and the expected output and gradients.

use std::path::{Path, PathBuf};

use burn::tensor::TensorData;

use crate::error::{MoeError, Result};
use crate::layer::MoeLayerConfig;
use crate::layer::{parameter_shapes, read_safetensors, LayerMeta, TensorMap};

/// A reference case (see `tests/data/cases/README.md`): weights in the canonical layout, `x`,
/// `probe` (the loss is `sum(y · probe)`), and the expected `y`, `dx` and `grad.<param>`.
#[derive(Debug, Clone)]
pub struct Case {
    /// File stem, e.g. `paper_top1_gelu_bias`.
    pub name: String,
    /// Where it was read from.
    pub path: PathBuf,
    /// The meta JSON.
    pub meta: LayerMeta,
    /// The layer config the meta describes, for this case's batch.
    pub config: MoeLayerConfig,
    /// Every tensor in the file (and the generated ones, for a layer file).
    pub tensors: TensorMap,
    /// Whether `y`, `dx` and the gradients come from the float64 oracle of the spec rather
    /// than from the file (a layer file with weights only).
    pub expected_by_oracle: bool,
}

impl Case {
    /// Reads and checks a case file. Every tensor the function needs must be present with its
    /// shape; errors name the file and the tensor.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let (tensors, meta) = read_safetensors(path)?;
        let meta = meta.ok_or_else(|| MoeError::file(path, "no `meta` key in the safetensors metadata"))?;
        let meta = LayerMeta::parse(&meta).map_err(|e| MoeError::file(path, e.to_string()))?;
        let x = tensors
            .get("x")
            .ok_or_else(|| MoeError::file(path, "missing tensor `x`"))?;
        if x.shape.len() != 2 {
            return Err(MoeError::file(
                path,
                format!("tensor `x` has shape {:?}, expected [T, M]", x.shape.to_vec()),
            ));
        }
        let n_tokens = x.shape[0];
        if n_tokens == 0 {
            return Err(MoeError::file(
                path,
                "tensor `x` has no tokens ([0, M]): nothing to check",
            ));
        }
        let config = meta
            .to_config(Some(n_tokens))
            .map_err(|e| MoeError::file(path, e.to_string()))?;
        let case = Self {
            name: path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
            path: path.to_path_buf(),
            meta,
            config,
            tensors,
            expected_by_oracle: false,
        };
        for (name, shape) in case.expected_shapes() {
            let data = crate::layer::expect_tensor(&case.tensors, &name, &shape, path)?;
            all_finite(data, &name, path)?;
        }
        Ok(case)
    }

    /// Reads a case file, or a canonical layer file with weights only (what `mpipemoe
    /// convert` writes): then `x` and `probe` are `n_tokens` seeded random tokens and the
    /// expected tensors come from the float64 oracle of the spec.
    pub fn load_or_oracle(path: impl AsRef<Path>, n_tokens: usize, seed: u64) -> Result<Self> {
        let path = path.as_ref();
        let (tensors, meta) = read_safetensors(path)?;
        if tensors.contains_key("x") {
            return Self::load(path);
        }
        let meta = meta.ok_or_else(|| MoeError::file(path, "no `meta` key in the safetensors metadata"))?;
        let meta = LayerMeta::parse(&meta).map_err(|e| MoeError::file(path, e.to_string()))?;
        let config = meta
            .to_config(Some(n_tokens))
            .map_err(|e| MoeError::file(path, e.to_string()))?;
        let mut inputs = TensorMap::new();
        for (name, shape) in crate::layer::parameter_shapes(&config) {
            let data = crate::layer::expect_tensor(&tensors, name, &shape, path)?;
            all_finite(data, name, path)?;
            inputs.insert(name.to_string(), data.clone().convert::<f32>());
        }
        for name in ["x", "probe"] {
            let values = crate::experts::HostInit::new(seed, name, 0).uniform(n_tokens * config.d_model, 1.0);
            inputs.insert(name.into(), TensorData::new(values, [n_tokens, config.d_model]));
        }
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut case = Self::from_parts(&stem, &config, inputs)?;
        case.path = path.to_path_buf();
        case.meta = meta;
        case.expected_by_oracle = true;
        Ok(case)
    }

    /// Tokens in the case's batch.
    ///
    /// # Panics
    /// Never for a case from [`Case::load`] or [`Case::load_or_oracle`], which check `x`.
    pub fn n_tokens(&self) -> usize {
        self.tensors["x"].shape[0]
    }

    /// Every tensor a case must hold, with its shape.
    pub fn expected_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let tokens = vec![self.n_tokens(), self.config.d_model];
        let mut out: Vec<(String, Vec<usize>)> = ["x", "y", "probe", "dx"]
            .into_iter()
            .map(|n| (n.to_string(), tokens.clone()))
            .collect();
        for (name, shape) in parameter_shapes(&self.config) {
            out.push((name.to_string(), shape.clone()));
            out.push((format!("grad.{name}"), shape));
        }
        out
    }

    /// A tensor of the case (present after [`Case::load`] succeeded for expected names).
    pub fn tensor(&self, name: &str) -> &TensorData {
        &self.tensors[name]
    }
}

/// Checks that a tensor of a case file holds no NaN or infinite value.
///
/// # Errors
/// [`MoeError::File`] naming the file, the tensor and the first bad value's index.
fn all_finite(data: &TensorData, name: &str, path: &Path) -> Result<()> {
    let values = data
        .clone()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| MoeError::file(path, format!("tensor `{name}`: {e:?}")))?;
    match values.iter().position(|v| !v.is_finite()) {
        Some(at) => Err(MoeError::file(
            path,
            format!(
                "tensor `{name}` holds a non-finite value ({} at flat index {at})",
                values[at]
            ),
        )),
        None => Ok(()),
    }
}
