//! MXFP4 expert weights, as GPT-OSS publishes them: a stacked `[E, in, out]` projection
//! `x.gate_up_proj` stored as `x.gate_up_proj_blocks` (uint8 `[E, out, in / 32, 16]`, two
//! float4 e2m1 codes per byte, the low nibble first) and `x.gate_up_proj_scales` (uint8
//! `[E, out, in / 32]`, one e8m0 exponent per block of 32 along the input dimension).
//! `quantization_config.quant_method` is `"mxfp4"`.
//!
//! Dequantised on import as transformers' `convert_moe_packed_tensors`
//! (`integrations/mxfp4.py`) computes it: the code's value from the e2m1 table, times
//! `2^(scale - 127)` (`torch.ldexp`, a multiplication by a float32 power of two), then the
//! `[E, out, in]` result transposed to `[E, in, out]`. Every product is exact in float32 and
//! in bfloat16 (an e2m1 value has two significant bits; the smallest, `0.5 · 2^-127`, is a
//! subnormal both can hold), so the layer's dtype holds the dequantised values unrounded.
//!
//! This file is the format; `stored` reads and writes it in a checkpoint.

use safetensors::Dtype;

mod stored;

/// The values of the 16 float4 e2m1 codes (`FP4_VALUES` in transformers): sign bit 3,
/// exponent bits 2..1, mantissa bit 0.
const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Values per scale block (and so the divisor of the input dimension).
pub(crate) const BLOCK: usize = 32;

/// Bytes per block: two codes a byte.
pub(crate) const BLOCK_BYTES: usize = BLOCK / 2;

/// The names a packed projection `name` is stored under: its blocks and its scales.
pub(crate) fn packed_names(name: &str) -> (String, String) {
    (format!("{name}_blocks"), format!("{name}_scales"))
}

/// `2^(scale - 127)` as float32, as torch computes the power of two that `ldexp` multiplies
/// by: 255 (e8m0's NaN) gives infinity, so the block's values come out infinite or NaN and
/// the importer's non-finite check names the tensor.
fn e8m0_to_f32(scale: u8) -> f32 {
    match scale {
        // 2^-127 is a float32 subnormal: its bit 22 alone.
        0 => f32::from_bits(1 << 22),
        255 => f32::INFINITY,
        s => f32::from_bits(u32::from(s) << 23),
    }
}

/// The stored shapes of a projection of logical shape `[n, in, out]` (`n` experts): the
/// blocks' and the scales', or `None` if `in` is not a multiple of [`BLOCK`].
pub(crate) fn packed_shapes(shape: &[usize]) -> Option<(Vec<usize>, Vec<usize>)> {
    match *shape {
        [n, input, out] if input % BLOCK == 0 => Some((
            vec![n, out, input / BLOCK, BLOCK_BYTES],
            vec![n, out, input / BLOCK],
        )),
        _ => None,
    }
}

/// Whether a stored dtype is the one MXFP4 blocks and scales are stored in.
pub(crate) fn is_packed_dtype(dtype: Dtype) -> bool {
    dtype == Dtype::U8
}

/// The `[n, in, out]` projection (row-major f32) of `n` experts' packed `blocks`
/// (`[n, out, in / 32, 16]` bytes) and `scales` (`[n, out, in / 32]` bytes). The caller has
/// checked both lengths against `[n, in, out]` (see [`packed_shapes`]). Experts are decoded
/// on parallel threads.
pub(crate) fn dequantize(blocks: &[u8], scales: &[u8], shape: [usize; 3]) -> Vec<f32> {
    let [n, input, out] = shape;
    let groups = input / BLOCK;
    debug_assert_eq!(blocks.len(), n * out * groups * BLOCK_BYTES);
    debug_assert_eq!(scales.len(), n * out * groups);
    let mut values = vec![0f32; n * input * out];
    let experts: Vec<_> = values
        .chunks_exact_mut(input * out)
        .zip(blocks.chunks_exact(out * groups * BLOCK_BYTES))
        .zip(scales.chunks_exact(out * groups))
        .collect();
    on_threads(experts, |((values, blocks), scales)| {
        dequantize_expert(blocks, scales, values, input, out);
    });
    values
}

/// Values per tile: a tile is `TILE` stored rows (output columns) of one block of 32 inputs.
/// A stored row is one output column of the projection; decoding a tile and then writing it
/// as 32 runs of `TILE` contiguous values keeps both sides in cache, where writing each row
/// down its column touches a new cache line for every value.
const TILE: usize = 64;

