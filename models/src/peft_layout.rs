//! How PEFT's factors of the experts' stacked parameters map onto the layer's adapter
//! factors, per family: transformers 5 stores the stacked weights `[E, out, in]` or
//! `[E, in, out]` (GPT-OSS's with gate and up columns interleaved), and PEFT's `lora_A`
//! `[r · n_experts, in]` (expert-major rows) and `lora_B` `[out, r · n_experts]` (rank-major
//! columns) follow that layout. One map of places serves both directions, in and out.

/// How transformers 5 stores a family's stacked expert parameter, and so how PEFT's factors
/// map onto the layer's `w [rows, cols]` (`x · w`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertLayout {
    /// `[E, out, in]` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3): PEFT's delta is `B·A` in
    /// that layout, the layer's `(B·A)ᵀ = Aᵀ·Bᵀ`.
    OutIn,
    /// `[E, in, out]` marked `is_transposed` (GPT-OSS, gate and up columns interleaved):
    /// PEFT's delta is `Aᵀ·Bᵀ` in the layer's own layout.
    InOut { interleaved: bool },
    /// `[E, in, out]` without the mark (Llama 4): PEFT takes the first dimension for the
    /// output and its delta `B·A` is in the layer's layout.
    InOutUnmarked,
}

impl ExpertLayout {
    pub(crate) fn of(model_type: &str) -> Self {
        match model_type {
            "gpt_oss" => ExpertLayout::InOut { interleaved: true },
            "llama4" | "llama4_text" => ExpertLayout::InOutUnmarked,
            _ => ExpertLayout::OutIn,
        }
    }
}

/// Whether a pair `lora_A [da]`, `lora_B [db]` is the adapter on `w_in` (`true`) or `w_out`
/// (`false`) of experts with `d_model` `m`, `d_inner` `f` and `d_hidden` `h`; `None` if it
/// fits neither.
pub(crate) fn expert_role(
    layout: ExpertLayout,
    da: [usize; 2],
    db: [usize; 2],
    r: usize,
    e: usize,
    (m, f, h): (usize, usize, usize),
) -> Option<bool> {
    if da[0] != r * e || db[1] != r * e {
        return None;
    }
    // The layer's `[rows, cols]` the pair stands for.
    let (rows, cols) = match layout {
        ExpertLayout::OutIn | ExpertLayout::InOut { .. } => (da[1], db[0]),
        ExpertLayout::InOutUnmarked => (db[0], da[1]),
    };
    match (rows, cols) {
        (rows, cols) if rows == m && cols == f => Some(true),
        (rows, cols) if rows == h && cols == m => Some(false),
        _ => None,
    }
}

/// Column `c` of a halves layout (`gate..., up...`, `2·half` wide) in the interleaved one.
fn interleaved_column(c: usize, half: usize) -> usize {
    if c < half {
        2 * c
    } else {
        2 * (c - half) + 1
    }
}

/// Where each value of the layer's factors sits in PEFT's tensors: for each index of `a
/// [e, rows, r]`, then of `b [e, r, cols]`, whether it is in `lora_B` (else `lora_A`) and
/// its index there. One map serves both directions ([`expert_factors`], [`peft_factors`]).
struct FactorPlaces {
    a: Vec<(bool, usize)>,
    b: Vec<(bool, usize)>,
}

fn factor_places(
    layout: ExpertLayout,
    r: usize,
    e: usize,
    rows: usize,
    cols: usize,
    w_in: bool,
) -> FactorPlaces {
    let mut a = vec![(false, 0); e * rows * r];
    let mut b = vec![(false, 0); e * r * cols];
    let column = |c: usize| match layout {
        ExpertLayout::InOut { interleaved: true } if w_in => interleaved_column(c, cols / 2),
        _ => c,
    };
    for x in 0..e {
        for k in 0..r {
            match layout {
                // a[x][j][k] = A[x·r + k][j]; b[x][k][i] = B[i][k·E + x].
                ExpertLayout::OutIn | ExpertLayout::InOut { .. } => {
                    for j in 0..rows {
                        a[(x * rows + j) * r + k] = (false, (x * r + k) * rows + j);
                    }
                    for c in 0..cols {
                        b[(x * r + k) * cols + c] = (true, column(c) * r * e + k * e + x);
                    }
                }
                // a[x][i][k] = B[i][k·E + x]; b[x][k][j] = A[x·r + k][j].
                ExpertLayout::InOutUnmarked => {
                    for i in 0..rows {
                        a[(x * rows + i) * r + k] = (true, i * r * e + k * e + x);
                    }
                    for j in 0..cols {
                        b[(x * r + k) * cols + j] = (false, (x * r + k) * cols + j);
                    }
                }
            }
        }
    }
    FactorPlaces { a, b }
}

/// PEFT's `lora_A` and `lora_B` values as the layer's factors `a [e, rows, r]` and
/// `b [e, r, cols]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn expert_factors(
    layout: ExpertLayout,
    lora_a: &[f32],
    lora_b: &[f32],
    r: usize,
    e: usize,
    rows: usize,
    cols: usize,
    w_in: bool,
) -> (Vec<f32>, Vec<f32>) {
    let places = factor_places(layout, r, e, rows, cols, w_in);
    let read = |&(in_b, i): &(bool, usize)| if in_b { lora_b[i] } else { lora_a[i] };
    (
        places.a.iter().map(read).collect(),
        places.b.iter().map(read).collect(),
    )
}

/// The inverse of [`expert_factors`]: PEFT's `lora_A` and `lora_B` values and shapes.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(crate) fn peft_factors(
    layout: ExpertLayout,
    a: &[f32],
    b: &[f32],
    r: usize,
    e: usize,
    rows: usize,
    cols: usize,
    w_in: bool,
) -> (Vec<f32>, Vec<f32>, [usize; 2], [usize; 2]) {
    // PEFT's `lora_A` holds the layer's `a` values in the first layouts, its `b` in the last.
    let (len_a, len_b) = match layout {
        ExpertLayout::InOutUnmarked => (b.len(), a.len()),
        _ => (a.len(), b.len()),
    };
    let mut lora_a = vec![0.0; len_a];
    let mut lora_b = vec![0.0; len_b];
    let places = factor_places(layout, r, e, rows, cols, w_in);
    for (&(in_b, i), &v) in places.a.iter().zip(a).chain(places.b.iter().zip(b)) {
        if in_b {
            lora_b[i] = v;
        } else {
            lora_a[i] = v;
        }
    }
    match layout {
        ExpertLayout::OutIn | ExpertLayout::InOut { .. } => (lora_a, lora_b, [r * e, rows], [cols, r * e]),
        ExpertLayout::InOutUnmarked => (lora_a, lora_b, [r * e, cols], [rows, r * e]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every layout's factors survive the way out and back, value for value.
    #[test]
    fn expert_factors_round_trip_in_every_layout() {
        let (r, e, rows, cols) = (2, 3, 4, 6);
        let a: Vec<f32> = (0..e * rows * r).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..e * r * cols).map(|i| 1000.0 + i as f32).collect();
        for layout in [
            ExpertLayout::OutIn,
            ExpertLayout::InOut { interleaved: true },
            ExpertLayout::InOutUnmarked,
        ] {
            for w_in in [true, false] {
                let (pa, pb, _, _) = peft_factors(layout, &a, &b, r, e, rows, cols, w_in);
                let (back_a, back_b) = expert_factors(layout, &pa, &pb, r, e, rows, cols, w_in);
                assert_eq!((back_a, back_b), (a.clone(), b.clone()), "{layout:?} {w_in}");
            }
        }
    }
}
