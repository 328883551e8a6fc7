//! `verdict plot`: accuracy against τ from a bench report, as an SVG image (the trade-off
//! curve of a lossy judge: each mode is a point, a sweep of one judge a line through its
//! points, plain decoding a horizontal line).

use std::path::Path;

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use serde::Deserialize;

#[derive(Deserialize)]
struct Report {
    problems: usize,
    summary: Vec<Row>,
}

#[derive(Deserialize)]
struct Row {
    mode: String,
    accuracy: f64,
    mean_acceptance_length: Option<f64>,
    speed_vs_plain: Option<f64>,
}

/// Plot every speculative mode of `report` (a `verdict bench` JSON) at (τ, accuracy).
pub fn accuracy_vs_tau(report: &Path, out: &Path, title: &str) -> Result<()> {
    let text = std::fs::read_to_string(report)
        .with_context(|| format!("cannot read bench report {}", report.display()))?;
    let report: Report = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a verdict bench report", report.display()))?;
    let points: Vec<(&Row, f64)> = report
        .summary
        .iter()
        .filter_map(|r| r.mean_acceptance_length.map(|tau| (r, tau)))
        .collect();
    if points.is_empty() {
        bail!("the report has no speculative modes to plot");
    }
    let plain = report.summary.iter().find(|r| r.mode == "plain");
    let (lo, hi) = points
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), (_, t)| {
            (lo.min(*t), hi.max(*t))
        });
    let accuracies = points
        .iter()
        .map(|(r, _)| r.accuracy)
        .chain(plain.map(|p| p.accuracy));
    let (acc_lo, acc_hi) =
        accuracies.fold((f64::MAX, f64::MIN), |(lo, hi), a| (lo.min(a), hi.max(a)));
    let pad = ((hi - lo) * 0.15).max(0.1);
    // Labels sit right of their points: leave room for the rightmost one.
    let right_pad = ((hi - lo) * 0.3).max(0.3);
    let acc_pad = ((acc_hi - acc_lo) * 0.25).max(0.05);

    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let root = SVGBackend::new(out, (760, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{title} ({} problems)", report.problems),
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(
            (lo - pad)..(hi + right_pad),
            ((acc_lo - acc_pad).max(0.0) * 100.0)..((acc_hi + acc_pad).min(1.0) * 100.0),
        )?;
    chart
        .configure_mesh()
        .x_desc("τ (mean tokens per speculative step)")
        .y_desc("accuracy (%)")
        .draw()?;
    if let Some(plain) = plain {
        let y = plain.accuracy * 100.0;
        chart
            .draw_series(LineSeries::new(
                [(lo - pad, y), (hi + right_pad, y)],
                BLACK.mix(0.5).stroke_width(1),
            ))?
            .label("plain target decoding")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLACK.mix(0.5)));
    }
    for family in sweeps(&points) {
        chart.draw_series(LineSeries::new(family, BLUE.mix(0.4).stroke_width(1)))?;
    }
    for (row, tau) in &points {
        let (x, y) = (*tau, row.accuracy * 100.0);
        let label = match row.speed_vs_plain {
            Some(s) => format!("{} ({s:.2}×)", row.mode),
            None => row.mode.clone(),
        };
        chart.draw_series([Circle::new((x, y), 5, BLUE.filled())])?;
        chart.draw_series([Text::new(label, (x, y), ("sans-serif", 13).into_font())])?;
    }
    chart
        .configure_series_labels()
        .border_style(BLACK.mix(0.3))
        .background_style(WHITE)
        .draw()?;
    root.present()
        .with_context(|| format!("cannot write {}", out.display()))?;
    Ok(())
}

/// A sweep of one judge over a parameter (`aj-0.28`, `aj-0.32`, …: a name ending in
/// `-<number>`) as (τ, accuracy %) points in τ order, so the plot draws it as a curve.
fn sweeps(points: &[(&Row, f64)]) -> Vec<Vec<(f64, f64)>> {
    let mut families: std::collections::BTreeMap<&str, Vec<(f64, f64)>> = Default::default();
    for (row, tau) in points {
        if let Some((family, value)) = row.mode.rsplit_once('-') {
            if value.parse::<f64>().is_ok() {
                families
                    .entry(family)
                    .or_default()
                    .push((*tau, row.accuracy * 100.0));
            }
        }
    }
    families
        .into_values()
        .filter(|curve| curve.len() > 1)
        .map(|mut curve| {
            curve.sort_by(|a, b| a.0.total_cmp(&b.0));
            curve
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(mode: &str, accuracy: f64) -> Row {
        Row {
            mode: mode.to_string(),
            accuracy,
            mean_acceptance_length: None,
            speed_vs_plain: None,
        }
    }

    #[test]
    fn sweeps_join_the_modes_of_one_judge_in_tau_order() {
        let rows = [
            row("exact", 0.2),
            row("aj-0.40", 0.125),
            row("fsd-js-0.1", 0.375),
            row("aj-0.28", 0.25),
            row("fsd-js-0.2", 0.5),
            row("dropmatch", 0.5),
            row("pad-0.5", 0.5),
        ];
        let taus = [6.0, 8.0, 5.0, 6.3, 5.5, 6.1, 6.2];
        let points: Vec<(&Row, f64)> = rows.iter().zip(taus).collect();
        assert_eq!(
            sweeps(&points),
            vec![
                vec![(6.3, 25.0), (8.0, 12.5)],
                vec![(5.0, 37.5), (5.5, 50.0)],
            ]
        );
    }
}
