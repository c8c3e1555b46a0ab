//! Algorithm 1: the adaptive choice of the number of partitions `n` for a batch of `B` tokens.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{MoeError, Result};

/// Times one trial of `n` partitions for a batch of `B` tokens.
///
/// [`WallClock`] really runs the trial; tests inject a fake that returns a cost without
/// running anything, which makes the search deterministic.
pub trait TrialTimer: Send + Sync + std::fmt::Debug {
    /// The time of one trial. `run` executes it once; a timer may call it several times.
    fn time(&self, tokens: usize, n: usize, run: &mut dyn FnMut() -> Result<()>) -> Result<Duration>;
}

/// Times trials on the wall clock: `warm_up` untimed runs, then the median of `repeats`.
#[derive(Debug, Clone, Copy)]
pub struct WallClock {
    /// Untimed runs first.
    pub warm_up: usize,
    /// Timed runs; the median is returned.
    pub repeats: usize,
}

impl Default for WallClock {
    fn default() -> Self {
        Self {
            warm_up: 1,
            repeats: 3,
        }
    }
}

impl TrialTimer for WallClock {
    fn time(&self, _tokens: usize, _n: usize, run: &mut dyn FnMut() -> Result<()>) -> Result<Duration> {
        for _ in 0..self.warm_up {
            run()?;
        }
        let mut times = Vec::with_capacity(self.repeats.max(1));
        for _ in 0..self.repeats.max(1) {
            let start = Instant::now();
            run()?;
            times.push(start.elapsed());
        }
        times.sort();
        Ok(times[times.len() / 2])
    }
}

/// `searchBestGran(B)`: times each candidate `n` and returns the fastest (the smaller `n` on
/// a tie), with every candidate's time in seconds.
///
/// `trial(n)` runs one trial with `n` partitions. `reduce` combines the times over ranks
/// (a sum over the group) before the choice, so that every rank picks the same `n`.
pub fn search_best_gran(
    tokens: usize,
    candidates: &[usize],
    timer: &dyn TrialTimer,
    trial: &mut dyn FnMut(usize) -> Result<()>,
    reduce: &mut dyn FnMut(&mut [f64]) -> Result<()>,
) -> Result<(usize, Vec<(usize, f64)>)> {
    if candidates.is_empty() {
        return Err(MoeError::config(
            "adaptive_candidates",
            "adaptive search has no candidate partition counts",
        ));
    }
    let mut times = Vec::with_capacity(candidates.len());
    for &n in candidates {
        times.push(timer.time(tokens, n, &mut || trial(n))?.as_secs_f64());
    }
    reduce(&mut times)?;
    let timings: Vec<(usize, f64)> = candidates.iter().copied().zip(times).collect();
    let best = timings
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
        .map(|(n, _)| *n)
        .expect("non-empty");
    Ok((best, timings))
}

/// Algorithm 1's state: a hash cache `B → n` and a set of disjoint ranges of `B`, one per `n`,
/// with `n` monotone in `B` (the paper's hypothesis).
///
/// Lookups and inserts are `O(log r)` for `r` ranges (a `BTreeMap` keyed by each range's lower
/// end). A search whose result would break disjointness or monotonicity (noisy timings can
/// do that) is cached for its exact `B` only, and the ranges are left as they were.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GranularityTable {
    /// `cache_table`: exact `B` → `n`.
    cache: HashMap<usize, usize>,
    /// `S`: lower end → (upper end, n); disjoint, with `n` increasing in `B`.
    ranges: BTreeMap<usize, (usize, usize)>,
    /// Searches run so far.
    #[serde(default)]
    searches: usize,
}

/// How a lookup was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// From the hash cache (lines 3–5).
    Cached,
    /// From a range that contains `B` (line 6).
    Range,
    /// By a new search (lines 7–14).
    Searched,
}

impl GranularityTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// The range containing `tokens` and its `n` (`find(S, B)`).
    pub fn find(&self, tokens: usize) -> Option<(std::ops::RangeInclusive<usize>, usize)> {
        self.ranges
            .range(..=tokens)
            .next_back()
            .filter(|(_, (upper, _))| tokens <= *upper)
            .map(|(&lower, &(upper, n))| (lower..=upper, n))
    }

    /// Algorithm 1: returns `n` for `tokens`, calling `search` (`searchBestGran`) on a miss.
    pub fn lookup(
        &mut self,
        tokens: usize,
        search: impl FnOnce(usize) -> Result<usize>,
    ) -> Result<(usize, Lookup)> {
        if let Some(&n) = self.cache.get(&tokens) {
            return Ok((n, Lookup::Cached));
        }
        let (n, how) = match self.find(tokens) {
            Some((_, n)) => (n, Lookup::Range),
            None => {
                let n = search(tokens)?;
                self.searches += 1;
                self.insert(tokens, n);
                (n, Lookup::Searched)
            }
        };
        self.cache.insert(tokens, n);
        Ok((n, how))
    }

    /// Lines 8–14: inserts `(n, [B, B])`, or widens `n`'s range to cover `B`, when that keeps
    /// the ranges disjoint and monotone.
    fn insert(&mut self, tokens: usize, n: usize) {
        let existing = self
            .ranges
            .iter()
            .find(|(_, (_, m))| *m == n)
            .map(|(&lo, &(hi, _))| (lo, hi));
        let (lower, upper) = match existing {
            Some((lo, hi)) => (lo.min(tokens), hi.max(tokens)),
            None => (tokens, tokens),
        };
        let consistent = self
            .ranges
            .iter()
            .all(|(&lo, &(hi, m))| m == n || (hi < lower && m < n) || (lo > upper && m > n));
        if consistent {
            if let Some((lo, _)) = existing {
                self.ranges.remove(&lo);
            }
            self.ranges.insert(lower, (upper, n));
        }
    }

    /// The ranges, in order of `B`: `(lower, upper, n)`.
    pub fn ranges(&self) -> Vec<(usize, usize, usize)> {
        self.ranges.iter().map(|(&lo, &(hi, n))| (lo, hi, n)).collect()
    }

    /// Number of searches run so far.
    pub fn searches(&self) -> usize {
        self.searches
    }

    /// The table as JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("the table serializes")
    }

    /// A table from JSON written by [`to_json`](Self::to_json). Checks that the ranges are
    /// disjoint and monotone.
    pub fn from_json(json: &str) -> Result<Self> {
        let table: Self =
            serde_json::from_str(json).map_err(|e| MoeError::config("granularity table", e.to_string()))?;
        let ranges = table.ranges();
        for pair in ranges.windows(2) {
            let ((_, hi, n), (lo, _, m)) = (pair[0], pair[1]);
            if lo <= hi || m <= n {
                return Err(MoeError::config(
                    "granularity table",
                    format!("ranges {pair:?} overlap or are not increasing in n"),
                ));
            }
        }
        Ok(table)
    }
}
