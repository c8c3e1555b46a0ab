//! What `config.json`'s `quantization_config` says a checkpoint stores: FP8 block-scaled
//! weights (DeepSeek-V3, Qwen3) or MXFP4 experts (GPT-OSS).

use serde_json::Value;

use super::fp8::Fp8Blocks;
use crate::error::{MoeError, Result};

/// Refuses `values` (tensor `name`, of `shape`) before they are quantised to `format`
/// (`float8_e4m3fn`, `mxfp4`) if one is NaN or infinite: neither format holds an infinity,
/// and a block's scale computed from one would be infinite, so every value of the block
/// would load as NaN. The export calls it before anything is written, so the folder is left
/// as it was.
///
/// # Errors
/// [`MoeError::Input`] naming the tensor, the value and its index.
pub(crate) fn refuse_nonfinite(name: &str, values: &[f32], shape: &[usize], format: &str) -> Result<()> {
    let Some(at) = values.iter().position(|v| !v.is_finite()) else {
        return Ok(());
    };
    // The flat index as one index per dimension, last dimension fastest.
    let mut index = vec![0; shape.len()];
    let mut rest = at;
    for (i, &dim) in shape.iter().enumerate().rev() {
        index[i] = rest % dim.max(1);
        rest /= dim.max(1);
    }
    Err(MoeError::Input(format!(
        "`{name}` holds {} at {index:?}: {format} has no infinity or NaN, and the block holding \
         it would load as NaN throughout; nothing was written",
        values[at]
    )))
}

/// A checkpoint's quantisation, from `quantization_config.quant_method`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Quantization {
    /// `"fp8"`: float8_e4m3fn weights with a `weight_scale_inv` per block.
    Fp8(Fp8Blocks),
    /// `"mxfp4"`: stacked expert projections as `_blocks` / `_scales` (see `super::mxfp4`).
    Mxfp4,
}

impl Quantization {
    /// The quantisation `json` (a `config.json`) declares; `None` without a
    /// `quantization_config`.
    ///
    /// # Errors
    /// A reason naming the key if the method is neither `"fp8"` nor `"mxfp4"`, or the FP8
    /// block size is bad.
    pub(crate) fn from_config(json: &Value) -> Result<Option<Self>, String> {
        let Some(q) = json.get("quantization_config") else {
            return Ok(None);
        };
        match q.get("quant_method").and_then(Value::as_str).unwrap_or("") {
            "fp8" => {
                // DeepSeek-V3's config names the float8 format (`"fmt": "e4m3"`); the
                // weights are read as float8_e4m3fn, so a config that says otherwise
                // describes another checkpoint than its tensors, and is refused by name.
                match q.get("fmt").filter(|f| !f.is_null()) {
                    None => {}
                    Some(Value::String(f)) if f == "e4m3" => {}
                    Some(other) => {
                        return Err(format!(
                            "`quantization_config.fmt` is {other}: only \"e4m3\" (float8_e4m3fn weights) is read"
                        ))
                    }
                }
                Ok(Some(Self::Fp8(Fp8Blocks::from_quantization_config(q)?)))
            }
            "mxfp4" => Ok(Some(Self::Mxfp4)),
            method => Err(format!(
                "`quantization_config.quant_method` is {method:?}: \"fp8\" (block-scaled float8_e4m3fn) and \"mxfp4\" (GPT-OSS's packed experts) are supported"
            )),
        }
    }

    /// The FP8 block size, for an fp8 checkpoint.
    pub(crate) fn fp8(self) -> Option<Fp8Blocks> {
        match self {
            Self::Fp8(blocks) => Some(blocks),
            Self::Mxfp4 => None,
        }
    }

    /// How the quantised weights are stored, for a layer's description.
    pub(crate) fn describe(self) -> String {
        match self {
            Self::Fp8(b) => format!("float8_e4m3fn in {} x {} blocks", b.rows, b.cols),
            Self::Mxfp4 => "mxfp4 experts (e2m1, an e8m0 scale per 32)".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_method_and_block_size_are_read_or_refused_by_name() {
        let cfg =
            |q: &str| serde_json::from_str::<Value>(&format!("{{\"quantization_config\": {q}}}")).unwrap();
        assert_eq!(Quantization::from_config(&Value::Null), Ok(None));
        assert_eq!(
            Quantization::from_config(&cfg(r#"{"quant_method": "fp8", "weight_block_size": [128, 64]}"#)),
            Ok(Some(Quantization::Fp8(Fp8Blocks { rows: 128, cols: 64 })))
        );
        assert_eq!(
            Quantization::from_config(&cfg(r#"{"quant_method": "mxfp4", "modules_to_not_convert": []}"#)),
            Ok(Some(Quantization::Mxfp4))
        );
        assert_eq!(
            Quantization::from_config(&cfg(
                r#"{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}"#
            )),
            Ok(Some(Quantization::Fp8(Fp8Blocks { rows: 128, cols: 128 })))
        );
        let e5m2 = Quantization::from_config(&cfg(
            r#"{"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}"#,
        ))
        .unwrap_err();
        assert!(
            e5m2.contains("quantization_config.fmt") && e5m2.contains("e5m2"),
            "{e5m2}"
        );
        for bad in [
            r#"{"quant_method": "fp8", "weight_block_size": [128]}"#,
            r#"{"quant_method": "fp8", "weight_block_size": [0, 128]}"#,
            r#"{"quant_method": "fp8"}"#,
        ] {
            let err = Quantization::from_config(&cfg(bad)).unwrap_err();
            assert!(err.contains("weight_block_size"), "{err}");
        }
        let err = Quantization::from_config(&cfg(r#"{"quant_method": "gptq"}"#)).unwrap_err();
        assert!(err.contains("quant_method") && err.contains("gptq"), "{err}");
    }
}
