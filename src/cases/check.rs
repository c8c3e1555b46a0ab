//! Running a case through one configuration of the layer and comparing.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};

use super::Case;
use crate::error::Result;
use crate::exchange::executor::StepExecutor;
use crate::layer::{ExchangePath, MoeLayer, ParamKind, Partitions};
use crate::memory::{MemoryReuse, Strategy};
use crate::pipeline::chunk_range;
use crate::tuning::Shadowing;
use crate::{Communicator, GemmPrecision, LocalGroup, MoeBackend};

/// One configuration to check a case with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CheckOptions {
    /// Fused op or reference twin.
    pub path: ExchangePath,
    /// Expert-parallel ranks (threads); the case's tokens are split contiguously over them.
    pub n_ranks: usize,
    /// Partitions of the exchange.
    pub partitions: Partitions,
    /// Memory strategy.
    pub strategy: Strategy,
    /// A memory budget (bytes per rank): the layer then chooses the strategy
    /// (`MemoryReuse::Auto`) and, if `partitions` is adaptive, the split; `strategy` is
    /// ignored.
    pub memory_budget: Option<usize>,
    /// How the exchange runs its schedule (`None`: the backend's default).
    pub executor: Option<StepExecutor>,
    /// Hot experts replicated on every rank (changes where rows are computed, never the
    /// result).
    pub shadowing: Shadowing,
    /// The experts' GEMM precision where the communicator offers a device library.
    pub gemm_precision: GemmPrecision,
}

impl Default for CheckOptions {
    fn default() -> Self {
        Self {
            path: ExchangePath::Fused,
            n_ranks: 1,
            partitions: Partitions::Fixed(1),
            strategy: Strategy::None,
            memory_budget: None,
            executor: None,
            shadowing: Shadowing::Off,
            gemm_precision: GemmPrecision::F32,
        }
    }
}

/// The relative error of one tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorError {
    /// `y`, `dx` or `grad.<param>`.
    pub name: String,
    /// `‖got − want‖ / ‖want‖` (or `‖got‖` where `want` is all zeros).
    pub rel_err: f64,
}

/// Errors of every compared tensor of one case, in a fixed order.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckReport {
    /// The case's name.
    pub case: String,
    /// One entry per tensor.
    pub errors: Vec<TensorError>,
    /// What was computed, gathered over ranks: `y`, `dx` and `grad.<param>` (f64, row-major).
    pub tensors: BTreeMap<String, Vec<f64>>,
    /// The experts the layer shadowed (every rank's list is the same).
    pub shadows: Vec<usize>,
}

impl CheckReport {
    /// The tensor with the largest relative error.
    pub fn worst(&self) -> &TensorError {
        self.errors
            .iter()
            .max_by(|a, b| a.rel_err.total_cmp(&b.rel_err))
            .expect("a report compares at least y")
    }

    /// The largest relative error.
    pub fn max_rel_err(&self) -> f64 {
        self.worst().rel_err
    }

    /// Whether every tensor is within `tolerance`.
    pub fn passed(&self, tolerance: f64) -> bool {
        self.errors.iter().all(|e| e.rel_err <= tolerance)
    }
}

/// `‖got − want‖₂ / ‖want‖₂`; where `want` is all zeros, `‖got‖₂`.
pub fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    agreement_error(got, want, want)
}

/// How far two computed tensors are apart, relative to the true tensor `want`:
/// `‖a − b‖₂ / ‖want‖₂` (or `‖a − b‖₂` where `want` is all zeros). Two approximations of a
/// zero gradient are both rounding noise, and their plain relative difference would be ~1.
pub fn agreement_error(a: &[f64], b: &[f64], want: &[f64]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt();
    let norm = want.iter().map(|w| w * w).sum::<f64>().sqrt();
    if norm == 0.0 {
        diff
    } else {
        diff / norm
    }
}

/// The expected tensor `name` of `case` as f64.
pub fn expected(case: &Case, name: &str) -> Vec<f64> {
    values(case.tensor(name))
}

fn values(data: &TensorData) -> Vec<f64> {
    data.clone().convert::<f64>().into_vec::<f64>().expect("f64 data")
}

/// Runs `case` through the layer configured by `options` on backend `B`, with `loss =
/// sum(y · probe)`, and compares `y`, `dx` and every parameter gradient with the case.
///
/// The case's tokens are split into contiguous slices over the ranks (the count need not
/// divide); outputs and `dx` are gathered in token order, expert gradients come from their
/// owning rank, router and shared-expert gradients are summed over ranks.
pub fn check_case<B>(case: &Case, options: &CheckOptions, device: &B::Device) -> Result<CheckReport>
where
    B: AutodiffBackend + MoeBackend,
{
    check_case_through::<B>(case, options, device, &|comm| comm)
}

