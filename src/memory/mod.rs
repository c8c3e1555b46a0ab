//! Memory reuse and its models: the strategies S1–S4 ([`Strategy`], [`MemoryReuse`]), the
//! paper's memory equations (Eq. 1–9, [`PaperTerms`]) next to what this implementation holds
//! ([`ImplementationModel`]), the planner's answer ([`MemoryPlan`]), and the meter that keeps
//! host-store bytes apart from device bytes ([`MemoryMeter`]).

#[cfg(feature = "testkit")]
pub(crate) mod alloc;
mod budget;
pub(crate) mod host_store;
mod implementation;
mod meter;
mod model;
mod route;
mod rows;

pub use budget::{fit_budget, rank_peak_bytes, BudgetCandidate, MemoryDecision, MODEL_HEADROOM};
pub(crate) use host_store::{HostBlock, HostStore};
pub use implementation::{ImplementationModel, Phase, Term};
pub use meter::{MemoryMeter, MemoryReport};
pub use model::{ImplementationTerms, LayerShape, MemoryPlan, PaperTerms};
pub use route::{Execution, ExpertRoute, GemmOperands};
pub use rows::RankRows;

pub use crate::pipeline::{MemoryReuse, Restore, Strategy};
