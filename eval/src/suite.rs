//! `verdict bench --suite N`: N problems of every task, one bench run (and report) per
//! task, and a line per mode pooled over the tasks. Pooled speed is completion tokens over
//! wall clock across all tasks; since one slow task hides behind fast ones there, the
//! slowest task's ratio to plain decoding is given beside it. Accuracy is paired with plain
//! decoding on the same (task, problem, seed) over every task at once, and each speed is
//! also given against the first speculative mode listed (the lossless configuration a
//! judge stack is meant to beat).

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::{Path, PathBuf},
};

use verdict::metrics::Counters;

use crate::{
    bench::{pair, tokens_per_second, Run},
    benchmark::TaskName,
    modes::Mode,
    paired::{paired_stats, PairedStats},
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

/// One mode over every task of a suite.
#[derive(Clone, Debug, PartialEq)]
pub struct PooledOverTasks {
    pub mode: Mode,
    pub problems: usize,
    pub correct: usize,
    /// Runs whose text equals plain decoding's on the same (task, problem, seed).
    pub identical_to_plain: Option<usize>,
    /// Against plain decoding on the same (task, problem, seed), over every task at once.
    pub paired: Option<PairedStats>,
    pub tau: Option<f64>,
    pub tokens_per_second: f64,
    pub speed_vs_plain: Option<f64>,
    /// Pooled speed over the first speculative mode's (none for plain or that mode).
    pub speed_vs_reference: Option<(Mode, f64)>,
    /// The task where this mode's speed ratio to plain is lowest, and that ratio.
    pub slowest_task: Option<(TaskName, f64)>,
}

/// `mode`'s runs over every task.
fn runs_of<'a>(per_task: &'a [(TaskName, Vec<Run>)], mode: &'a Mode) -> impl Iterator<Item = (TaskName, &'a Run)> + 'a {
    per_task.iter().flat_map(move |(task, runs)| runs.iter().filter(move |r| &r.mode == mode).map(move |r| (*task, r)))
}