/// [`check_case`] with each rank's communicator passed through `wrap` first: how the tests
/// drive the exchange through a communicator's own row path (`WithRowPaths`).
pub fn check_case_through<B>(
    case: &Case,
    options: &CheckOptions,
    device: &B::Device,
    wrap: &(dyn Fn(Arc<dyn Communicator>) -> Arc<dyn Communicator> + Sync),
) -> Result<CheckReport>
where
    B: AutodiffBackend + MoeBackend,
{
    let config = case
        .config
        .clone()
        .with_path(options.path)
        .with_partitions(options.partitions)
        .with_memory_reuse(match options.memory_budget {
            Some(_) => MemoryReuse::Auto,
            None => MemoryReuse::from(options.strategy),
        })
        .with_memory_budget(options.memory_budget)
        .with_executor(options.executor)
        .with_shadowing(options.shadowing)
        .with_gemm_precision(options.gemm_precision);
    config.validate_for_ranks(options.n_ranks)?;
    let x_all = values(case.tensor("x"));
    let probe_all = values(case.tensor("probe"));
    let ranks = LocalGroup::run(options.n_ranks, |ctx| {
        let comm = wrap(ctx.comm.clone());
        run_rank::<B>(case, &config, comm, (&x_all, &probe_all), device)
    })?;
    let shadows = ranks.first().map(|r| r.shadows.clone()).unwrap_or_default();
    let tensors = gather_ranks(case, ranks);
    let errors = tensors
        .iter()
        .map(|(name, got)| TensorError {
            name: name.clone(),
            rel_err: relative_error(got, &values(case.tensor(name))),
        })
        .collect();
    Ok(CheckReport {
        case: case.name.clone(),
        errors,
        tensors,
        shadows,
    })
}

/// What one rank computed.
struct RankResult {
    y: Vec<f64>,
    dx: Vec<f64>,
    /// Every parameter's gradient on this rank, empty where it has none.
    grads: Vec<(&'static str, ParamKind, Vec<f64>)>,
    /// The experts the layer shadowed.
    shadows: Vec<usize>,
}

/// One rank's part: its contiguous slice of the tokens forward, then `loss = sum(y · probe)`
/// backward.
fn run_rank<B>(
    case: &Case,
    config: &crate::layer::MoeLayerConfig,
    comm: Arc<dyn Communicator>,
    (x_all, probe_all): (&[f64], &[f64]),
    device: &B::Device,
) -> Result<RankResult>
where
    B: AutodiffBackend + MoeBackend,
{
    let d_model = config.d_model;
    let layer = MoeLayer::<B>::from_tensor_map(config, &case.tensors, &case.path, device, comm.clone())?;
    let rows = chunk_range(case.n_tokens(), comm.n_ranks(), comm.rank());
    let slice = |all: &[f64]| all[rows.start * d_model..rows.end * d_model].to_vec();
    let shape = [rows.len(), d_model];
    let x = Tensor::<B, 2>::from_data(
        TensorData::new(slice(x_all), shape).convert::<B::FloatElem>(),
        device,
    )
    .require_grad();
    let probe = Tensor::<B, 2>::from_data(
        TensorData::new(slice(probe_all), shape).convert::<B::FloatElem>(),
        device,
    );
    let out = layer.try_forward(x.clone())?;
    let shadows = out.stats.shadows.clone();
    let y = values(&out.output.to_data());
    let grads = (out.output * probe).sum().backward();
    let dx = x
        .grad(&grads)
        .map(|g| values(&g.into_data()))
        .unwrap_or_else(|| vec![0.0; rows.len() * d_model]);
    let grads = layer
        .grads_by_name(&grads)
        .into_iter()
        .map(|(name, kind, g)| (name, kind, g.map(|g| values(&g)).unwrap_or_default()))
        .collect();
    Ok(RankResult {
        y,
        dx,
        grads,
        shadows,
    })
}

/// The ranks' results as the case's tensors: `y` and `dx` in token order, expert gradients
/// concatenated in rank order, replicated parameters' gradients summed.
fn gather_ranks(case: &Case, ranks: Vec<RankResult>) -> BTreeMap<String, Vec<f64>> {
    let n_ranks = ranks.len();
    let y: Vec<f64> = ranks.iter().flat_map(|r| r.y.iter().copied()).collect();
    let dx: Vec<f64> = ranks.iter().flat_map(|r| r.dx.iter().copied()).collect();
    let mut grads: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in &ranks {
        for (name, kind, g) in &r.grads {
            let want_len = case.tensor(name).num_elements();
            let entry = grads.entry(name).or_default();
            match kind {
                // A rank whose experts received no rows may have no gradient for them at
                // all on the reference path: its share is zeros.
                ParamKind::Expert if g.is_empty() => {
                    entry.extend(std::iter::repeat_n(0.0, want_len / n_ranks))
                }
                ParamKind::Expert => entry.extend_from_slice(g),
                ParamKind::Replicated => {
                    entry.resize(want_len, 0.0);
                    entry.iter_mut().zip(g).for_each(|(acc, v)| *acc += v);
                }
            }
        }
    }
    let mut tensors = BTreeMap::from([("y".to_string(), y), ("dx".to_string(), dx)]);
    tensors.extend(grads.into_iter().map(|(name, g)| (format!("grad.{name}"), g)));
    tensors
}
