//! Between the Hugging Face layouts (one `[out, in]` matrix per projection and expert, or
//! Llama 4's stacked `[E, M, 2H]` / `[E, H, M]` applied as `x · W`) and the canonical one
//! (stacked `[E, M, 2H]` / `[E, H, M]` expert tensors, `[M, 2Hs]` shared).

use std::collections::HashMap;
use std::ops::Range;

use burn::tensor::TensorData;

use super::family::Part;
use super::names::LayerNames;
use crate::error::{MoeError, Result};
use crate::layer::{MoeLayerConfig, TensorMap};

/// One Hugging Face tensor of a layer to read: its name, its stored shape (`[out, in]` for a
/// matrix), and which entries of its first dimension to read (all of them but for stacked
/// experts, whose first dimension is the expert).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HfEntry {
    pub name: String,
    pub shape: Vec<usize>,
    pub rows: Range<usize>,
}

impl HfEntry {
    /// The whole tensor.
    pub(crate) fn whole(name: String, shape: Vec<usize>) -> Self {
        let rows = 0..shape.first().copied().unwrap_or(1);
        Self { name, shape, rows }
    }
}

/// The Hugging Face tensors that make up the canonical tensors of `config` for the experts in
/// `experts` (global indices), with the shapes `config.json` implies.
pub(crate) fn hf_entries(config: &MoeLayerConfig, names: &LayerNames, experts: Range<usize>) -> Vec<HfEntry> {
    let (e_all, m, h) = (config.n_experts, config.d_model, config.d_hidden);
    let mut out = vec![HfEntry::whole(names.router(), vec![e_all, m])];
    if config.router_bias {
        out.push(HfEntry::whole(names.router_bias(), vec![e_all]));
    }
    if config.score_bias {
        out.push(HfEntry::whole(names.score_bias(), vec![e_all]));
    }
    if names.stacked() {
        // One tensor per projection; this rank reads its experts' rows of each.
        let mut stacked = vec![
            (names.stacked_gate_up(), vec![e_all, m, 2 * h]),
            (names.stacked_down(), vec![e_all, h, m]),
        ];
        if config.bias {
            let (b_in, b_out) = names.stacked_biases();
            stacked.extend([(b_in, vec![e_all, 2 * h]), (b_out, vec![e_all, m])]);
        }
        for (name, shape) in stacked {
            out.push(HfEntry {
                name,
                shape,
                rows: experts.clone(),
            });
        }
    } else {
        for e in experts {
            out.push(HfEntry::whole(names.expert(e, Part::Gate), vec![h, m]));
            out.push(HfEntry::whole(names.expert(e, Part::Up), vec![h, m]));
            out.push(HfEntry::whole(names.expert(e, Part::Down), vec![m, h]));
        }
    }
    if let Some(hs) = config.shared_expert {
        out.push(HfEntry::whole(names.shared(Part::Gate), vec![hs, m]));
        out.push(HfEntry::whole(names.shared(Part::Up), vec![hs, m]));
        out.push(HfEntry::whole(names.shared(Part::Down), vec![m, hs]));
        if config.shared_expert_gate {
            out.push(HfEntry::whole(names.shared_gate(), vec![1, m]));
        }
    }
    out
}

/// Where column `c` of a `2h`-wide interleaved row (`gate, up, gate, up, ...`, GPT-OSS) stands
/// in the canonical layout (`gate ... | up ...`).
fn halves_column(c: usize, h: usize) -> usize {
    match c % 2 {
        0 => c / 2,
        _ => h + c / 2,
    }
}

/// Each `2h`-wide row of `values` from the interleaved layout to halves.
fn interleaved_to_halves(values: &[f32], h: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for (src, dst) in values.chunks_exact(2 * h).zip(out.chunks_exact_mut(2 * h)) {
        src.iter()
            .enumerate()
            .for_each(|(c, &v)| dst[halves_column(c, h)] = v);
    }
    out
}

/// The inverse of [`interleaved_to_halves`].
fn halves_to_interleaved(values: &[f32], h: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for (src, dst) in values.chunks_exact(2 * h).zip(out.chunks_exact_mut(2 * h)) {
        dst.iter_mut()
            .enumerate()
            .for_each(|(c, v)| *v = src[halves_column(c, h)]);
    }
    out
}

