//! `verdict plot`: the trade-off figure of a bench report. Each speculative mode is a point:
//! its accuracy difference from plain decoding on the same problems (with the bootstrap 95 %
//! interval as an error bar) against its speed ratio to plain decoding (left) and against τ
//! (right). Written as SVG and PNG.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use plotters::{coord::Shift, prelude::*};
use serde::Deserialize;

use crate::{paired::PairedStats, plot_font::register_font};

#[derive(Deserialize)]
struct Report {
    problems: usize,
    summary: Vec<Row>,
    /// The task (`gsm8k`, `humaneval`, …); reports from before the task suite have none.
    #[serde(default)]
    dataset: Option<String>,
    #[serde(default)]
    sampling: Option<Sampling>,
}

#[derive(Deserialize)]
struct Sampling {
    temperature: f64,
}

/// The figure's title unless one is given: the report's task, and its temperature when it
/// sampled.
fn default_title(report: &Report) -> String {
    let task = match report.dataset.as_deref().unwrap_or("gsm8k") {
        "gsm8k" => "GSM8K",
        "humaneval" => "HumanEval",
        "mbpp" => "MBPP",
        "math500" => "MATH-500",
        other => other,
    };
    match report.sampling.as_ref().map(|s| s.temperature).filter(|&t| t > 0.0) {
        Some(t) => format!("{task} at temperature {t}: accuracy cost against speed"),
        None => format!("{task}: accuracy cost against speed"),
    }
}

#[derive(Deserialize)]
struct Row {
    mode: String,
    mean_acceptance_length: Option<f64>,
    speed_vs_plain: Option<f64>,
    paired: Option<PairedStats>,
}

/// One mode's point: (speed ratio, τ, difference in points, interval in points).
struct Point {
    mode: String,
    speed: f64,
    tau: f64,
    difference: f64,
    interval: (f64, f64),
}

fn points(report: &Report) -> Vec<Point> {
    report
        .summary
        .iter()
        .filter_map(|r| {
            let paired = r.paired.as_ref()?;
            Some(Point {
                mode: r.mode.clone(),
                speed: r.speed_vs_plain?,
                tau: r.mean_acceptance_length?,
                difference: 100.0 * paired.accuracy_difference,
                interval: (
                    100.0 * paired.difference_ci95.0,
                    100.0 * paired.difference_ci95.1,
                ),
            })
        })
        .collect()
}

/// The figure of a report: a bench report's trade-off, or a load report's throughput
/// against concurrency (`scripts/load_test.py`). Writes `<out>.svg` and `<out>.png`.
pub fn figure(report: &Path, out: &Path, title: Option<&str>) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(report)
        .with_context(|| format!("cannot read report {}", report.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON", report.display()))?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    if value.get("summary").is_some() {
        let report: Report = serde_json::from_value(value)
            .with_context(|| format!("{} is not a verdict bench report", report.display()))?;
        let title = title.map_or_else(|| default_title(&report), str::to_string);
        return tradeoff(&report, out, &title);
    }
    let load: crate::plot_load::LoadReport = serde_json::from_value(value).with_context(|| {
        format!("{} is neither a verdict bench report nor a load report", report.display())
    })?;
    crate::plot_load::throughput(&load, out, title.unwrap_or("Throughput against concurrency"))
}

/// Write `<out>.svg` and `<out>.png`; returns their paths.
fn tradeoff(report: &Report, out: &Path, title: &str) -> Result<Vec<PathBuf>> {
    let points = points(report);
    if points.is_empty() {
        bail!("the report has no speculative mode paired with plain decoding: run the bench with `plain` among --modes");
    }
    register_font()?;
    let caption = format!("{title} ({} problems)", report.problems);
    let size = (1100, 480);
    let svg = out.with_extension("svg");
    draw(SVGBackend::new(&svg, size).into_drawing_area(), &caption, &points)
        .with_context(|| format!("cannot write {}", svg.display()))?;
    let png = out.with_extension("png");
    draw(BitMapBackend::new(&png, size).into_drawing_area(), &caption, &points)
        .with_context(|| format!("cannot write {}", png.display()))?;
    Ok(vec![svg, png])
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    caption: &str,
    points: &[Point],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let root = root.titled(caption, ("sans-serif", 20))?;
    let (left, right) = root.split_horizontally(550);
    panel(&left, points, |p| p.speed, "speed vs plain decoding (×)", Some(1.0))?;
    panel(&right, points, |p| p.tau, "τ (tokens per speculative step)", None)?;
    root.present()?;
    Ok(())
}

