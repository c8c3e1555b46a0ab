//! Reporting: PNG charts for the benchmarks, the memory report and the simulator.

mod chart;

pub use chart::{write_panels, Panel, Series};
