//! Seeded benchmark inputs whose routing is chosen: balanced, every token to one expert,
//! Zipf-distributed, or a measured distribution, so that every configuration a benchmark
//! compares times the same batch with the same per-expert load.

use burn::module::Param;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use mpipemoe::{seeded_uniform, MoeLayer};

/// The router weight `[n_experts, d_model]` that scores expert `e` by a token's coordinate `e`
/// (a one-hot row per expert), for [`balanced_tokens`].
///
/// # Panics
/// If `d_model < n_experts`.
pub fn balanced_router(n_experts: usize, d_model: usize) -> Vec<f32> {
    assert!(
        d_model >= n_experts,
        "balanced routing needs d_model >= n_experts"
    );
    let mut w = vec![0.0f32; n_experts * d_model];
    for e in 0..n_experts {
        w[e * d_model + e] = 1.0;
    }
    w
}

/// How a benchmark's tokens choose their experts (the first of each token's `top_k`; the
/// others follow it in index order).
#[derive(Debug, Clone, PartialEq)]
pub enum Skew {
    /// Token `g`'s experts are `(g · top_k + j) mod n_experts`: every expert receives the
    /// same rows over a batch whose `tokens · top_k` is a multiple of `n_experts`.
    Balanced,
    /// Every token's first choice is expert 0.
    AllToOne,
    /// First choices drawn from Zipf(s) over the experts: expert `e` with probability
    /// proportional to `1 / (e + 1)^s`.
    Zipf(f64),
    /// First choices drawn from these per-expert weights (e.g. the toy's measured routing).
    Weights(Vec<f64>),
}

impl Skew {
    /// `balanced`, `all-to-one`, `zipf:S` (S in (0, 10]) or `weights:W0,W1,...` (finite, at
    /// least one positive).
    ///
    /// ```
    /// use mpipemoe_tools::inputs::Skew;
    /// assert_eq!(Skew::parse("zipf:1.2").unwrap(), Skew::Zipf(1.2));
    /// assert!(Skew::parse("zipf:-1").is_err());
    /// assert_eq!(Skew::parse("weights:3,1").unwrap(), Skew::Weights(vec![3.0, 1.0]));
    /// ```
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if let Some(s) = text.strip_prefix("zipf:") {
            return match s.parse::<f64>() {
                Ok(s) if s > 0.0 && s <= 10.0 => Ok(Skew::Zipf(s)),
                _ => Err(format!("zipf:{s}: the exponent must be a number in (0, 10]")),
            };
        }
        if let Some(list) = text.strip_prefix("weights:") {
            let weights: Vec<f64> = list
                .split(',')
                .map(|w| w.trim().parse::<f64>())
                .collect::<Result<_, _>>()
                .map_err(|_| format!("weights:{list}: expected comma-separated numbers"))?;
            if weights.len() > 1 << 16
                || weights.iter().any(|w| !w.is_finite() || *w < 0.0)
                || !weights.iter().any(|w| *w > 0.0)
            {
                return Err(format!(
                    "weights:{list}: at most 65536 finite weights >= 0, at least one positive"
                ));
            }
            return Ok(Skew::Weights(weights));
        }
        match text {
            "balanced" => Ok(Skew::Balanced),
            "all-to-one" => Ok(Skew::AllToOne),
            _ => Err(format!(
                "{text:?}: expected balanced, all-to-one, zipf:S or weights:W0,W1,..."
            )),
        }
    }

    /// A short name for tables: `balanced`, `all-to-one`, `zipf(1.2)`, `measured`.
    pub fn name(&self) -> String {
        match self {
            Skew::Balanced => "balanced".into(),
            Skew::AllToOne => "all-to-one".into(),
            Skew::Zipf(s) => format!("zipf({s})"),
            Skew::Weights(_) => "measured".into(),
        }
    }

    /// Each expert's share of the first choices: uniform for `Balanced`.
    pub fn shares(&self, n_experts: usize) -> Vec<f64> {
        self.probabilities(n_experts)
            .unwrap_or_else(|| vec![1.0 / n_experts.max(1) as f64; n_experts])
    }

    /// Each expert's probability of being a token's first choice (`None`: balanced).
    fn probabilities(&self, n_experts: usize) -> Option<Vec<f64>> {
        let weights: Vec<f64> = match self {
            Skew::Balanced => return None,
            Skew::AllToOne => (0..n_experts).map(|e| f64::from(u8::from(e == 0))).collect(),
            Skew::Zipf(s) => (0..n_experts).map(|e| 1.0 / ((e + 1) as f64).powf(*s)).collect(),
            // Experts beyond the list get none; a list longer than the experts is cut.
            Skew::Weights(w) => (0..n_experts).map(|e| w.get(e).copied().unwrap_or(0.0)).collect(),
        };
        let total: f64 = weights.iter().sum();
        // A measured list whose weight is all beyond this layer's experts: balanced.
        (total > 0.0).then(|| weights.iter().map(|w| w / total).collect())
    }
}

