//! The stream simulator: predicts time and memory of the exchange for any `(n, strategy)`,
//! rank count and batch on a [`Profile`](crate::tuning::Profile), for clusters far larger than
//! this machine.

mod shadowing;
mod simulator;

pub use shadowing::{predict_shadowing, ShadowingPrediction};
pub use simulator::{simulate, sweep, SimResult, Stream, TimedStep};
