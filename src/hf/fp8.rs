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
    /// The block of an fp8 `quantization_config` (`weight_block_size: [rows, cols]`).
    ///
    /// # Errors
    /// A reason naming the key if the block size is not two positive integers.
    pub(crate) fn from_quantization_config(q: &Value) -> Result<Self, String> {
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
            [rows, cols] => Ok(Self { rows, cols }),
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

/// The `[rows, cols]` weight `w` as float8_e4m3fn values (returned as the f32 values they
/// stand for) and block scales, given the checkpoint's block scales `scale` (`grid` layout).
/// A block keeps its scale where `w · (1 / scale)` stays within ±464, which clamping to 448
/// moves by no more than rounding would (half the spacing of 32 between 448 and the next
/// power's values), so a weight that was imported and not changed is written back to the
/// same bits (its largest value comes back as `448 · scale · (1 / scale)`, a rounding away
/// from 448). A block that no longer fits
/// gets transformers' scale (`Fp8Quantize`: `scales = 448 / amax` computed as
/// `(1 / amax) · 448`, stored as `1 / scales`,
/// `q = clamp(w · scales, ±448)` rounded to nearest even). Returns the values, the scales
/// and how many blocks were rescaled.
pub(crate) fn quantize(
    w: &[f32],
    shape: [usize; 2],
    scale: &[f32],
    blocks: Fp8Blocks,
) -> (Vec<f32>, Vec<f32>, usize) {
    let [rows, cols] = shape;
    let grid_cols = cols.div_ceil(blocks.cols);
    let mut inv = scale.to_vec();
    let mut forward: Vec<f32> = scale.iter().map(|s| 1.0 / s).collect();
    let mut rescaled = 0;
    // `scale` holds one value per block: the reader checked its shape against the grid.
    for (b, (inv_b, forward_b)) in inv.iter_mut().zip(&mut forward).enumerate() {
        let (bi, bj) = (b / grid_cols, b % grid_cols);
        let amax = (bi * blocks.rows..((bi + 1) * blocks.rows).min(rows))
            .flat_map(|i| {
                w[i * cols + bj * blocks.cols..i * cols + ((bj + 1) * blocks.cols).min(cols)].iter()
            })
            .fold(0f32, |m, v| m.max(v.abs()));
        if amax * *forward_b > E4M3_KEEP || !forward_b.is_finite() {
            // transformers writes `_FP8_MAX / safe_max_abs`, and torch evaluates a number
            // divided by a tensor as the tensor's reciprocal times the number
            // (`Tensor.__rtruediv__`): two roundings, kept here for the same bits.
            let scales = if amax > 0.0 { (1.0 / amax) * E4M3_MAX } else { 1.0 };
            *forward_b = scales;
            *inv_b = 1.0 / scales;
            rescaled += 1;
        }
    }
    let mut q = Vec::with_capacity(rows * cols);
    for i in 0..rows {
        let forward_row = &forward[(i / blocks.rows) * grid_cols..][..grid_cols];
        for j in 0..cols {
            let scaled = (w[i * cols + j] * forward_row[j / blocks.cols]).clamp(-E4M3_MAX, E4M3_MAX);
            q.push(e4m3_to_f32(f32_to_e4m3(scaled)));
        }
    }
    (q, inv, rescaled)
}

/// The largest finite float8_e4m3fn value.
const E4M3_MAX: f32 = 448.0;

/// The largest scaled value a block keeps its scale for: 448 plus half the spacing (32) of
/// the values at the top of the range.
const E4M3_KEEP: f32 = 464.0;

/// `x` (within ±448, not NaN) rounded to the nearest float8_e4m3fn value, ties to the even
/// code (the one whose last mantissa bit is 0), as torch's cast rounds.
pub(crate) fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0x00 };
    if x.is_nan() {
        return sign | 0x7F;
    }
    let magnitude = x.abs();
    // Codes 0x00..=0x7E are the non-negative finite values in increasing order.
    let (mut lo, mut hi) = (0u8, 0x7Eu8);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if e4m3_to_f32(mid) <= magnitude {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (below, above) = (magnitude - e4m3_to_f32(lo), e4m3_to_f32(hi) - magnitude);
    let code = if magnitude >= e4m3_to_f32(hi) || above < below || (above == below && hi % 2 == 0) {
        hi
    } else {
        lo
    };
    sign | code
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
    fn every_e4m3_value_encodes_to_itself_and_midpoints_round_to_even() {
        for bits in (0u8..=0xFF).filter(|b| b & 0x7F != 0x7F) {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(bits)), bits, "{bits:#04x}");
        }
        // 1.0 (0x38) and 1.125 (0x39): the midpoint goes to the even code, just above it up.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.0626), 0x39);
        // 1.125 (0x39) and 1.25 (0x3A): the midpoint goes up to the even code.
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
        assert_eq!(f32_to_e4m3(-448.0), 0xFE);
        assert_eq!(f32_to_e4m3(2f32.powi(-11)), 0x00); // below half the smallest subnormal
    }

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
}
