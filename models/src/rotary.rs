//! Rotary position embeddings, unscaled or with the scaling rules published models use,
//! computed as transformers computes them.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};
use mpipemoe::decoder::{rotate_half_rows, DecoderKernels, TailRotation};

/// How the rotary frequencies are scaled for contexts beyond the pretraining length
/// (`rope_parameters.rope_type` in a transformers 5 config, `rope_scaling` in 4.x).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Unscaled (`"default"`).
    None,
    /// Positions divided by `factor` (`"linear"`): every frequency divided by it.
    Linear {
        /// The context's stretch.
        factor: f64,
    },
    /// Llama 3's rule (`"llama3"`): low frequencies divided by `factor`, high ones kept, the
    /// band between interpolated.
    Llama3 {
        /// The context's stretch.
        factor: f64,
        /// Wavelengths over `original_max_position_embeddings / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths under `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The pretraining context length.
        original_max_position_embeddings: f64,
    },
    /// YaRN (`"yarn"`): frequencies blended between interpolated and kept by a linear ramp
    /// over the dimensions, and cos / sin multiplied by an attention factor.
    Yarn {
        /// The context's stretch.
        factor: f64,
        /// cos and sin are multiplied by this (given, or `0.1 · ln(factor) + 1`, or DeepSeek's
        /// ratio of the `mscale` and `mscale_all_dim` forms).
        attention_factor: f64,
        /// The ramp's fast boundary in rotations (default 32).
        beta_fast: f64,
        /// The ramp's slow boundary in rotations (default 1).
        beta_slow: f64,
        /// The pretraining context length.
        original_max_position_embeddings: f64,
        /// Round the ramp's bounds outwards to whole dimensions (default true).
        truncate: bool,
    },
}

/// Rotary embeddings of `head_dim` with base `theta`, applied in transformers' "rotate half"
/// layout: the first half of a head pairs with the second half.
///
/// The frequencies and angles are computed in f32 as transformers computes them in every
/// dtype (`inv_freq = 1 / theta^(2i / d)` in f32, the scaling rule in f32, `angle = inv_freq ·
/// position` in f32, then cos and sin times the attention factor), so that the tables are
/// the same numbers.
#[derive(Debug, Clone)]
pub struct Rotary {
    inv_freq: Vec<f32>,
    attention_factor: f32,
}

impl Rotary {
    /// For heads of `head_dim` (even) and base `theta`, unscaled.
    pub fn new(head_dim: usize, theta: f64) -> Self {
        Self::scaled(head_dim, theta, RopeScaling::None)
    }