/// One expert's `[in, out]` matrix `values` from its `[out, in / 32, 16]` `blocks` and
/// `[out, in / 32]` `scales`.
fn dequantize_expert(blocks: &[u8], scales: &[u8], values: &mut [f32], input: usize, out: usize) {
    let groups = input / BLOCK;
    // tile[t]: the 32 values of stored row `o0 + t` in this block.
    let mut tile = [[0f32; BLOCK]; TILE];
    for g in 0..groups {
        for o0 in (0..out).step_by(TILE) {
            let width = TILE.min(out - o0);
            for (t, decoded) in tile[..width].iter_mut().enumerate() {
                let row = (o0 + t) * groups + g;
                let scale = e8m0_to_f32(scales[row]);
                let bytes = &blocks[row * BLOCK_BYTES..][..BLOCK_BYTES];
                for (pair, &byte) in decoded.chunks_exact_mut(2).zip(bytes) {
                    pair[0] = E2M1[usize::from(byte & 0x0F)] * scale;
                    pair[1] = E2M1[usize::from(byte >> 4)] * scale;
                }
            }
            for i in 0..BLOCK {
                let run = &mut values[(g * BLOCK + i) * out + o0..][..width];
                for (v, decoded) in run.iter_mut().zip(&tile) {
                    *v = decoded[i];
                }
            }
        }
    }
}

/// Runs `work` on every item, the items split in contiguous runs over the machine's threads.
fn on_threads<T: Send>(items: Vec<T>, work: impl Fn(T) + Sync) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_thread = items.len().div_ceil(threads).max(1);
    let mut items = items.into_iter();
    std::thread::scope(|scope| loop {
        let run: Vec<T> = items.by_ref().take(per_thread).collect();
        if run.is_empty() {
            break;
        }
        let work = &work;
        scope.spawn(move || run.into_iter().for_each(work));
    });
}

/// The e2m1 code nearest to `q`, ties to the even code, saturating at ±6 (the OCP MX
/// conversion, and triton_kernels' `downcast_to_mxfp_torch` that transformers' `Mxfp4Quantize`
/// calls). The sign is kept, so a negative value that rounds to zero is code 8 (-0).
pub(crate) fn e2m1_nearest(q: f32) -> u8 {
    let a = q.abs();
    let mut code = 7;
    for k in 0..7 {
        let mid = (E2M1[k] + E2M1[k + 1]) / 2.0;
        if a < mid || (a == mid && k % 2 == 0) {
            code = k;
            break;
        }
        if a == mid {
            code = k + 1;
            break;
        }
    }
    code as u8 | if q.is_sign_negative() { 8 } else { 0 }
}

/// The code of `q` if it is exactly an e2m1 value.
fn e2m1_exact(q: f32) -> Option<u8> {
    let code = e2m1_nearest(q);
    (E2M1[usize::from(code)] == q).then_some(code)
}

/// A projection quantised to MXFP4: the blocks' and scales' bytes, and how many blocks got a
/// new scale.
pub(crate) struct Packed {
    pub blocks: Vec<u8>,
    pub scales: Vec<u8>,
    pub rescaled: usize,
}

/// The `[n, in, out]` projection `w` (row-major) in MXFP4, given the checkpoint's exponents
/// `stored` (`[n, out, in / 32]`). The values are first rounded to bfloat16, as transformers
/// quantises (`w.to(torch.bfloat16)`). A block whose values are all e2m1 values times its
/// stored scale keeps that scale and is encoded exactly, so a projection imported and not
/// changed is written back to the same bytes. Any other block gets the scale triton_kernels'
/// `downcast_to_mxfp_torch` computes (its default, `ROUND_UP`): `amax / 6` in float32,
/// rounded up to a power of two on its bits, the values multiplied by its reciprocal and
/// rounded to the nearest e2m1 code ([`e2m1_nearest`]). Experts are quantised on parallel
/// threads.
///
/// # Errors
/// The flat index of the first non-finite value: MXFP4 has no code for it.
pub(crate) fn quantize(w: &[f32], shape: [usize; 3], stored: &[u8]) -> Result<Packed, usize> {
    if let Some(at) = w.iter().position(|v| !v.is_finite()) {
        return Err(at);
    }
    let [n, input, out] = shape;
    let groups = input / BLOCK;
    let mut blocks = vec![0u8; n * out * groups * BLOCK_BYTES];
    let mut scales = vec![0u8; n * out * groups];
    let rescaled = std::sync::atomic::AtomicUsize::new(0);
    let experts: Vec<_> = w
        .chunks_exact(input * out)
        .zip(stored.chunks_exact(out * groups))
        .zip(blocks.chunks_exact_mut(out * groups * BLOCK_BYTES))
        .zip(scales.chunks_exact_mut(out * groups))
        .collect();
    on_threads(experts, |(((w, stored), blocks), scales)| {
        let count = quantize_expert(w, stored, blocks, scales, input, out);
        rescaled.fetch_add(count, std::sync::atomic::Ordering::Relaxed);
    });
    Ok(Packed {
        blocks,
        scales,
        rescaled: rescaled.into_inner(),
    })
}

