//! `verdict plot`: the trade-off figure of a bench report. Each speculative mode is a point:
//! its accuracy difference from plain decoding on the same problems (with the bootstrap 95 %
//! interval as an error bar) against its speed ratio to plain decoding (left) and against τ
//! (right), a legend naming the points. Several reports (a task each) make one figure pooled
//! over the tasks, as `verdict pool-reports` pools them, its speed how soon the answers come.
//! Written as SVG and PNG.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use plotters::{coord::Shift, prelude::*};
use serde::Deserialize;

use verdict_eval::benchmark::TaskName;

use crate::{
    modes::Mode,
    paired::PairedStats,
    plot_font::register_font,
    pool::{load, pool_over_tasks, time_ratio, RunsByMode},
};

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
    let task = display_name(report.dataset.as_deref().unwrap_or("gsm8k"));
    match report.sampling.as_ref().map(|s| s.temperature).filter(|&t| t > 0.0) {
        Some(t) => format!("{task} at temperature {t}: accuracy cost against speed"),
        None => format!("{task}: accuracy cost against speed"),
    }
}

/// A task as the papers write it.
fn display_name(task: &str) -> &str {
    match task {
        "gsm8k" => "GSM8K",
        "humaneval" => "HumanEval",
        "mbpp" => "MBPP",
        "math500" => "MATH-500",
        other => other,
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
/// against concurrency (`scripts/load_test.py`); of several bench reports, their trade-off
/// pooled over the tasks. Writes `<out>.svg` and `<out>.png`.
pub fn figure(reports: &[PathBuf], out: &Path, title: Option<&str>) -> Result<Vec<PathBuf>> {
    create_parent(out)?;
    let [report] = reports else {
        let title = title.unwrap_or("All tasks: accuracy cost against time");
        return pooled_tradeoff(reports, out, title);
    };
    let text = std::fs::read_to_string(report)
        .with_context(|| format!("cannot read report {}", report.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not JSON", report.display()))?;
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

fn create_parent(out: &Path) -> Result<()> {
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    Ok(())
}

/// Each speculative mode of several tasks' reports, pooled: the accuracy difference paired
/// within each task, τ over the steps that drafted, and as speed plain's wall clock over the mode's on
/// the runs both have (a lossy mode's answers change length, so tokens/s would flatter it).
fn pooled_points(by_task: &[(TaskName, &RunsByMode)]) -> Vec<Point> {
    let plain = Mode::plain();
    pool_over_tasks(by_task, &plain)
        .into_iter()
        .filter_map(|m| {
            let (_, paired) = m.against_baseline.as_ref()?;
            Some(Point {
                mode: format!("{} ({} problems)", m.mode.0, paired.problems),
                speed: time_ratio(by_task, &m.mode, &plain)?,
                tau: m.counters.as_ref()?.mean_acceptance_length(),
                difference: 100.0 * paired.accuracy_difference,
                interval: (100.0 * paired.difference_ci95.0, 100.0 * paired.difference_ci95.1),
            })
        })
        .collect()
}

/// The trade-off of several bench reports pooled over their tasks.
fn pooled_tradeoff(reports: &[PathBuf], out: &Path, title: &str) -> Result<Vec<PathBuf>> {
    let by_task = load(reports)?;
    let tasks: Vec<(TaskName, &RunsByMode)> = by_task.iter().map(|(t, m)| (*t, m)).collect();
    let points = pooled_points(&tasks);
    if points.is_empty() {
        bail!("no speculative mode in these reports shares a problem with plain decoding: run the bench with `plain` among --modes");
    }
    let names: Vec<&str> = tasks.iter().map(|(t, _)| display_name(t.as_str())).collect();
    let caption = format!("{title} ({})", names.join(", "));
    let x_desc = "time: plain decoding's wall clock / the mode's (×)";
    write_figure(out, &caption, x_desc, &points)
}

/// The trade-off of one report, its speed the report's tokens/s against plain's.
fn tradeoff(report: &Report, out: &Path, title: &str) -> Result<Vec<PathBuf>> {
    let points = points(report);
    if points.is_empty() {
        bail!("the report has no speculative mode paired with plain decoding: run the bench with `plain` among --modes");
    }
    let caption = format!("{title} ({} problems)", report.problems);
    write_figure(out, &caption, "speed vs plain decoding (×)", &points)
}

/// Write `<out>.svg` and `<out>.png`; returns their paths.
fn write_figure(out: &Path, caption: &str, x_desc: &str, points: &[Point]) -> Result<Vec<PathBuf>> {
    register_font()?;
    let size = (1500, 480);
    let svg = out.with_extension("svg");
    draw(SVGBackend::new(&svg, size).into_drawing_area(), caption, x_desc, points)
        .with_context(|| format!("cannot write {}", svg.display()))?;
    let png = out.with_extension("png");
    draw(BitMapBackend::new(&png, size).into_drawing_area(), caption, x_desc, points)
        .with_context(|| format!("cannot write {}", png.display()))?;
    Ok(vec![svg, png])
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    caption: &str,
    x_desc: &str,
    points: &[Point],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let root = root.titled(caption, ("sans-serif", 20))?;
    let (plots, key) = root.split_horizontally(1100);
    let (left, right) = plots.split_horizontally(550);
    panel(&left, points, |p| p.speed, x_desc, Some(1.0))?;
    panel(&right, points, |p| p.tau, "τ (tokens per speculative step)", None)?;
    legend(&key, points)?;
    root.present()?;
    Ok(())
}

/// The colour of the `i`-th point, the same in both panels and the legend.
fn colour(i: usize) -> RGBColor {
    let (r, g, b) = Palette99::pick(i).rgb();
    RGBColor(r, g, b)
}

/// The modes' names beside their colours, outside the panels so that no name covers a point.
fn legend<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, points: &[Point]) -> Result<()>
where
    DB::ErrorType: 'static,
{
    for (i, p) in points.iter().enumerate() {
        let y = 40 + 22 * i as i32;
        area.draw(&Circle::new((12, y), 5, colour(i).filled()))?;
        area.draw(&Text::new(p.mode.clone(), (24, y - 7), ("sans-serif", 13).into_font()))?;
    }
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
    for (i, p) in points.iter().enumerate() {
        let px = x(p);
        chart.draw_series([PathElement::new(
            [(px, p.interval.0), (px, p.interval.1)],
            colour(i).mix(0.6).stroke_width(2),
        )])?;
        chart.draw_series([Circle::new((px, p.difference), 5, colour(i).filled())])?;
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
        let err = figure(&[empty], &out, None).unwrap_err().to_string();
        assert!(err.contains("no measured levels"), "{err}");
        let other = write(dir.path(), "other.json", serde_json::json!({"something": 1}));
        let err = format!("{:#}", figure(std::slice::from_ref(&other), &out, None).unwrap_err());
        assert!(err.contains("neither a verdict bench report nor a load report"), "{err}");
        let bench = write(dir.path(), "bench.json", serde_json::json!({"problems": 5, "summary": []}));
        let err = figure(&[bench], &out, None).unwrap_err().to_string();
        assert!(err.contains("no speculative mode paired with plain"), "{err}");
        let err = format!("{:#}", figure(&[empty_bench(dir.path(), "a.json"), other], &out, None).unwrap_err());
        assert!(err.contains("other.json") && err.contains("bench"), "{err}");
        let only_plain = figure(&[empty_bench(dir.path(), "a.json"), empty_bench(dir.path(), "b.json")], &out, None);
        assert!(only_plain.unwrap_err().to_string().contains("no speculative mode"));
    }

    fn empty_bench(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
        write(dir, name, serde_json::json!({"dataset": "mbpp", "summary": [], "runs": []}))
    }

    fn run(problem: usize, mode: &str, correct: bool, seconds: f64, steps_accepted: Option<(u64, u64)>) -> serde_json::Value {
        serde_json::json!({
            "problem": problem, "mode": mode, "correct": correct, "answer": null, "text": mode,
            "completion_tokens": 10, "seconds": seconds,
            "counters": steps_accepted.map(|(steps, accepted)| verdict::metrics::Counters {
                steps, accepted_tokens: accepted, emitted_tokens: steps + accepted, ..Default::default()
            }),
        })
    }

    /// Two tasks' reports pool into one point a mode: accuracy paired within each task, τ over
    /// every step, speed = plain's seconds over the mode's on shared runs (hand-computed).
    #[test]
    fn several_reports_pool_into_one_point_a_mode() {
        let dir = tempfile::tempdir().unwrap();
        let gsm8k = write(dir.path(), "g.json", serde_json::json!({"dataset": "gsm8k", "summary": [], "runs": [
            run(0, "plain", true, 10.0, None), run(0, "fly", false, 4.0, Some((10, 20))),
            run(1, "plain", true, 6.0, None), run(1, "fly", true, 4.0, Some((10, 0))),
        ]}));
        let mbpp = write(dir.path(), "m.json", serde_json::json!({"dataset": "mbpp", "summary": [], "runs": [
            run(0, "plain", false, 2.0, None), run(0, "fly", false, 2.0, Some((20, 20))),
        ]}));
        let by_task = load(&[gsm8k, mbpp]).unwrap();
        let tasks: Vec<(TaskName, &RunsByMode)> = by_task.iter().map(|(t, m)| (*t, m)).collect();
        let points = pooled_points(&tasks);
        assert_eq!(points.len(), 1, "plain is the baseline, not a point");
        let fly = &points[0];
        assert_eq!(fly.mode, "fly (3 problems)");
        assert!((fly.speed - 18.0 / 10.0).abs() < 1e-12, "{}", fly.speed);
        assert!((fly.tau - (1.0 + 40.0 / 40.0)).abs() < 1e-12, "{}", fly.tau);
        assert!((fly.difference + 100.0 / 3.0).abs() < 1e-9, "{}", fly.difference);
    }
}
