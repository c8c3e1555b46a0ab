//! The performance model of the memory strategies: Eq. 10–13 with Table III.

use serde::Serialize;

use super::Profile;
use crate::error::{MoeError, Result};
use crate::memory::{rank_peak_bytes, Execution, LayerShape, RankRows, Strategy, MODEL_HEADROOM};

/// One strategy's cost, stream by stream.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StrategyCost {
    /// The strategy.
    pub strategy: Strategy,
    /// `Q_fw` (GEMMs, all-to-alls, copies in units of `v_0`).
    pub q_fw: [f64; 3],
    /// `Q_bw`.
    pub q_bw: [f64; 3],
    /// The all-to-all speed factor Table III assigns (`μ_comp` or `μ_all`).
    pub mu: f64,
    /// The copy speed factor (`η_all`, or 1 without copies).
    pub eta: f64,
    /// Forward stream times: compute, all-to-all, copy (seconds).
    pub forward: [f64; 3],
    /// Backward stream times (seconds).
    pub backward: [f64; 3],
    /// `C = max(forward) + max(backward)` (seconds).
    pub cost: f64,
    /// Device bytes this implementation holds at its peak under the strategy, with balanced
    /// routing, the pass run as [`StrategyChoice::execution`] says.
    pub peak_bytes: f64,
    /// Whether `peak_bytes` with the model's headroom ([`MODEL_HEADROOM`]) fits the budget:
    /// the test the layer's own budget applies.
    pub fits: bool,
}

/// The cheapest strategy and how every candidate compared.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StrategyChoice {
    /// The strategy chosen.
    pub best: Strategy,
    /// Every candidate, in Table III's order.
    pub candidates: Vec<StrategyCost>,
    /// The memory budget it was chosen under, bytes.
    pub budget_bytes: Option<f64>,
    /// How the modelled pass runs (the experts' route and the executor): the peaks are this
    /// execution's.
    pub execution: Execution,
}

impl StrategyChoice {
    /// A table of the three stream terms of every candidate, and the choice.
    pub fn explain(&self) -> String {
        let ms = |s: f64| s * 1e3;
        let mut out = String::from(
            "strategy  Q_fw         Q_bw         fw comp/comm/copy ms      bw comp/comm/copy ms      cost ms  peak MiB  fits\n",
        );
        for c in &self.candidates {
            out.push_str(&format!(
                "{:<9} {:<12} {:<12} {:>7.3} {:>7.3} {:>7.3}   {:>7.3} {:>7.3} {:>7.3}   {:>7.3} {:>9.1}  {}\n",
                c.strategy.name(),
                format!("{:?}", c.q_fw.map(|q| (q * 10.0).round() / 10.0)),
                format!("{:?}", c.q_bw.map(|q| (q * 10.0).round() / 10.0)),
                ms(c.forward[0]),
                ms(c.forward[1]),
                ms(c.forward[2]),
                ms(c.backward[0]),
                ms(c.backward[1]),
                ms(c.backward[2]),
                ms(c.cost),
                c.peak_bytes / (1024.0 * 1024.0),
                if c.fits { "yes" } else { "no" },
            ));
        }
        let budget = self.budget_bytes.map_or("no memory budget".to_string(), |b| {
            format!(
                "a budget of {:.1} MiB with the model's {:.0}% headroom",
                b / (1024.0 * 1024.0),
                (MODEL_HEADROOM - 1.0) * 100.0
            )
        });
        out.push_str(&format!("chosen: {} (cheapest that fits {budget})\n", self.best));
        out
    }
}

/// Eq. 13 over a [`Profile`].
#[derive(Debug, Clone, PartialEq)]
pub struct CostModel {
    /// The hardware the costs are for.
    pub profile: Profile,
}

impl CostModel {
    /// A model over `profile`.
    pub fn new(profile: Profile) -> Self {
        Self { profile }
    }

    /// Table III's `Q_fw`, `Q_bw` for `strategy`. The copy counts (4 for `T_M`, 5 for both)
    /// assume `H = 4M` as the paper does; here the `T_M` copy is scaled by `d_inner / d_model`,
    /// which reproduces Table III for the paper's shapes and stays right for others.
    pub fn q(strategy: Strategy, d_model: usize, d_inner: usize) -> ([f64; 3], [f64; 3]) {
        let t_m = d_inner as f64 / d_model as f64;
        match strategy {
            Strategy::None => ([2.0, 2.0, 0.0], [4.0, 2.0, 0.0]),
            Strategy::S1 => ([2.0, 2.0, 1.0 + t_m], [4.0, 2.0, 1.0 + t_m]),
            Strategy::S2 => ([2.0, 2.0, t_m], [4.0, 3.0, t_m]),
            Strategy::S3 => ([2.0, 2.0, 1.0], [5.0, 2.0, 1.0]),
            Strategy::S4 => ([2.0, 2.0, 0.0], [5.0, 3.0, 0.0]),
        }
    }

