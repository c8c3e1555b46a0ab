//! Sampling the next token as transformers' `generate(do_sample=True)` does: the last
//! position's logits through its temperature, top-k and top-p warpers, in that order
//! (`GenerationMixin._get_logits_processor`), then one draw from the softmax of what is left.
//!
//! The filtered distribution is transformers' own (held to its processors on stored logits by
//! the tests); the draw comes from the workspace's generator ([`SplitMix64`]), seeded by the caller,
//! so the same seed gives the same ids here, though not the ids `torch.multinomial` draws.

use mpipemoe::rng::SplitMix64;
use mpipemoe::{MoeError, Result};

/// How to pick the next token: greedy (`None` on [`GenerateOptions`](crate::GenerateOptions))
/// or sampled with these settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Logits are divided by it before anything else (transformers'
    /// `TemperatureLogitsWarper`); 1 leaves them.
    pub temperature: f64,
    /// Keep the `k` largest logits and every logit equal to the k-th (`TopKLogitsWarper`);
    /// `None` keeps all.
    pub top_k: Option<usize>,
    /// Keep the smallest set of the largest probabilities whose sum exceeds `p`
    /// (`TopPLogitsWarper`: ascending order, the entries whose cumulative probability is at
    /// most `1 - p` removed, the largest always kept); `None` (or 1) keeps all.
    pub top_p: Option<f64>,
    /// Seeds the draws: the same seed, prompt and model give the same ids.
    pub seed: u64,
}

impl Sampling {
    /// Checks the settings as transformers' `GenerationConfig.validate` and the warpers do.
    ///
    /// # Errors
    /// [`MoeError::Config`] naming `temperature` (not a finite number > 0), `top_k` (0) or
    /// `top_p` (outside `(0, 1]`).
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Err(MoeError::config(
                "temperature",
                format!(
                    "is {}: a finite number > 0 (greedy decoding is no sampling, not temperature 0)",
                    self.temperature
                ),
            ));
        }
        if self.top_k == Some(0) {
            return Err(MoeError::config(
                "top_k",
                "is 0: at least 1 (or none to keep every token)",
            ));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(MoeError::config("top_p", format!("is {p}: a number in (0, 1]")));
            }
        }
        Ok(())
    }

    /// `logits` through the warpers this setting turns on, in transformers' order: the
    /// removed entries are `-inf`. transformers skips a temperature of exactly 1 and a
    /// `top_p` of 1, and so does this.
    pub fn filter(&self, logits: &mut [f32]) {
        if self.temperature != 1.0 {
            // transformers divides the f32 tensor by a Python float: the divisor is f32.
            let t = self.temperature as f32;
            logits.iter_mut().for_each(|v| *v /= t);
        }
        if let Some(k) = self.top_k {
            top_k(logits, k);
        }
        if let Some(p) = self.top_p.filter(|&p| p < 1.0) {
            top_p(logits, p);
        }
    }

    /// One draw from the softmax of `logits` after [`filter`](Self::filter), with `rng`.
    pub fn sample(&self, logits: &mut [f32], rng: &mut SplitMix64) -> usize {
        self.filter(logits);
        let probs = softmax(logits);
        let u = rng.next_f64();
        let mut acc = 0.0f64;
        let mut last = 0;
        for (i, &p) in probs.iter().enumerate() {
            if p > 0.0 {
                acc += f64::from(p);
                last = i;
                if u < acc {
                    return i;
                }
            }
        }
        // Rounding left the sum a hair under 1 and `u` above it: the last token with mass.
        last
    }
}

/// transformers' `TopKLogitsWarper`: every logit below the k-th largest set to `-inf` (ties of
/// the k-th value kept).
fn top_k(logits: &mut [f32], k: usize) {
    let k = k.min(logits.len());
    if k == 0 {
        return;
    }
    let mut sorted: Vec<f32> = logits.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let kth = sorted[k - 1];
    logits
        .iter_mut()
        .filter(|v| **v < kth)
        .for_each(|v| *v = f32::NEG_INFINITY);
}

/// transformers' `TopPLogitsWarper` with `min_tokens_to_keep` 1: the logits sorted ascending,
/// their softmax accumulated (torch's CPU `cumsum` accumulates f32 in f64, then rounds each
/// sum to f32), and every entry whose cumulative probability is at most `1 - p` (an f32, as
/// torch compares an f32 tensor with a Python float) removed; the largest is always kept.
/// Entries already at `-inf` have probability 0 and stay removed.
fn top_p(logits: &mut [f32], p: f64) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[a].total_cmp(&logits[b]));
    let sorted: Vec<f32> = order.iter().map(|&i| logits[i]).collect();
    let probs = softmax(&sorted);
    let limit = (1.0 - p) as f32;
    let mut acc = 0.0f64;
    let last = order.len().saturating_sub(1);
    for (rank, (&i, &q)) in order.iter().zip(&probs).enumerate() {
        acc += f64::from(q);
        if rank < last && (acc as f32) <= limit {
            logits[i] = f32::NEG_INFINITY;
        }
    }
}

/// The softmax of `logits` in f32 (`-inf` entries give 0).
fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return vec![0.0; logits.len()];
    }
    let exps: Vec<f32> = logits.iter().map(|&v| (v - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|&e| e / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setting(temperature: f64, top_k: Option<usize>, top_p: Option<f64>) -> Sampling {
        Sampling {
            temperature,
            top_k,
            top_p,
            seed: 0,
        }
    }

    #[test]
    fn bad_settings_are_refused_by_name() {
        for (bad, field) in [
            (setting(0.0, None, None), "temperature"),
            (setting(f64::NAN, None, None), "temperature"),
            (setting(1.0, Some(0), None), "top_k"),
            (setting(1.0, None, Some(0.0)), "top_p"),
            (setting(1.0, None, Some(1.5)), "top_p"),
        ] {
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        }
        assert!(setting(0.7, Some(20), Some(0.9)).validate().is_ok());
    }

    #[test]
    fn draws_follow_the_filtered_distribution_and_the_seed() {
        // Two tokens kept by top-k, with probabilities 1/(1+e) and e/(1+e).
        let logits = [0.0f32, 1.0, -5.0, -7.0];
        let s = setting(1.0, Some(2), None);
        let mut rng = SplitMix64::new(7);
        let n = 20_000;
        let mut counts = [0usize; 4];
        for _ in 0..n {
            counts[s.sample(&mut logits.clone(), &mut rng)] += 1;
        }
        assert_eq!(counts[2] + counts[3], 0, "{counts:?}");
        let want = 1.0f64.exp() / (1.0 + 1.0f64.exp());
        let got = counts[1] as f64 / n as f64;
        assert!((got - want).abs() < 0.02, "{got} vs {want}");
        let draw = |seed| {
            let mut rng = SplitMix64::new(seed);
            (0..32)
                .map(|_| s.sample(&mut logits.clone(), &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }
}
