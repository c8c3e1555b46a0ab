//! Support code shared by the `mpipemoe` command-line tool, the examples and the benchmarks:
//! PNG charts, seeded benchmark inputs and the training binaries' heap setting. Not part of
//! the `mpipemoe` library.

pub mod backends;
pub mod bench_ranks;
pub mod flags;
pub mod heap;
pub mod inputs;
pub mod ranks;
pub mod report;
