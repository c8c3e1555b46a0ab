//! Line charts in a grid of panels, written as PNG with plotters.

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use mpipemoe::{MoeError, Result};

/// One line of a panel.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend entry.
    pub name: String,
    /// `(x, y)` points, drawn in order.
    pub points: Vec<(f64, f64)>,
}

/// One chart of the grid.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    /// Caption.
    pub title: String,
    /// X-axis label.
    pub x_label: String,
    /// Y-axis label.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
    /// Logarithmic x axis (partition counts, token counts).
    pub log_x: bool,
}

pub(crate) const FONT: &str = "mpipemoe-sans";

/// Loads a TrueType font once per process for plotters' text (plotters keeps its font
/// registry process-wide). `MPIPEMOE_FONT` names a .ttf file; otherwise common locations of
/// DejaVu Sans and Liberation Sans are tried.
pub(crate) fn ensure_font() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let candidates = std::env::var("MPIPEMOE_FONT").into_iter().chain(
                [
                    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
                    "/usr/share/fonts/TTF/DejaVuSans.ttf",
                    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
                    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
                    "/Library/Fonts/Arial.ttf",
                ]
                .map(String::from),
            );
            for path in candidates {
                if let Ok(bytes) = std::fs::read(&path) {
                    // plotters requires 'static font bytes; one font per process.
                    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                    if plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_ok() {
                        return Ok(());
                    }
                }
            }
            Err("no TrueType font found for chart text; set MPIPEMOE_FONT to a .ttf file".to_string())
        })
        .clone()
        .map_err(MoeError::Backend)
}

/// Whether charts can be drawn here: loads the font their text needs (as every chart does
/// first), so a run that promises a chart can fail before its work rather than after it.
///
/// # Errors
/// [`MoeError::Backend`] naming `MPIPEMOE_FONT` when no TrueType font is found.
pub fn chart_font() -> Result<()> {
    ensure_font()
}

pub(crate) fn chart_err(path: &Path, e: impl std::fmt::Display) -> MoeError {
    MoeError::file(path, format!("cannot draw chart: {e}"))
}

/// Writes `panels` as a grid with `columns` columns to a PNG file at `path`.
pub fn write_panels(path: &Path, title: &str, panels: &[Panel], columns: usize) -> Result<()> {
    ensure_font()?;
    let columns = columns.max(1);
    let rows = panels.len().div_ceil(columns).max(1);
    let size = (560 * columns as u32, 380 * rows as u32 + 50);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| chart_err(path, e))?;
    let root = root.titled(title, (FONT, 26)).map_err(|e| chart_err(path, e))?;
    // A series name keeps one colour in every panel, in order of first appearance, so a
    // reader can follow "PipeMoE" across panels that show different sets of series.
    let mut names: Vec<&str> = Vec::new();
    for series in panels.iter().flat_map(|p| &p.series) {
        if !names.contains(&series.name.as_str()) {
            names.push(&series.name);
        }
    }
    let areas = root.split_evenly((rows, columns));
    for (panel, area) in panels.iter().zip(areas) {
        draw_panel(panel, &area, &names).map_err(|e| chart_err(path, e))?;
    }
    root.present().map_err(|e| chart_err(path, e))?;
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(
    panel: &Panel,
    area: &DrawingArea<DB, plotters::coord::Shift>,
    names: &[&str],
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let points = || panel.series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1) = points().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let y1 = points().fold(0.0f64, |a, p| a.max(p.1));
    if x0 >= x1 {
        x0 -= 1.0;
        x1 += 1.0;
    }
    let y1 = if y1 > 0.0 { y1 * 1.12 } else { 1.0 };
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(&panel.title, (FONT, 18))
        .margin(12)
        .x_label_area_size(38)
        .y_label_area_size(60);
    let colors = [
        &BLUE,
        &RED,
        &GREEN,
        &MAGENTA,
        &CYAN,
        &BLACK,
        &RGBColor(230, 140, 0),
        &RGBColor(120, 60, 160),
    ];
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(panel.x_label.as_str())
                .y_desc(panel.y_label.as_str())
                .label_style((FONT, 13))
                .axis_desc_style((FONT, 14))
                .draw()?;
            for series in &panel.series {
                let i = names.iter().position(|n| *n == series.name).unwrap_or(0);
                let color = colors[i % colors.len()];
                chart
                    .draw_series(LineSeries::new(
                        series.points.iter().copied(),
                        color.stroke_width(2),
                    ))?
                    .label(series.name.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
                chart.draw_series(series.points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
            }
            chart
                .configure_series_labels()
                .label_font((FONT, 13))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperRight)
                .draw()?;
        }};
    }
    if panel.log_x {
        draw!(builder.build_cartesian_2d((x0..x1).log_scale(), 0.0..y1)?);
    } else {
        draw!(builder.build_cartesian_2d(x0..x1, 0.0..y1)?);
    }
    Ok(())
}