    /// For heads of `head_dim` (even) and base `theta`, scaled by `scaling`.
    pub fn scaled(head_dim: usize, theta: f64, scaling: RopeScaling) -> Self {
        let half = head_dim / 2;
        // transformers: `base ** (arange(0, dim, 2).float() / dim)` in f32.
        let pos_freqs: Vec<f32> = (0..half)
            .map(|i| (theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let plain: Vec<f32> = pos_freqs.iter().map(|p| 1.0 / p).collect();
        let (inv_freq, attention_factor) = match scaling {
            RopeScaling::None => (plain, 1.0),
            RopeScaling::Linear { factor } => (plain.iter().map(|f| f / factor as f32).collect(), 1.0),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => (
                llama3(&plain, factor, low_freq_factor, high_freq_factor, old),
                1.0,
            ),
            RopeScaling::Yarn {
                factor,
                attention_factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                truncate,
            } => {
                let dim = head_dim as f64;
                let correction_dim = |rotations: f64| {
                    dim * (original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                let freqs = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        let interpolated = 1.0 / (factor as f32 * p);
                        interpolated * (1.0 - extrapolation) + (1.0 / p) * extrapolation
                    })
                    .collect();
                (freqs, attention_factor as f32)
            }
        };
        Self {
            inv_freq,
            attention_factor,
        }
    }

    /// `cos` and `sin` for the positions of each row, each `[rows, n_positions, head_dim]` (the
    /// half-width table repeated twice, as `cat(freqs, freqs)`). Every row holds as many
    /// positions; one row serves every row of a batch.
    ///
    /// # Panics
    /// If the rows differ in length (a contract of the callers, which build them from one
    /// [`Places`](crate::Places)).
    pub fn tables<B: Backend>(
        &self,
        rows: &[Vec<usize>],
        device: &B::Device,
    ) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let half = self.inv_freq.len();
        let t = rows.first().map_or(0, Vec::len);
        assert!(
            rows.iter().all(|r| r.len() == t),
            "rotary rows of different lengths"
        );
        let mut cos = Vec::with_capacity(rows.len() * t * 2 * half);
        let mut sin = Vec::with_capacity(rows.len() * t * 2 * half);
        for &p in rows.iter().flatten() {
            for _ in 0..2 {
                for &f in &self.inv_freq {
                    let angle = f * p as f32;
                    cos.push(angle.cos() * self.attention_factor);
                    sin.push(angle.sin() * self.attention_factor);
                }
            }
        }
        let shape = [rows.len(), t, 2 * half];
        (
            Tensor::from_data(TensorData::new(cos, shape), device),
            Tensor::from_data(TensorData::new(sin, shape), device),
        )
    }

    /// Rotates `x` by the tables of its positions in interleaved pairs, each pair rotated in
    /// place (Llama 4's complex form: `(x0 + i·x1) · e^{iθ}`, written back as `(re, im)`).
    ///
    /// # Shapes
    /// - x: `[batch, heads, seq, head_dim]`
    /// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch` (`cat(freqs, freqs)`: the
    ///   first half is used)
    pub fn apply_pairs<B: DecoderKernels>(
        x: Tensor<B, 4>,
        cos: &Tensor<B, 3>,
        sin: &Tensor<B, 3>,
    ) -> Tensor<B, 4> {
        // The same rotation per value on the heads-major view: one composition, the backend's.
        Self::apply_pairs_seq_major(x.swap_dims(1, 2), cos, sin).swap_dims(1, 2)
    }

    /// [`apply_pairs`](Self::apply_pairs) on the sequence-major layout, before the heads are
    /// moved forward: element-wise ops on a contiguous tensor rather than on a strided view
    /// of one (Flex walks a strided view element by element).
    ///
    /// # Shapes
    /// - x: `[batch, seq, heads, head_dim]`
    /// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch`
    pub fn apply_pairs_seq_major<B: DecoderKernels>(
        x: Tensor<B, 4>,
        cos: &Tensor<B, 3>,
        sin: &Tensor<B, 3>,
    ) -> Tensor<B, 4> {
        // The backend's op: burn's ops by default (`mpipemoe`'s `decoder/rotary.rs`), one
        // kernel each way on the CubeCL backends (`DecoderKernels::rotate_pairs_seq_major`).
        let rotated = B::rotate_pairs_seq_major(
            x.into_primitive().tensor(),
            cos.clone().into_primitive().tensor(),
            sin.clone().into_primitive().tensor(),
        );
        Tensor::from_primitive(TensorPrimitive::Float(rotated))
    }

    /// Rotates `x` by the tables of its positions.
    ///
    /// # Shapes
    /// - x: `[batch, heads, seq, head_dim]`
    /// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch`
    pub fn apply<B: Backend>(x: Tensor<B, 4>, cos: &Tensor<B, 3>, sin: &Tensor<B, 3>) -> Tensor<B, 4> {
        let [b, h, t, d] = x.dims();
        // Each (batch, head) row of `t · d` values takes its batch row's tables as they are
        // (one table for all where the rows share their positions).
        let table = |m: &Tensor<B, 3>| match m.dims()[0] {
            1 => m.clone().reshape([1, t * d]),
            rows => m
                .clone()
                .reshape([rows, 1, t * d])
                .repeat_dim(1, h)
                .reshape([rows * h, t * d]),
        };
        rotate_half_rows(x, [b * h, t * d], table(cos), table(sin))
    }

    /// Rotates `x` as [`apply_seq_major`](Self::apply_seq_major) (or, `pairs`, as
    /// [`apply_pairs_seq_major`](Self::apply_pairs_seq_major)) and returns it head-major:
    /// the backend's [`DecoderKernels::rotate_seq_major_to_heads`], one kernel each way on the
    /// CubeCL backends, where the rotation and the swap that followed it were a kernel and a
    /// copy each way.
    ///
    /// # Shapes
    /// - x: `[batch, seq, heads, head_dim]`
    /// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch`
    /// - output: `[batch, heads, seq, head_dim]`
    pub fn apply_seq_major_to_heads<B: DecoderKernels>(
        x: Tensor<B, 4>,
        cos: &Tensor<B, 3>,
        sin: &Tensor<B, 3>,
        pairs: bool,
    ) -> Tensor<B, 4> {
        let rotated = B::rotate_seq_major_to_heads(
            x.into_primitive().tensor(),
            cos.clone().into_primitive().tensor(),
            sin.clone().into_primitive().tensor(),
            pairs,
        );
        Tensor::from_primitive(TensorPrimitive::Float(rotated))
    }

    /// Latent attention's rotations (DeepSeek): each head's first `form.skip` values left out,
    /// the next `form.pass` as they are and the rest rotated, in the `rotate_half` form or
    /// DeepSeek's interleaved pairs written as `[first values | second values]`, returned
    /// head-major: the backend's [`DecoderKernels::rotate_tail_to_heads`], one kernel each way
    /// on the CubeCL backends, where the slices, the rotation, the concatenation and the swap
    /// were five launches forward and about ten backward.
    ///
    /// # Shapes
    /// - x: `[batch, seq, heads, skip + pass + rotated]`
    /// - cos, sin: `[rows, seq, rotated]`, `rows` 1 or `batch`
    /// - output: `[batch, heads, seq, pass + rotated]`
    pub fn apply_tail_to_heads<B: DecoderKernels>(
        x: Tensor<B, 4>,
        cos: &Tensor<B, 3>,
        sin: &Tensor<B, 3>,
        form: TailRotation,
    ) -> Tensor<B, 4> {
        let rotated = B::rotate_tail_to_heads(
            x.into_primitive().tensor(),
            cos.clone().into_primitive().tensor(),
            sin.clone().into_primitive().tensor(),
            form,
        );
        Tensor::from_primitive(TensorPrimitive::Float(rotated))
    }

    /// [`apply`](Self::apply) on the sequence-major layout, before the heads are moved
    /// forward: element-wise ops on a contiguous tensor rather than on a strided view of one
    /// (Flex walks a strided view element by element).
    ///
    /// # Shapes
    /// - x: `[batch, seq, heads, head_dim]`
    /// - cos, sin: `[rows, seq, head_dim]`, `rows` 1 or `batch`
    pub fn apply_seq_major<B: DecoderKernels>(
        x: Tensor<B, 4>,
        cos: &Tensor<B, 3>,
        sin: &Tensor<B, 3>,
    ) -> Tensor<B, 4> {
        // The backend's kernel: burn's ops (the tables repeated over the heads), one pass on
        // Flex (`DecoderKernels::rotate_half_seq_major`).
        let rotated = B::rotate_half_seq_major(
            x.into_primitive().tensor(),
            cos.clone().into_primitive().tensor(),
            sin.clone().into_primitive().tensor(),
        );
        Tensor::from_primitive(TensorPrimitive::Float(rotated))
    }
}

/// Llama 3's frequencies (transformers' `_compute_llama3_parameters`, in f32): wavelengths
/// over `old / low_freq_factor` divided by `factor`, under `old / high_freq_factor` kept, and
/// those between interpolated by how many times they fit in `old`.
fn llama3(plain: &[f32], factor: f64, low_freq_factor: f64, high_freq_factor: f64, old: f64) -> Vec<f32> {
    let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
    let factor = factor as f32;
    plain
        .iter()
        .map(|&f| {
            let wavelen = (2.0 * std::f64::consts::PI) as f32 / f;
            let long = wavelen as f64 > low_wavelen;
            let short = (wavelen as f64) < high_wavelen;
            let scaled = if long { f / factor } else { f };
            match !long && !short {
                true => {
                    let smooth = (old as f32 / wavelen - low_freq_factor as f32)
                        / (high_freq_factor - low_freq_factor) as f32;
                    (1.0 - smooth) * scaled / factor + smooth * scaled
                }
                false => scaled,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frequencies of published shapes (head_dim 128), printed by transformers 5.24's
    /// `ROPE_INIT_FUNCTIONS` (Qwen3 with YaRN ×4 over 32,768; Llama 3.1's rule), at
    /// dimensions across the ramp.
    #[test]
    fn frequencies_of_published_shapes_equal_transformers() {
        let cases: [(f64, RopeScaling, [f64; 7]); 2] = [
            (
                1e6,
                RopeScaling::Yarn {
                    factor: 4.0,
                    attention_factor: 0.1 * 4f64.ln() + 1.0,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                    original_max_position_embeddings: 32768.0,
                    truncate: true,
                },
                [
                    1.0,
                    0.031622779,
                    0.0053753215,
                    0.00060294115,
                    4.4456985e-05,
                    7.9056936e-06,
                    3.1023444e-07,
                ],
            ),
            (
                5e5,
                RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192.0,
                },
                [
                    1.0,
                    0.03760603,
                    0.0072926651,
                    0.00052484602,
                    3.4281024e-05,
                    6.6478697e-06,
                    3.0689259e-07,
                ],
            ),
        ];
        for (theta, scaling, expected) in cases {
            let rotary = Rotary::scaled(128, theta, scaling);
            for (&i, want) in [0, 16, 24, 32, 40, 48, 63].iter().zip(expected) {
                let got = f64::from(rotary.inv_freq[i]);
                assert!(
                    (got - want).abs() <= 2e-6 * want,
                    "{scaling:?}: dimension {i}: {got} against {want}"
                );
            }
        }
    }

    /// The product form of `rotate_half` and the tables (shared by every batch row, or one
    /// per row as a left-padded batch has them), on both layouts and in pairs, against
    /// transformers' formulas written with slices (`x · cos + cat(−x₂, x₁) · sin`; each pair
    /// `(x0, x1)` rotated by its frequency), on the backend whose fast paths they were written
    /// for.
    #[test]
    fn both_layouts_equal_the_sliced_formula() {
        use burn::backend::Flex;
        let device = Default::default();
        let (b, h, t, d) = (2, 3, 5, 8);
        let values = |n: usize, seed: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i + seed) * 7919) % 1013) as f32 / 101.0 - 5.0)
                .collect()
        };
        let x =
            Tensor::<Flex, 4>::from_data(TensorData::new(values(b * h * t * d, 1), [b, h, t, d]), &device);
        for rows in [1, b] {
            let table = |seed| {
                Tensor::<Flex, 3>::from_data(
                    TensorData::new(values(rows * t * d, seed), [rows, t, d]),
                    &device,
                )
            };
            let (cos, sin) = (table(2), table(3));
            // [rows, 1, seq, d]: broadcast over the heads.
            let (c4, s4) = (
                cos.clone().unsqueeze_dim::<4>(1),
                sin.clone().unsqueeze_dim::<4>(1),
            );
            let half = d / 2;
            let rotated = Tensor::cat(
                vec![
                    x.clone().slice([0..b, 0..h, 0..t, half..d]).neg(),
                    x.clone().slice([0..b, 0..h, 0..t, 0..half]),
                ],
                3,
            );
            let want = x.clone() * c4.clone() + rotated * s4.clone();
            let want: Vec<f32> = want.into_data().to_vec().unwrap();
            let heads_major: Vec<f32> = Rotary::apply(x.clone(), &cos, &sin).into_data().to_vec().unwrap();
            let seq_major = Rotary::apply_seq_major(x.clone().swap_dims(1, 2), &cos, &sin).swap_dims(1, 2);
            let seq_major: Vec<f32> = seq_major.into_data().to_vec().unwrap();
            assert_eq!(
                heads_major, want,
                "[batch, heads, seq, head_dim], {rows} table rows"
            );
            assert_eq!(
                seq_major, want,
                "[batch, seq, heads, head_dim], {rows} table rows"
            );

            // Pairs: (x[2i], x[2i+1]) rotated by frequency i (the tables' first half).
            let pairs = x.clone().reshape([b, h, t, half, 2]);
            let re = pairs
                .clone()
                .slice([0..b, 0..h, 0..t, 0..half, 0..1])
                .reshape([b, h, t, half]);
            let im = pairs
                .slice([0..b, 0..h, 0..t, 0..half, 1..2])
                .reshape([b, h, t, half]);
            let (ch, sh) = (
                c4.slice([0..rows, 0..1, 0..t, 0..half]),
                s4.slice([0..rows, 0..1, 0..t, 0..half]),
            );
            let out_re = re.clone() * ch.clone() - im.clone() * sh.clone();
            let out_im = re * sh + im * ch;
            let want = Tensor::stack::<5>(vec![out_re, out_im], 4).reshape([b, h, t, d]);
            let want: Vec<f32> = want.into_data().to_vec().unwrap();
            let heads_major: Vec<f32> = Rotary::apply_pairs(x.clone(), &cos, &sin)
                .into_data()
                .to_vec()
                .unwrap();
            let seq_major =
                Rotary::apply_pairs_seq_major(x.clone().swap_dims(1, 2), &cos, &sin).swap_dims(1, 2);
            let seq_major: Vec<f32> = seq_major.into_data().to_vec().unwrap();
            assert_eq!(
                heads_major, want,
                "pairs, [batch, heads, seq, head_dim], {rows} table rows"
            );
            assert_eq!(
                seq_major, want,
                "pairs, [batch, seq, heads, head_dim], {rows} table rows"
            );
        }
    }
}
