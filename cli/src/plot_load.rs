//! The throughput figure of a load report (`scripts/load_test.py`): total generated tokens/s
//! against concurrency, one line per server configuration in the report. Written as SVG and
//! PNG, like the bench's trade-off figure.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use anyhow::{bail, Result};
use plotters::{coord::Shift, prelude::*};
use serde::Deserialize;

use crate::plot_font::register_font;

/// A load report: each label's levels.
pub type LoadReport = BTreeMap<String, LoadRun>;

#[derive(Deserialize)]
pub struct LoadRun {
    pub prompts: usize,
    pub max_tokens: usize,
    pub levels: Vec<Level>,
}

#[derive(Deserialize)]
pub struct Level {
    pub concurrency: usize,
    pub tokens_per_second: f64,
}

/// Write `<out>.svg` and `<out>.png` from a parsed load report; returns their paths.
pub fn throughput(report: &LoadReport, out: &Path, title: &str) -> Result<Vec<PathBuf>> {
    if report.values().all(|run| run.levels.is_empty()) {
        bail!("the load report has no measured levels");
    }
    register_font()?;
    let first = report.values().next().unwrap();
    let caption = format!("{title} ({} prompts, {} tokens each)", first.prompts, first.max_tokens);
    let size = (800, 500);
    let svg = out.with_extension("svg");
    draw(SVGBackend::new(&svg, size).into_drawing_area(), &caption, report)?;
    let png = out.with_extension("png");
    draw(BitMapBackend::new(&png, size).into_drawing_area(), &caption, report)?;
    Ok(vec![svg, png])
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, caption: &str, report: &LoadReport) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let levels = || report.values().flat_map(|run| &run.levels);
    let c_max = levels().map(|l| l.concurrency).max().unwrap_or(1) as f64;
    let t_max = levels().map(|l| l.tokens_per_second).fold(0.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 18))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d((0.5..c_max + 0.5).log_scale(), 0.0..t_max * 1.15)?;
    chart
        .configure_mesh()
        .x_desc("concurrent requests")
        .y_desc("generated tokens/s, all requests")
        .x_label_formatter(&|c| format!("{c:.0}"))
        .light_line_style(WHITE)
        .draw()?;
    for (i, (label, run)) in report.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let points: Vec<(f64, f64)> = run.levels.iter().map(|l| (l.concurrency as f64, l.tokens_per_second)).collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(label.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    root.present()?;
    Ok(())
}
