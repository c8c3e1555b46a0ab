//! The reference-case harness: load a case file, run it through any configuration of the
//! layer (path, ranks, partitions, strategy), and compare every tensor with the expected one.
//! `mpipemoe check`, the tests and the benches all use it (through `harness`, which is not
//! part of the documented API).

mod case;
mod check;
mod generate;
mod golden;
mod oracle_math;

pub use case::Case;
pub use check::{
    agreement_error, check_case, check_case_through, expected, relative_error, CheckOptions, CheckReport,
    TensorError,
};