/// One panel: difference (with interval) against `x`; a dashed line at "no change", and at
/// `x_mark` (speed ratio 1) when given.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    points: &[Point],
    x: impl Fn(&Point) -> f64,
    x_desc: &str,
    x_mark: Option<f64>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let xs = points.iter().map(&x).chain(x_mark);
    let (x_lo, x_hi) = xs.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let x_pad = ((x_hi - x_lo) * 0.15).max(0.1);
    let ys = points.iter().flat_map(|p| [p.interval.0, p.interval.1]).chain([0.0]);
    let (y_lo, y_hi) = ys.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    let y_pad = ((y_hi - y_lo) * 0.1).max(1.0);
    let x_range = (x_lo - x_pad)..(x_hi + 2.0 * x_pad);
    let mut chart = ChartBuilder::on(area)
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(x_range.clone(), (y_lo - y_pad)..(y_hi + y_pad))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("accuracy − plain (points)")
        .draw()?;
    let dashed = BLACK.mix(0.5).stroke_width(1);
    chart.draw_series(DashedLineSeries::new(
        [(x_range.start, 0.0), (x_range.end, 0.0)],
        6,
        4,
        dashed,
    ))?;
    if let Some(mark) = x_mark {
        chart.draw_series(DashedLineSeries::new(
            [(mark, y_lo - y_pad), (mark, y_hi + y_pad)],
            6,
            4,
            dashed,
        ))?;
    }
    // Labels alternate above and below their points, in the order of x, so neighbours
    // do not overwrite each other.
    let mut order: Vec<&Point> = points.iter().collect();
    order.sort_by(|a, b| x(a).total_cmp(&x(b)));
    for (i, p) in order.into_iter().enumerate() {
        let px = x(p);
        chart.draw_series([PathElement::new(
            [(px, p.interval.0), (px, p.interval.1)],
            BLUE.mix(0.6).stroke_width(2),
        )])?;
        chart.draw_series([Circle::new((px, p.difference), 5, BLUE.filled())])?;
        let dy = if i % 2 == 0 { -18 } else { 6 };
        chart.draw_series([EmptyElement::at((px, p.difference))
            + Text::new(format!(" {}", p.mode), (2, dy), ("sans-serif", 13).into_font())])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_modes_paired_with_plain_become_points() {
        let report: Report = serde_json::from_value(serde_json::json!({
            "problems": 50,
            "summary": [
                {"mode": "plain", "mean_acceptance_length": null, "speed_vs_plain": 1.0, "paired": null},
                {"mode": "exact", "mean_acceptance_length": 4.0, "speed_vs_plain": 0.9,
                 "paired": {"problems": 50, "better": 1, "worse": 3, "accuracy_difference": -0.04,
                            "difference_ci95": [-0.1, 0.02], "mcnemar_p": 0.625, "agreement": 0.9}}
            ]
        }))
        .unwrap();
        assert_eq!(default_title(&report), "GSM8K: accuracy cost against speed", "a report from before the task suite");
        let points = points(&report);
        assert_eq!(points.len(), 1);
        assert_eq!(points[0].mode, "exact");
        assert!((points[0].difference + 4.0).abs() < 1e-9);
        assert!((points[0].interval.0 + 10.0).abs() < 1e-9);
        let sampled: Report = serde_json::from_value(serde_json::json!({
            "problems": 30, "summary": [], "dataset": "humaneval", "sampling": {"temperature": 0.7, "top_p": 0.95}
        }))
        .unwrap();
        assert_eq!(default_title(&sampled), "HumanEval at temperature 0.7: accuracy cost against speed");
    }

    fn write(dir: &std::path::Path, name: &str, json: serde_json::Value) -> std::path::PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, json.to_string()).unwrap();
        path
    }

    #[test]
    fn reports_are_told_apart_and_bad_ones_named() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("figure");
        let empty = write(dir.path(), "empty.json", serde_json::json!({"plain": {"prompts": 32, "max_tokens": 128, "levels": []}}));
        let err = figure(&empty, &out, None).unwrap_err().to_string();
        assert!(err.contains("no measured levels"), "{err}");
        let other = write(dir.path(), "other.json", serde_json::json!({"something": 1}));
        let err = format!("{:#}", figure(&other, &out, None).unwrap_err());
        assert!(err.contains("neither a verdict bench report nor a load report"), "{err}");
        let bench = write(dir.path(), "bench.json", serde_json::json!({"problems": 5, "summary": []}));
        let err = figure(&bench, &out, None).unwrap_err().to_string();
        assert!(err.contains("no speculative mode paired with plain"), "{err}");
    }
}
