//! `verdict bench --suite N`: N problems of every task, one bench run (and report) per
//! task, and a line per mode pooled over the tasks. Pooled speed is completion tokens over
//! wall clock across all tasks; since one slow task hides behind fast ones there, the
//! slowest task's ratio to plain decoding is given beside it. Accuracy is paired with plain
//! decoding on the same (task, problem, seed) over every task at once, and each speed is
//! also given against the first speculative mode listed (the lossless configuration a
//! judge stack is meant to beat).

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
};

use crate::{
    bench::{tokens_per_second, Run},
    benchmark::TaskName,
    modes::Mode,
    pool::{self, PooledMode, RunsByMode},
};

/// Where a suite run writes `task`'s report: `<out stem>-<task>.<ext>` beside `out`.
pub fn task_report_path(out: &Path, task: TaskName) -> PathBuf {
    let stem = out.file_stem().unwrap_or_default().to_string_lossy();
    let name = match out.extension() {
        Some(ext) => format!("{stem}-{}.{}", task.as_str(), ext.to_string_lossy()),
        None => format!("{stem}-{}", task.as_str()),
    };
    out.with_file_name(name)
}

/// One mode over every task of a suite: `verdict pool-reports`' pooling against plain
/// decoding, with the speeds that only runs of one process can be compared by.
#[derive(Clone, Debug)]
pub struct PooledOverTasks {
    pub pooled: PooledMode,
    pub tokens_per_second: f64,
    pub speed_vs_plain: Option<f64>,
    /// Pooled speed over the first speculative mode's (none for plain or that mode).
    pub speed_vs_reference: Option<(Mode, f64)>,
    /// The first speculative mode's wall clock over this mode's on the runs both made: how
    /// much sooner the answers come (a lossy stack's texts differ in length, so its tokens/s
    /// alone can mislead).
    pub time_vs_reference: Option<f64>,
    /// The task where this mode's speed ratio to plain is lowest, and that ratio.
    pub slowest_task: Option<(TaskName, f64)>,
}

/// `mode`'s runs of one task.
fn runs_in<'a>(by_mode: &'a RunsByMode, mode: &Mode) -> Vec<&'a Run> {
    by_mode.get(mode).map(|runs| runs.values().collect()).unwrap_or_default()
}

/// Each of `modes` pooled over the tasks' runs.
pub fn pool_over_tasks(per_task: &[(TaskName, RunsByMode)], modes: &[Mode]) -> Vec<PooledOverTasks> {
    let plain = Mode::plain();
    let borrowed: Vec<(TaskName, &RunsByMode)> = per_task.iter().map(|(task, by_mode)| (*task, by_mode)).collect();
    let mut pooled = pool::pool_over_tasks(&borrowed, &plain);
    let speed = |mode: &Mode| tokens_per_second(per_task.iter().flat_map(|(_, by_mode)| runs_in(by_mode, mode)));
    let plain_tps = speed(&plain);
    let reference = modes.iter().find(|m| !m.decodes_plainly());
    let reference_tps = reference.map(speed);
    // (reference's seconds, mode's seconds) over the runs both made.
    let paired_seconds = |reference: &Mode, mode: &Mode| {
        per_task.iter().fold((0.0, 0.0), |acc, (_, by_mode)| {
            let (Some(base), Some(own)) = (by_mode.get(reference), by_mode.get(mode)) else { return acc };
            own.iter().filter_map(|(key, run)| base.get(key).map(|b| (b.seconds, run.seconds))).fold(acc, |(a, b), (r, m)| (a + r, b + m))
        })
    };
    let task_ratio = |by_mode: &RunsByMode, mode: &Mode| {
        let base = tokens_per_second(runs_in(by_mode, &plain).into_iter());
        (base > 0.0).then(|| tokens_per_second(runs_in(by_mode, mode).into_iter()) / base)
    };
    modes
        .iter()
        .filter_map(|mode| {
            let at = pooled.iter().position(|p| &p.mode == mode)?;
            let tps = speed(mode);
            let against_plain = !mode.is_plain() && plain_tps > 0.0;
            Some(PooledOverTasks {
                pooled: pooled.swap_remove(at),
                tokens_per_second: tps,
                speed_vs_plain: against_plain.then(|| tps / plain_tps),
                speed_vs_reference: match (reference, reference_tps) {
                    (Some(r), Some(r_tps)) if r != mode && !mode.decodes_plainly() && r_tps > 0.0 => Some((r.clone(), tps / r_tps)),
                    _ => None,
                },
                time_vs_reference: match reference {
                    Some(r) if r != mode && !mode.decodes_plainly() => {
                        let (base, own) = paired_seconds(r, mode);
                        (own > 0.0).then(|| base / own)
                    }
                    _ => None,
                },
                slowest_task: match against_plain {
                    true => per_task
                        .iter()
                        .filter_map(|(task, by_mode)| Some((*task, task_ratio(by_mode, mode)?)))
                        .min_by(|a, b| a.1.total_cmp(&b.1)),
                    false => None,
                },
            })
        })
        .collect()
}