/// Each of `modes` pooled over the tasks' runs.
pub fn pool_over_tasks(per_task: &[(TaskName, Vec<Run>)], modes: &[Mode]) -> Vec<PooledOverTasks> {
    let plain = Mode::plain();
    let of = |mode| runs_of(per_task, mode);
    let plain_runs: BTreeMap<(TaskName, usize, usize), &Run> = of(&plain).map(|(t, r)| ((t, r.problem, r.seed), r)).collect();
    let plain_tps = tokens_per_second(of(&plain).map(|(_, r)| r));
    let reference = modes.iter().find(|m| !m.decodes_plainly());
    let reference_tps = reference.map(|m| tokens_per_second(of(m).map(|(_, r)| r)));
    let task_ratio = |task: TaskName, mode: &Mode| {
        let runs = &per_task.iter().find(|(t, _)| *t == task)?.1;
        let base = tokens_per_second(runs.iter().filter(|r| r.mode == plain));
        (base > 0.0).then(|| tokens_per_second(runs.iter().filter(|r| &r.mode == mode)) / base)
    };
    modes
        .iter()
        .map(|mode| {
            let mine: Vec<(TaskName, &Run)> = of(mode).collect();
            let counters = Counters::total(mine.iter().filter_map(|(_, r)| r.counters.as_ref()));
            let tps = tokens_per_second(mine.iter().map(|(_, r)| *r));
            let has_plain = !mode.is_plain() && !plain_runs.is_empty();
            let with_plain: Vec<(TaskName, &Run, &Run)> = match has_plain {
                true => mine.iter().filter_map(|(t, r)| Some((*t, *plain_runs.get(&(*t, r.problem, r.seed))?, *r))).collect(),
                false => Vec::new(),
            };
            PooledOverTasks {
                mode: mode.clone(),
                problems: mine.len(),
                correct: mine.iter().filter(|(_, r)| r.correct).count(),
                identical_to_plain: has_plain.then(|| with_plain.iter().filter(|(_, p, r)| p.text == r.text).count()),
                paired: (!with_plain.is_empty()).then(|| {
                    paired_stats(&with_plain.iter().map(|(t, p, r)| pair(t.answers().as_ref(), p, r)).collect::<Vec<_>>())
                }),
                tau: counters.as_ref().map(Counters::mean_acceptance_length),
                tokens_per_second: tps,
                speed_vs_plain: (has_plain && plain_tps > 0.0).then(|| tps / plain_tps),
                speed_vs_reference: match (reference, reference_tps) {
                    (Some(r), Some(r_tps)) if r != mode && !mode.decodes_plainly() && r_tps > 0.0 => Some((r.clone(), tps / r_tps)),
                    _ => None,
                },
                slowest_task: match has_plain {
                    true => per_task
                        .iter()
                        .filter_map(|(task, _)| Some((*task, task_ratio(*task, mode)?)))
                        .min_by(|a, b| a.1.total_cmp(&b.1)),
                    false => None,
                },
            }
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
        "| mode (all tasks) | problems | correct | Δ accuracy vs plain [95% CI] | McNemar p | identical text | τ | tokens/s | speed vs plain | speed vs {} | slowest task vs plain |",
        reference.as_deref().unwrap_or("the first speculative mode")
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|");
    for p in pooled {
        let _ = writeln!(
            out,
            "| {} | {} | {:.1}% | {} | {} | {} | {} | {:.2} | {} | {} | {} |",
            p.mode.name(),
            p.problems,
            100.0 * p.correct as f64 / p.problems.max(1) as f64,
            p.paired
                .as_ref()
                .map(|s| format!("{:+.1} [{:+.1}, {:+.1}]", 100.0 * s.accuracy_difference, 100.0 * s.difference_ci95.0, 100.0 * s.difference_ci95.1))
                .unwrap_or_else(dash),
            p.paired.as_ref().map(|s| format!("{:.3}", s.mcnemar_p)).unwrap_or_else(dash),
            p.identical_to_plain.map(|n| format!("{n}/{}", p.problems)).unwrap_or_else(dash),
            p.tau.map(|t| format!("{t:.2}")).unwrap_or_else(dash),
            p.tokens_per_second,
            p.speed_vs_plain.map(|r| format!("{r:.2}×")).unwrap_or_else(dash),
            p.speed_vs_reference.as_ref().map(|(_, r)| format!("{r:.2}×")).unwrap_or_else(dash),
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
        let modes = [Mode::plain(), "ngram:exact".parse().unwrap(), "ngram:fly".parse().unwrap()];
        let pooled = pool_over_tasks(&per_task, &modes);
        assert_eq!((pooled[0].speed_vs_plain, pooled[0].paired.clone(), pooled[0].speed_vs_reference.clone()), (None, None, None));
        let ngram = &pooled[1];
        assert_eq!((ngram.problems, ngram.correct, ngram.identical_to_plain), (2, 2, Some(1)));
        // 200 tokens in 17.5 s against 200 in 20 s; the first speculative mode is its own reference.
        assert!((ngram.speed_vs_plain.unwrap() - 20.0 / 17.5).abs() < 1e-9);
        assert_eq!(ngram.speed_vs_reference, None);
        let (task, ratio) = ngram.slowest_task.unwrap();
        assert_eq!(task, TaskName::Mbpp);
        assert!((ratio - 0.8).abs() < 1e-9);
        // Paired over both tasks: MBPP turned right, nothing turned wrong.
        let paired = ngram.paired.as_ref().unwrap();
        assert_eq!((paired.problems, paired.better, paired.worse), (2, 1, 0));
        assert!((paired.accuracy_difference - 0.5).abs() < 1e-12);
        // FLy: one answer lost on GSM8K, one gained on MBPP; 200 tokens in 14 s, 17.5 / 14 of ngram's speed.
        let fly = &pooled[2];
        let paired = fly.paired.as_ref().unwrap();
        assert_eq!((paired.better, paired.worse, paired.accuracy_difference, paired.mcnemar_p), (1, 1, 0.0, 1.0));
        let (reference, ratio) = fly.speed_vs_reference.clone().unwrap();
        assert_eq!(reference.name(), "ngram:exact");
        assert!((ratio - 17.5 / 14.0).abs() < 1e-9);
        let table = pooled_table(&pooled);
        assert!(table.contains("speed vs ngram:exact |"), "{table}");
        assert!(table.contains("| ngram:exact | 2 | 100.0% | +50.0 [") && table.contains("0.80× (mbpp)"), "{table}");
        assert!(table.contains("| ngram:fly | 2 | 50.0% | +0.0 [") && table.contains("| 1.000 | 0/2 |") && table.contains("| 1.43× | 1.25× |"), "{table}");
    }
}
