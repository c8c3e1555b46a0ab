//! Reporting: PNG charts for the benchmarks, the memory report, the simulator and training.

mod chart;
mod heatmap;

pub use chart::{chart_font, write_panels, Panel, Series};
pub use heatmap::{write_heatmaps, Heatmap};
