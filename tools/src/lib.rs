//! Support code shared by the `mpipemoe` command-line tool, the examples and the benchmarks:
//! PNG charts and seeded benchmark inputs. Not part of the `mpipemoe` library.

pub mod backends;
pub mod flags;
pub mod inputs;
pub mod report;