/// One expert's `[in, out]` matrix `w` into its `[out, in / 32, 16]` `blocks` and
/// `[out, in / 32]` `scales`, given its stored exponents. Returns how many blocks got a new
/// exponent. Tiled as [`dequantize_expert`] is, the other way round.
fn quantize_expert(
    w: &[f32],
    stored: &[u8],
    blocks: &mut [u8],
    scales: &mut [u8],
    input: usize,
    out: usize,
) -> usize {
    let groups = input / BLOCK;
    let mut rescaled = 0;
    let mut tile = [[0f32; BLOCK]; TILE];
    for g in 0..groups {
        for o0 in (0..out).step_by(TILE) {
            let width = TILE.min(out - o0);
            for i in 0..BLOCK {
                let run = &w[(g * BLOCK + i) * out + o0..][..width];
                for (t, &v) in run.iter().enumerate() {
                    tile[t][i] = burn::tensor::bf16::from_f32(v).to_f32();
                }
            }
            for (t, block) in tile[..width].iter().enumerate() {
                let row = (o0 + t) * groups + g;
                let (byte, codes) = quantize_block(block, stored[row]);
                rescaled += usize::from(codes.is_none());
                let codes = codes.unwrap_or_else(|| fresh_codes(block, byte));
                scales[row] = byte;
                for (packed, pair) in blocks[row * BLOCK_BYTES..][..BLOCK_BYTES]
                    .iter_mut()
                    .zip(codes.chunks(2))
                {
                    *packed = pair[0] | (pair[1] << 4);
                }
            }
        }
    }
    rescaled
}

/// A block's exponent and, if it keeps the stored exponent `kept` (every value is a code
/// times it), its codes; otherwise the `ROUND_UP` exponent and `None` (see
/// [`fresh_codes`]).
fn quantize_block(block: &[f32; BLOCK], kept: u8) -> (u8, Option<[u8; BLOCK]>) {
    let scale = e8m0_to_f32(kept);
    let mut codes = [0u8; BLOCK];
    if block
        .iter()
        .zip(&mut codes)
        .all(|(&v, code)| e2m1_exact(v / scale).map(|c| *code = c).is_some())
    {
        return (kept, Some(codes));
    }
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let bits = ((amax / 6.0).to_bits() + 0x007F_FFFF) & 0x7F80_0000;
    ((bits >> 23) as u8, None)
}

