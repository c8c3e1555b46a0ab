//! The reference-case harness: load a case file, run it through any configuration of the
//! layer (path, ranks, partitions, strategy), and compare every tensor with the expected one.
//! `mpipemoe check`, the tests and the benches all use it.

mod case;
mod check;
mod generate;
mod golden;

pub use case::Case;
pub use check::{check_case, relative_error, CheckOptions, CheckReport, TensorError};
