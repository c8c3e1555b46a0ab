//! Heatmaps (load per expert over training steps), written as PNG with plotters.

use std::path::Path;

use plotters::prelude::*;

use super::chart::{chart_err, ensure_font, FONT};
use mpipemoe::Result;

/// One heatmap: `values[row][column]`, drawn with rows bottom to top.
#[derive(Debug, Clone, PartialEq)]
pub struct Heatmap {
    /// Caption.
    pub title: String,
    /// X-axis label (the columns, e.g. training steps).
    pub x_label: String,
    /// Y-axis label (the rows, e.g. experts).
    pub y_label: String,
    /// `values[row][column]`; every row has the same length.
    pub values: Vec<Vec<f64>>,
    /// X value of the first column and the step between columns.
    pub x_start: f64,
    /// Step between columns on the x axis.
    pub x_step: f64,
    /// The value drawn white; lower is blue, higher is red, saturating at `0` and `2 · center`.
    pub center: f64,
}

/// Blue (low) – white (`center`) – red (high).
fn color(value: f64, center: f64) -> RGBColor {
    let t = if center > 0.0 {
        (value / center - 1.0).clamp(-1.0, 1.0)
    } else {
        0.0
    };
    let fade = |c: f64| (255.0 * (1.0 - c.abs())) as u8;
    if t >= 0.0 {
        RGBColor(255, fade(t), fade(t))
    } else {
        RGBColor(fade(t), fade(t), 255)
    }
}

/// Writes `maps` stacked vertically to a PNG file at `path`.
pub fn write_heatmaps(path: &Path, title: &str, maps: &[Heatmap]) -> Result<()> {
    ensure_font()?;
    let size = (900, 300 * maps.len().max(1) as u32 + 50);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| chart_err(path, e))?;
    let root = root.titled(title, (FONT, 24)).map_err(|e| chart_err(path, e))?;
    for (map, area) in maps.iter().zip(root.split_evenly((maps.len().max(1), 1))) {
        draw(map, &area).map_err(|e| chart_err(path, e))?;
    }
    root.present().map_err(|e| chart_err(path, e))
}

fn draw<DB: DrawingBackend>(
    map: &Heatmap,
    area: &DrawingArea<DB, plotters::coord::Shift>,
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let rows = map.values.len().max(1);
    let columns = map.values.first().map_or(1, Vec::len).max(1);
    let x_end = map.x_start + map.x_step * columns as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(&map.title, (FONT, 16))
        .margin(10)
        .x_label_area_size(34)
        .y_label_area_size(50)
        .build_cartesian_2d(map.x_start..x_end, 0.0..rows as f64)?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc(map.x_label.as_str())
        .y_desc(map.y_label.as_str())
        .y_labels(rows.min(16) + 1)
        .y_label_formatter(&|v| format!("{}", *v as usize))
        .x_label_formatter(&|v| format!("{}", *v as usize))
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 13))
        .draw()?;
    chart.draw_series(map.values.iter().enumerate().flat_map(|(r, row)| {
        row.iter().enumerate().map(move |(c, &v)| {
            let x = map.x_start + map.x_step * c as f64;
            Rectangle::new(
                [(x, r as f64), (x + map.x_step, r as f64 + 1.0)],
                color(v, map.center).filled(),
            )
        })
    }))?;
    Ok(())
}