/// The codes of `block` at the `ROUND_UP` exponent `byte`: the values times the reciprocal of
/// its power of two (0 for exponent 0, as triton_kernels guards a zero scale), rounded.
fn fresh_codes(block: &[f32; BLOCK], byte: u8) -> [u8; BLOCK] {
    let dequant = f32::from_bits(u32::from(byte) << 23);
    let quant = if dequant == 0.0 { 0.0 } else { 1.0 / dequant };
    std::array::from_fn(|i| e2m1_nearest(block[i] * quant))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One expert, `in` = 32, `out` = 2: the codes 0..16 twice in row 0 (low nibble first),
    /// their negatives' codes in row 1, at exponents 127 (×1) and 128 (×2).
    #[test]
    fn codes_unpack_low_nibble_first_and_transpose() {
        let mut blocks = Vec::new();
        for row in 0..2u8 {
            for b in 0..16u8 {
                let lo = (2 * b) % 16;
                let hi = (2 * b + 1) % 16;
                let (lo, hi) = if row == 0 { (lo, hi) } else { (lo ^ 8, hi ^ 8) };
                blocks.push(lo | (hi << 4));
            }
        }
        let values = dequantize(&blocks, &[127, 128], [1, 32, 2]);
        for i in 0..32 {
            assert_eq!(values[i * 2], E2M1[i % 16], "row 0, input {i}");
            assert_eq!(values[i * 2 + 1], 2.0 * E2M1[(i % 16) ^ 8], "row 1, input {i}");
        }
    }

    #[test]
    fn e2m1_rounds_to_nearest_even_and_saturates() {
        let cases = [
            (0.0, 0),
            (0.2, 0),
            (0.25, 0),
            (0.26, 1),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (2.6, 5),
            (3.5, 6),
            (5.0, 6),
            (5.5, 7),
            (7.0, 7),
            (1e30, 7),
            (-0.0, 8),
            (-0.1, 8),
            (-0.75, 10),
            (-100.0, 15),
        ];
        for (q, code) in cases {
            assert_eq!(e2m1_nearest(q), code, "{q}");
        }
        for code in 0..16u8 {
            assert_eq!(e2m1_exact(E2M1[usize::from(code)]), Some(code));
        }
        assert_eq!(e2m1_exact(0.75), None);
    }

    /// Dequantise then quantise gives the bytes back, the subnormal exponent 0 included; a
    /// block scaled up gets triton_kernels' `ROUND_UP` exponent.
    #[test]
    fn unchanged_blocks_keep_their_bytes_and_changed_ones_get_round_up_scales() {
        let (n, input, out) = (2, 64, 3);
        let blocks: Vec<u8> = (0..n * out * 2 * 16).map(|i| (i * 37 + 11) as u8).collect();
        let scales: Vec<u8> = (0..n * out * 2).map(|i| [0, 120, 127, 130][i % 4]).collect();
        let w = dequantize(&blocks, &scales, [n, input, out]);
        let packed = quantize(&w, [n, input, out], &scales).unwrap();
        assert_eq!(
            (packed.blocks, packed.scales.clone(), packed.rescaled),
            (blocks, scales.clone(), 0)
        );

        // Times 3: a block of amax 6 · 2^k becomes 18 · 2^k, whose ROUND_UP scale is
        // 2^(k + 2); 6 · 3 / 4 = 4.5 rounds to 4, and 1.5 · 3 / 4 = 1.125 to 1.
        let tripled: Vec<f32> = w.iter().map(|v| v * 3.0).collect();
        let packed = quantize(&tripled, [n, input, out], &scales).unwrap();
        assert!(packed.rescaled > 0);
        let back = dequantize(&packed.blocks, &packed.scales, [n, input, out]);
        for (i, (&t, &b)) in tripled.iter().zip(&back).enumerate() {
            let scale =
                e8m0_to_f32(packed.scales[(i / out / input * out + i % out) * 2 + (i / out % input) / BLOCK]);
            assert!(
                (t - b).abs() <= scale,
                "value {i}: {t} came back as {b} (scale {scale})"
            );
        }
        assert_eq!(quantize(&[f32::NAN; 32], [1, 32, 1], &[127]).err(), Some(0));
    }

    /// The tiled, threaded decoder against the format's definition, value by value, at a
    /// width that leaves a partial tile and an expert count that does not split evenly.
    #[test]
    fn tiled_dequantize_matches_the_plain_formula() {
        let (n, input, out) = (3, 96, TILE + 6);
        let groups = input / BLOCK;
        let blocks: Vec<u8> = (0..n * out * groups * 16).map(|i| (i * 73 + 5) as u8).collect();
        let scales: Vec<u8> = (0..n * out * groups).map(|i| 115 + (i * 7 % 17) as u8).collect();
        let values = dequantize(&blocks, &scales, [n, input, out]);
        for e in 0..n {
            for i in 0..input {
                for o in 0..out {
                    let row = (e * out + o) * groups + i / BLOCK;
                    let byte = blocks[row * 16 + (i % BLOCK) / 2];
                    let code = if i % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                    let want = E2M1[usize::from(code)] * 2f32.powi(i32::from(scales[row]) - 127);
                    assert_eq!(
                        values[(e * input + i) * out + o],
                        want,
                        "expert {e}, in {i}, out {o}"
                    );
                }
            }
        }
        let packed = quantize(&values, [n, input, out], &scales).unwrap();
        assert_eq!(
            (packed.blocks, packed.scales, packed.rescaled),
            (blocks, scales, 0)
        );
    }

    #[test]
    fn e8m0_covers_its_range() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
        assert_eq!(e8m0_to_f32(1), 2f32.powi(-126));
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-126) / 2.0);
        assert!(e8m0_to_f32(255).is_infinite());
    }

    #[test]
    fn shapes_need_whole_blocks() {
        assert_eq!(
            packed_shapes(&[4, 64, 6]),
            Some((vec![4, 6, 2, 16], vec![4, 6, 2]))
        );
        assert_eq!(packed_shapes(&[4, 48, 6]), None);
        assert_eq!(packed_shapes(&[64, 6]), None);
    }
}