/// `[rows, cols]` → `[cols, rows]`.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// The canonical `[M, 2H]` first matrix of a SwiGLU FFN from its `[H, M]` gate and up
/// projections: `[gate^T | up^T]`.
fn join_gate_up(gate: &[f32], up: &[f32], h: usize, m: usize) -> Vec<f32> {
    let (gate, up) = (transpose(gate, h, m), transpose(up, h, m));
    let mut out = Vec::with_capacity(2 * h * m);
    for r in 0..m {
        out.extend_from_slice(&gate[r * h..(r + 1) * h]);
        out.extend_from_slice(&up[r * h..(r + 1) * h]);
    }
    out
}

/// The inverse of [`join_gate_up`]: the `[H, M]` gate and up projections of a `[M, 2H]` matrix.
fn split_gate_up(w_in: &[f32], h: usize, m: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut gate_t, mut up_t) = (Vec::with_capacity(h * m), Vec::with_capacity(h * m));
    for r in 0..m {
        gate_t.extend_from_slice(&w_in[r * 2 * h..r * 2 * h + h]);
        up_t.extend_from_slice(&w_in[r * 2 * h + h..(r + 1) * 2 * h]);
    }
    (transpose(&gate_t, m, h), transpose(&up_t, m, h))
}

/// The canonical tensors (f32) of `config` from Hugging Face tensors read by
/// [`hf_entries`] for the experts in `experts`; the expert tensors hold those experts only.
pub(crate) fn to_canonical(
    config: &MoeLayerConfig,
    names: &LayerNames,
    experts: Range<usize>,
    hf: &HashMap<String, Vec<f32>>,
) -> TensorMap {
    let (m, h) = (config.d_model, config.d_hidden);
    let get = |name: String| hf[&name].as_slice();
    let data = |values: Vec<f32>, shape: Vec<usize>| TensorData::new(values, shape);
    let mut out = TensorMap::new();
    out.insert(
        "router.weight".into(),
        data(get(names.router()).to_vec(), vec![config.n_experts, m]),
    );
    if config.router_bias {
        out.insert(
            "router.bias".into(),
            data(get(names.router_bias()).to_vec(), vec![config.n_experts]),
        );
    }
    if config.score_bias {
        out.insert(
            "router.score_bias".into(),
            data(get(names.score_bias()).to_vec(), vec![config.n_experts]),
        );
    }
    let n = experts.len();
    let (mut w_in, mut w_out) = (Vec::with_capacity(n * m * 2 * h), Vec::with_capacity(n * h * m));
    if names.stacked() {
        // Stored as the canonical layout is (`x · W`, the gate half first), already only
        // the rows of `experts`.
        let gate_up = get(names.stacked_gate_up());
        match names.interleaved() {
            true => w_in.extend(interleaved_to_halves(gate_up, h)),
            false => w_in.extend_from_slice(gate_up),
        }
        w_out.extend_from_slice(get(names.stacked_down()));
        if config.bias {
            let (b_in, b_out) = names.stacked_biases();
            let b_in = match names.interleaved() {
                true => interleaved_to_halves(get(b_in), h),
                false => get(b_in).to_vec(),
            };
            out.insert("experts.b_in".into(), data(b_in, vec![n, 2 * h]));
            out.insert("experts.b_out".into(), data(get(b_out).to_vec(), vec![n, m]));
        }
    } else {
        for e in experts {
            w_in.extend(join_gate_up(
                get(names.expert(e, Part::Gate)),
                get(names.expert(e, Part::Up)),
                h,
                m,
            ));
            w_out.extend(transpose(get(names.expert(e, Part::Down)), m, h));
        }
    }
    out.insert("experts.w_in".into(), data(w_in, vec![n, m, 2 * h]));
    out.insert("experts.w_out".into(), data(w_out, vec![n, h, m]));
    if let Some(hs) = config.shared_expert {
        out.insert(
            "shared.w_in".into(),
            data(
                join_gate_up(get(names.shared(Part::Gate)), get(names.shared(Part::Up)), hs, m),
                vec![m, 2 * hs],
            ),
        );
        out.insert(
            "shared.w_out".into(),
            data(transpose(get(names.shared(Part::Down)), m, hs), vec![hs, m]),
        );
        if config.shared_expert_gate {
            out.insert(
                "shared.gate.weight".into(),
                data(get(names.shared_gate()).to_vec(), vec![1, m]),
            );
        }
    }
    out
}