/// `tokens` seeded tokens `[tokens, d_model]` of rank `rank` whose `top_k` experts under
/// [`balanced_router`] are `(g · top_k + j) mod n_experts` for the token's global index `g`:
/// over a batch whose `tokens · top_k` is a multiple of `n_experts`, every expert receives the
/// same number of rows, on every rank. The other coordinates are uniform in [-1, 1).
pub fn balanced_tokens(
    seed: u64,
    rank: usize,
    tokens: usize,
    d_model: usize,
    n_experts: usize,
    top_k: usize,
) -> Vec<f32> {
    skewed_tokens(seed, rank, tokens, d_model, n_experts, top_k, &Skew::Balanced)
}

/// [`balanced_tokens`] with the first choices drawn as `skew` says (seeded per rank): token
/// `t`'s experts are its first choice `f` and then `f + 1, ..., f + top_k - 1` mod
/// `n_experts`.
pub fn skewed_tokens(
    seed: u64,
    rank: usize,
    tokens: usize,
    d_model: usize,
    n_experts: usize,
    top_k: usize,
    skew: &Skew,
) -> Vec<f32> {
    let mut x = seeded_uniform(
        seed ^ (rank as u64).wrapping_mul(0x9E37),
        "benchmark tokens",
        tokens * d_model,
        1.0,
    );
    let probabilities = skew.probabilities(n_experts);
    let draws = seeded_uniform(
        seed ^ (rank as u64).wrapping_mul(0x9E37),
        "routing draws",
        tokens,
        0.5,
    );
    for t in 0..tokens {
        let row = &mut x[t * d_model..(t + 1) * d_model];
        row[..n_experts].iter_mut().for_each(|v| *v = 0.0);
        let first = match &probabilities {
            None => ((rank * tokens + t) * top_k) % n_experts,
            Some(p) => {
                // Inverse CDF of a uniform draw in [0, 1).
                let u = f64::from(draws[t]) + 0.5;
                let mut acc = 0.0;
                p.iter()
                    .position(|&pe| {
                        acc += pe;
                        u < acc
                    })
                    .unwrap_or_else(|| p.iter().rposition(|&pe| pe > 0.0).unwrap_or(0))
            }
        };
        for j in 0..top_k {
            row[(first + j) % n_experts] = (4 + top_k - j) as f32;
        }
    }
    x
}

/// Sets `layer`'s router to [`balanced_router`] (and drops its bias), so that
/// [`balanced_tokens`] route evenly.
pub fn balance_router<B: Backend>(layer: &mut MoeLayer<B>) {
    let [e, m] = layer.router.weight.dims();
    let device = layer.router.weight.device();
    let w = Tensor::<B, 2>::from_data(
        TensorData::new(balanced_router(e, m), [e, m]).convert::<B::FloatElem>(),
        &device,
    );
    layer.router.weight = Param::from_tensor(w);
    layer.router.bias = None;
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use mpipemoe::MoeLayerConfig;

    #[test]
    fn every_expert_gets_the_same_rows() {
        for (e, k, t) in [(4, 1, 64), (8, 2, 40), (4, 2, 6)] {
            let mut layer = MoeLayerConfig::new(16, 8, e, k).init::<NdArray>(&Default::default());
            balance_router(&mut layer);
            let x = Tensor::<NdArray, 2>::from_data(
                TensorData::new(balanced_tokens(1, 0, t, 16, e, k), [t, 16]),
                &Default::default(),
            );
            let out = layer.forward(x);
            let load = &out.stats.routing.tokens_per_expert;
            assert!(load.iter().all(|&l| l == t * k / e), "{load:?}");
        }
    }

    /// Each expert's first choices among `tokens` tokens of width 4 (small blocks: the heap
    /// test beside this one counts the process's mapped blocks), read from the coordinates the
    /// router scores.
    fn first_choice_load(skew: &Skew, tokens: usize) -> Vec<usize> {
        let (e, m) = (4, 4);
        let x = skewed_tokens(3, 1, tokens, m, e, 1, skew);
        let mut load = vec![0; e];
        for row in x.chunks_exact(m) {
            let best = (0..e).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
            load[best] += 1;
        }
        load
    }

    #[test]
    fn skewed_routing_follows_the_requested_distribution() {
        assert_eq!(first_choice_load(&Skew::AllToOne, 50), vec![50, 0, 0, 0]);
        assert_eq!(
            first_choice_load(&Skew::Weights(vec![0.0, 0.0, 1.0]), 20),
            vec![0, 0, 20, 0]
        );
        // Zipf(1.2) over 4 experts: 1, 0.435, 0.268, 0.190 over 1.893, so 52.8 %, 23.0 %,
        // 14.2 % and 10.0 % of 4000 tokens, within a few standard deviations.
        let load = first_choice_load(&Skew::Zipf(1.2), 4000);
        let want: [f64; 4] = [0.528, 0.230, 0.142, 0.100];
        for (e, (&got, &p)) in load.iter().zip(&want).enumerate() {
            let sd = (4000.0 * p * (1.0 - p)).sqrt();
            assert!(
                (got as f64 - 4000.0 * p).abs() < 4.0 * sd,
                "expert {e}: {got} of 4000, expected {p}: {load:?}"
            );
        }
    }
}