/// The pooled lines as a Markdown table.
pub fn pooled_table(pooled: &[PooledOverTasks]) -> String {
    let mut out = String::new();
    let dash = || "–".to_string();
    let reference = pooled.iter().find_map(|p| p.speed_vs_reference.as_ref().map(|(m, _)| m.name()));
    let _ = writeln!(
        out,
        "| mode (all tasks) | problems | correct | Δ accuracy vs plain [95% CI] | McNemar p | identical text | τ | tokens/s | speed vs plain | speed vs {0} | time vs {0} | slowest task vs plain |",
        reference.as_deref().unwrap_or("the first speculative mode")
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    for p in pooled {
        let (paired, identical) = match &p.pooled.against_baseline {
            Some((identical, stats)) => (Some(stats), Some(*identical)),
            None => (None, None),
        };
        let tau = p.pooled.counters.as_ref().map(|c| c.mean_acceptance_length());
        let _ = writeln!(
            out,
            "| {} | {} | {:.1}% | {} | {} | {} | {} | {:.2} | {} | {} | {} | {} |",
            p.pooled.mode.name(),
            p.pooled.problems,
            100.0 * p.pooled.correct as f64 / p.pooled.problems.max(1) as f64,
            paired
                .map(|s| format!("{:+.1} [{:+.1}, {:+.1}]", 100.0 * s.accuracy_difference, 100.0 * s.difference_ci95.0, 100.0 * s.difference_ci95.1))
                .unwrap_or_else(dash),
            paired.map(|s| format!("{:.3}", s.mcnemar_p)).unwrap_or_else(dash),
            identical.map(|n| format!("{n}/{}", p.pooled.problems)).unwrap_or_else(dash),
            tau.map(|t| format!("{t:.2}")).unwrap_or_else(dash),
            p.tokens_per_second,
            p.speed_vs_plain.map(|r| format!("{r:.2}×")).unwrap_or_else(dash),
            p.speed_vs_reference.as_ref().map(|(_, r)| format!("{r:.2}×")).unwrap_or_else(dash),
            p.time_vs_reference.map(|r| format!("{r:.2}×")).unwrap_or_else(dash),
            p.slowest_task.map(|(t, r)| format!("{r:.2}× ({t})")).unwrap_or_else(dash),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(problem: usize, mode: &str, text: &str, tokens: usize, seconds: f64, correct: bool) -> Run {
        serde_json::from_value(serde_json::json!({
            "problem": problem, "seed": 0, "mode": mode, "correct": correct, "answer": null, "text": text,
            "completion_tokens": tokens, "seconds": seconds, "counters": null, "batch_size": 1,
        }))
        .unwrap()
    }

    #[test]
    fn report_paths_carry_the_task() {
        assert_eq!(task_report_path(Path::new("r/suite.json"), TaskName::Mbpp), Path::new("r/suite-mbpp.json"));
        assert_eq!(task_report_path(Path::new("suite"), TaskName::Math500), Path::new("suite-math500"));
    }

    #[test]
    fn pooled_speed_is_tokens_over_time_and_the_slowest_task_is_named() {
        let per_task = vec![
            // GSM8K: plain 100 tok in 10 s, ngram 100 tok in 5 s (2×), FLy 4 s and wrong.
            (
                TaskName::Gsm8k,
                vec![run(0, "plain", "a", 100, 10.0, true), run(0, "ngram:exact", "a", 100, 5.0, true), run(0, "ngram:fly", "x", 100, 4.0, false)],
            ),
            // MBPP: plain 100 tok in 10 s, ngram 100 tok in 12.5 s (0.8×), text differs; FLy 10 s.
            (
                TaskName::Mbpp,
                vec![run(0, "plain", "b", 100, 10.0, false), run(0, "ngram:exact", "c", 100, 12.5, true), run(0, "ngram:fly", "d", 100, 10.0, true)],
            ),
        ];
        let per_task: Vec<(TaskName, RunsByMode)> = per_task
            .into_iter()
            .map(|(task, runs)| {
                let mut by_mode = RunsByMode::new();
                pool::add_runs(&mut by_mode, runs);
                (task, by_mode)
            })
            .collect();
        // Listed in the order asked for, not pool-reports' (baseline, then by name).
        let modes = [Mode::plain(), "ngram:fly".parse().unwrap(), "ngram:exact".parse().unwrap()];
        let pooled = pool_over_tasks(&per_task, &modes);
        let names: Vec<String> = pooled.iter().map(|p| p.pooled.mode.name()).collect();
        assert_eq!(names, ["plain", "ngram:fly", "ngram:exact"]);
        assert!(pooled[0].speed_vs_plain.is_none() && pooled[0].pooled.against_baseline.is_none() && pooled[0].speed_vs_reference.is_none());
        let ngram = &pooled[2];
        let (identical, paired) = ngram.pooled.against_baseline.as_ref().unwrap();
        assert_eq!((ngram.pooled.problems, ngram.pooled.correct, *identical), (2, 2, 1));
        // 200 tokens in 17.5 s against 200 in 20 s; FLy, listed first, is the reference.
        assert!((ngram.speed_vs_plain.unwrap() - 20.0 / 17.5).abs() < 1e-9);
        let (reference, ratio) = ngram.speed_vs_reference.clone().unwrap();
        assert_eq!(reference.name(), "ngram:fly");
        assert!((ratio - 14.0 / 17.5).abs() < 1e-9);
        let (task, ratio) = ngram.slowest_task.unwrap();
        assert_eq!(task, TaskName::Mbpp);
        assert!((ratio - 0.8).abs() < 1e-9);
        // Paired over both tasks: MBPP turned right, nothing turned wrong.
        assert_eq!((paired.problems, paired.better, paired.worse), (2, 1, 0));
        assert!((paired.accuracy_difference - 0.5).abs() < 1e-12);
        // FLy: one answer lost on GSM8K, one gained on MBPP; 200 tokens in 14 s.
        let fly = &pooled[1];
        let (_, paired) = fly.pooled.against_baseline.as_ref().unwrap();
        assert_eq!((paired.better, paired.worse, paired.accuracy_difference, paired.mcnemar_p), (1, 1, 0.0, 1.0));
        assert_eq!(fly.speed_vs_reference, None);
        let table = pooled_table(&pooled);
        assert!(table.contains("speed vs ngram:fly |"), "{table}");
        assert!(table.contains("| ngram:exact | 2 | 100.0% | +50.0 [") && table.contains("| 1.14× | 0.80× | 0.80× | 0.80× (mbpp) |"), "{table}");
        assert!(table.contains("| ngram:fly | 2 | 50.0% | +0.0 [") && table.contains("| 1.000 | 0/2 |") && table.contains("| 1.43× | – | – |"), "{table}");
    }

    /// A lossy stack that writes longer answers can show more tokens/s than the lossless
    /// reference and still give its answers later: the time ratio says so.
    #[test]
    fn time_against_the_reference_counts_seconds_not_tokens() {
        let runs = vec![
            run(0, "plain", "a", 100, 10.0, true),
            run(0, "ngram:exact", "a", 100, 5.0, true),
            // 300 tokens in 6 s: 50 tok/s against the reference's 20, answers 5/6 as soon.
            run(0, "ngram:fly", "a longer answer", 300, 6.0, true),
            run(1, "plain", "b", 100, 10.0, true),
            run(1, "ngram:exact", "b", 100, 5.0, true),
            run(1, "ngram:fly", "b", 100, 4.0, true),
        ];
        let mut by_mode = RunsByMode::new();
        pool::add_runs(&mut by_mode, runs);
        let modes = [Mode::plain(), "ngram:exact".parse().unwrap(), "ngram:fly".parse().unwrap()];
        let pooled = pool_over_tasks(&[(TaskName::Gsm8k, by_mode)], &modes);
        let fly = &pooled[2];
        // 400 tokens in 10 s against 200 in 10 s.
        assert!((fly.speed_vs_reference.as_ref().unwrap().1 - 2.0).abs() < 1e-9);
        assert!((fly.time_vs_reference.unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(pooled[1].time_vs_reference, None, "the reference against itself");
        assert!(pooled_table(&pooled).contains("| 2.00× | 1.00× |"));
    }
}