/// The Hugging Face tensors (f32, `[out, in]`) of a whole layer from its canonical tensors
/// (all experts).
///
/// # Errors
/// [`MoeError::Input`] naming the canonical tensor that is missing or has the wrong shape.
pub(crate) fn to_hf(
    config: &MoeLayerConfig,
    names: &LayerNames,
    tensors: &TensorMap,
) -> Result<HashMap<String, Vec<f32>>> {
    let (e_all, m, h) = (config.n_experts, config.d_model, config.d_hidden);
    let get = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
        let data = tensors
            .get(name)
            .ok_or_else(|| MoeError::Input(format!("the layer has no tensor `{name}`")))?;
        if data.shape.to_vec() != shape {
            return Err(MoeError::Input(format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                data.shape.to_vec()
            )));
        }
        data.clone()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| MoeError::Input(format!("tensor `{name}`: {e:?}")))
    };
    let mut out = HashMap::new();
    out.insert(names.router(), get("router.weight", &[e_all, m])?);
    if config.router_bias {
        out.insert(names.router_bias(), get("router.bias", &[e_all])?);
    }
    if config.score_bias {
        out.insert(names.score_bias(), get("router.score_bias", &[e_all])?);
    }
    let w_in = get("experts.w_in", &[e_all, m, 2 * h])?;
    let w_out = get("experts.w_out", &[e_all, h, m])?;
    if names.stacked() {
        let interleave = |v: Vec<f32>| match names.interleaved() {
            true => halves_to_interleaved(&v, h),
            false => v,
        };
        out.insert(names.stacked_gate_up(), interleave(w_in));
        out.insert(names.stacked_down(), w_out);
        if config.bias {
            let (b_in, b_out) = names.stacked_biases();
            out.insert(b_in, interleave(get("experts.b_in", &[e_all, 2 * h])?));
            out.insert(b_out, get("experts.b_out", &[e_all, m])?);
        }
    } else {
        for e in 0..e_all {
            let (gate, up) = split_gate_up(&w_in[e * m * 2 * h..(e + 1) * m * 2 * h], h, m);
            out.insert(names.expert(e, Part::Gate), gate);
            out.insert(names.expert(e, Part::Up), up);
            out.insert(
                names.expert(e, Part::Down),
                transpose(&w_out[e * h * m..(e + 1) * h * m], h, m),
            );
        }
    }
    if let Some(hs) = config.shared_expert {
        let (gate, up) = split_gate_up(&get("shared.w_in", &[m, 2 * hs])?, hs, m);
        out.insert(names.shared(Part::Gate), gate);
        out.insert(names.shared(Part::Up), up);
        out.insert(
            names.shared(Part::Down),
            transpose(&get("shared.w_out", &[hs, m])?, hs, m),
        );
        if config.shared_expert_gate {
            out.insert(names.shared_gate(), get("shared.gate.weight", &[1, m])?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_columns_become_halves_and_back() {
        // Two rows of h = 3: (g0, u0, g1, u1, g2, u2).
        let interleaved = [1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 4.0, -4.0, 5.0, -5.0, 6.0, -6.0];
        let halves = interleaved_to_halves(&interleaved, 3);
        assert_eq!(
            halves,
            vec![1.0, 2.0, 3.0, -1.0, -2.0, -3.0, 4.0, 5.0, 6.0, -4.0, -5.0, -6.0]
        );
        assert_eq!(halves_to_interleaved(&halves, 3), interleaved.to_vec());
    }

    #[test]
    fn gate_up_join_and_split_are_inverse_and_transpose() {
        // h = 2, m = 3: gate [2, 3], up [2, 3].
        let gate = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let up = [7.0, 8.0, 9.0, 10.0, 11.0, 12.0];
        let joined = join_gate_up(&gate, &up, 2, 3);
        // Row r of [M, 2H] is (gate[:, r], up[:, r]).
        assert_eq!(
            joined,
            vec![1.0, 4.0, 7.0, 10.0, 2.0, 5.0, 8.0, 11.0, 3.0, 6.0, 9.0, 12.0]
        );
        assert_eq!(split_gate_up(&joined, 2, 3), (gate.to_vec(), up.to_vec()));
    }
}
