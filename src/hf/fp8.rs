//! FP8 block-scaled weights, as DeepSeek-V3 and Qwen3 publish them: a projection's `weight`
//! stored as `float8_e4m3fn`, its sibling `weight_scale_inv` (float32 or bfloat16) holding one
//! scale per block of `weight_block_size` (`quantization_config` in `config.json`, 128 x 128 in
//! the published checkpoints). Dequantised on import:
//! `w[i, j] = f32(q[i, j]) · f32(scale_inv[i / block_rows, j / block_cols])`, one f32 product,
//! as transformers' `Fp8Dequantize` computes it (`integrations/finegrained_fp8.py`: both
//! sides promoted to float32, multiplied, then cast to the model's dtype). A matrix whose
//! sides are not multiples of the block has partial last blocks (the scale grid is the
//! ceiling), as DeepSeek's own `weight_dequant` kernel and transformers'
//! `_dequantize_fp8_weight` treat them.

use safetensors::Dtype;
use serde_json::Value;

/// The block size of a checkpoint's FP8 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Fp8Blocks {
    pub rows: usize,
    pub cols: usize,
}

impl Fp8Blocks {
    /// The block of `config.json`'s `quantization_config` (`quant_method: "fp8"`,
    /// `weight_block_size: [rows, cols]`), `None` without a `quantization_config`.
    ///
    /// # Errors
    /// A reason naming the key if the method is not fp8 or the block size is not two
    /// positive integers.
    pub(crate) fn from_config(json: &Value) -> Result<Option<Self>, String> {
        let Some(q) = json.get("quantization_config") else {
            return Ok(None);
        };
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        if method != "fp8" {
            return Err(format!(
                "`quantization_config.quant_method` is {method:?}: only \"fp8\" (block-scaled float8_e4m3fn) is supported"
            ));
        }
        let bad = || {
            format!(
                "`quantization_config.weight_block_size` is {}: two positive integers (rows, columns) expected",
                q.get("weight_block_size").map_or("missing".into(), Value::to_string)
            )
        };
        let sizes = q
            .get("weight_block_size")
            .and_then(Value::as_array)
            .ok_or_else(bad)?;
        let sizes: Vec<usize> = sizes
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|v| usize::try_from(v).ok())
                    .filter(|&v| v > 0)
            })
            .collect::<Option<_>>()
            .ok_or_else(bad)?;
        match sizes[..] {
            [rows, cols] => Ok(Some(Self { rows, cols })),
            _ => Err(bad()),
        }
    }

    /// The scale grid a `[rows, cols]` weight needs: one scale per (possibly partial) block.
    pub(crate) fn grid(&self, shape: &[usize]) -> Option<[usize; 2]> {
        match shape {
            [rows, cols] => Some([rows.div_ceil(self.rows), cols.div_ceil(self.cols)]),
            _ => None,
        }
    }
}

/// The name of a weight's scale, as transformers derives it (`Fp8Quantize`): `x.weight` →
/// `x.weight_scale_inv`.
pub(crate) fn scale_name(weight: &str) -> String {
    match weight.strip_suffix(".weight") {
        Some(stem) => format!("{stem}.weight_scale_inv"),
        None => format!("{weight}_scale_inv"),
    }
}

/// Whether a stored dtype is the FP8 format this reader dequantises.
pub(crate) fn is_fp8(dtype: Dtype) -> bool {
    dtype == Dtype::F8_E4M3
}

/// The `[rows, cols]` weight `q` (float8_e4m3fn bytes) times its block scales `scale`
/// (`grid` = `blocks.grid(shape)`, row-major), in f32.
pub(crate) fn dequantize(q: &[u8], shape: [usize; 2], scale: &[f32], blocks: Fp8Blocks) -> Vec<f32> {
    let [rows, cols] = shape;
    let grid_cols = cols.div_ceil(blocks.cols);
    let mut out = Vec::with_capacity(rows * cols);
    for i in 0..rows {
        let scale_row = &scale[(i / blocks.rows) * grid_cols..][..grid_cols];
        for j in 0..cols {
            out.push(e4m3_to_f32(q[i * cols + j]) * scale_row[j / blocks.cols]);
        }
    }
    out
}

/// One float8_e4m3fn value (1 sign, 4 exponent bits biased by 7, 3 mantissa bits; no
/// infinities, `S.1111.111` is NaN; the largest value is 448) as f32, exactly.
pub(crate) fn e4m3_to_f32(bits: u8) -> f32 {
    let sign = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
    let exponent = i32::from((bits >> 3) & 0x0F);
    let mantissa = f32::from(bits & 0x07);
    if exponent == 0x0F && bits & 0x07 == 0x07 {
        return f32::NAN;
    }
    let magnitude = if exponent == 0 {
        mantissa / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + mantissa / 8.0) * 2f32.powi(exponent - 7)
    };
    sign * magnitude
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_decodes_its_landmarks() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exponent 7, mantissa 0
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0); // the largest finite value
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // the smallest subnormal
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // the smallest normal
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
    }

    /// A 20 x 40 matrix in 8 x 16 blocks (partial last blocks both ways), against
    /// transformers' `_dequantize_fp8_weight` (tests/data/hf/generated/make_fp8.py).
    #[test]
    fn partial_blocks_take_their_block_scale_as_transformers_does() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/hf/generated/deepseek-v3-fp8-tiny.dequantized.safetensors");
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (q, scale, want) = (
            st.tensor("partial.weight_fp8").unwrap(),
            st.tensor("partial.weight_scale_inv").unwrap(),
            st.tensor("partial.weight").unwrap(),
        );
        assert_eq!((q.shape(), scale.shape()), (&[20, 40][..], &[3, 3][..]));
        let f32s = |b: &[u8]| -> Vec<f32> {
            b.chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let blocks = Fp8Blocks { rows: 8, cols: 16 };
        assert_eq!(blocks.grid(&[20, 40]), Some([3, 3]));
        let got = dequantize(q.data(), [20, 40], &f32s(scale.data()), blocks);
        let want = f32s(want.data());
        assert!(
            got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
            "differs from transformers"
        );
        // Every bit pattern decodes as torch decodes it (NaN as NaN).
        let table = f32s(st.tensor("e4m3.table").unwrap().data());
        for (bits, want) in table.iter().enumerate() {
            let got = e4m3_to_f32(bits as u8);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#04x}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn the_block_size_is_read_or_refused_by_name() {
        let cfg =
            |q: &str| serde_json::from_str::<Value>(&format!("{{\"quantization_config\": {q}}}")).unwrap();
        assert_eq!(Fp8Blocks::from_config(&Value::Null), Ok(None));
        assert_eq!(
            Fp8Blocks::from_config(&cfg(r#"{"quant_method": "fp8", "weight_block_size": [128, 64]}"#)),
            Ok(Some(Fp8Blocks { rows: 128, cols: 64 }))
        );
        for bad in [
            r#"{"quant_method": "fp8", "weight_block_size": [128]}"#,
            r#"{"quant_method": "fp8", "weight_block_size": [0, 128]}"#,
            r#"{"quant_method": "fp8"}"#,
        ] {
            let err = Fp8Blocks::from_config(&cfg(bad)).unwrap_err();
            assert!(err.contains("weight_block_size"), "{err}");
        }
        let err = Fp8Blocks::from_config(&cfg(r#"{"quant_method": "gptq"}"#)).unwrap_err();
        assert!(err.contains("quant_method"), "{err}");
    }
}