    /// Eq. 13 for one strategy: `C = max(q1·v_comp / (σ·W_comp), q2·v_comm / (μ·W_comm),
    /// q3·v_mem / (η·W_mem))` for forward and for backward, with `v_comp = 2·B·M·H` FLOPs (one
    /// expert GEMM), `v_comm = v_mem = B·M` elements of `elem_bytes`. The peak is the
    /// implementation's model with balanced routing, the pass run as `execution` says (the
    /// layer's is `MoeLayer::strategy_choice`'s; `Execution::on_gpu` is a GPU's default).
    pub fn cost(
        &self,
        strategy: Strategy,
        shape: &LayerShape,
        elem_bytes: usize,
        execution: Execution,
    ) -> StrategyCost {
        StrategyCost {
            peak_bytes: rank_peak_bytes(shape, &RankRows::balanced(shape), strategy, execution, elem_bytes),
            ..self.timed(strategy, shape, elem_bytes)
        }
    }

    /// Every strategy, cheapest first by Eq. 13 alone (ties in Table III's order): the order
    /// in which a memory budget tries them. No memory model is replayed for it.
    pub fn cheapest_first(&self, shape: &LayerShape, elem_bytes: usize) -> Vec<Strategy> {
        let mut costs: Vec<(f64, Strategy)> = Strategy::ALL
            .into_iter()
            .map(|s| (self.timed(s, shape, elem_bytes).cost, s))
            .collect();
        costs.sort_by(|a, b| a.0.total_cmp(&b.0));
        costs.into_iter().map(|c| c.1).collect()
    }

    /// [`cost`](Self::cost)'s stream terms, without the peak (0).
    fn timed(&self, strategy: Strategy, shape: &LayerShape, elem_bytes: usize) -> StrategyCost {
        let p = &self.profile;
        let b = shape.rows();
        let v_comp = 2.0 * b * shape.d_model as f64 * shape.d_hidden as f64;
        let v_bytes = b * shape.d_model as f64 * elem_bytes as f64;
        let (q_fw, q_bw) = Self::q(strategy, shape.d_model, shape.d_inner());
        let copies = matches!(strategy, Strategy::S1 | Strategy::S2 | Strategy::S3);
        let (mu, eta) = if copies {
            (p.mu_all, p.eta_all)
        } else {
            (p.mu_comp, 1.0)
        };
        let terms = |q: [f64; 3]| {
            [
                q[0] * v_comp / (p.sigma * p.w_comp),
                q[1] * v_bytes / (mu * p.w_comm),
                q[2] * v_bytes / (eta * p.w_mem),
            ]
        };
        let (forward, backward) = (terms(q_fw), terms(q_bw));
        let max = |t: [f64; 3]| t.into_iter().fold(0.0, f64::max);
        StrategyCost {
            strategy,
            q_fw,
            q_bw,
            mu,
            eta,
            forward,
            backward,
            cost: max(forward) + max(backward),
            peak_bytes: 0.0,
            fits: true,
        }
    }

    /// `MemoryReuse::Auto`: the cheapest strategy whose modelled peak, with the model's
    /// headroom, fits `budget_bytes` as the layer's budget tests it (every strategy fits
    /// without a budget, and then no reuse is cheapest); the pass run as `execution` says.
    ///
    /// # Errors
    /// [`MoeError::Memory`] if no strategy fits, naming the smallest peak.
    pub fn choose(
        &self,
        shape: &LayerShape,
        elem_bytes: usize,
        budget_bytes: Option<f64>,
        execution: Execution,
    ) -> Result<StrategyChoice> {
        let candidates: Vec<StrategyCost> = Strategy::ALL
            .into_iter()
            .map(|s| {
                let mut c = self.cost(s, shape, elem_bytes, execution);
                c.fits = budget_bytes.is_none_or(|b| c.peak_bytes * MODEL_HEADROOM <= b);
                c
            })
            .collect();
        let best = candidates
            .iter()
            .filter(|c| c.fits)
            .min_by(|a, b| a.cost.total_cmp(&b.cost))
            .map(|c| c.strategy);
        match best {
            Some(best) => Ok(StrategyChoice {
                best,
                candidates,
                budget_bytes,
                execution,
            }),
            None => {
                let smallest = candidates
                    .iter()
                    .map(|c| c.peak_bytes)
                    .fold(f64::INFINITY, f64::min);
                Err(MoeError::Memory(format!(
                    "no strategy fits the budget of {:.1} MiB; the smallest modelled peak is {:.1} MiB, {:.1} MiB with the model's {:.0}% headroom (try more partitions)",
                    budget_bytes.unwrap_or(0.0) / (1024.0 * 1024.0),
                    smallest / (1024.0 * 1024.0),
                    smallest * MODEL_HEADROOM / (1024.0 * 1024.0),
                    (MODEL_HEADROOM - 1.0) * 100.0
                )))
            }
        }
    }
}
