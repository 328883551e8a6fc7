//! `verdict bench --suite N`: N problems of every task, one bench run (and report) per
//! task, and a line per mode pooled over the tasks. Pooled speed is completion tokens over
//! wall clock across all tasks; since one slow task hides behind fast ones there, the
//! slowest task's ratio to plain decoding is given beside it.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::{Path, PathBuf},
};

use verdict::metrics::Counters;

use crate::{
    bench::{tokens_per_second, Run},
    modes::Mode,
    benchmark::TaskName,
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
    pub tau: Option<f64>,
    pub tokens_per_second: f64,
    pub speed_vs_plain: Option<f64>,
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
    let plain_text: BTreeMap<(TaskName, usize, usize), &str> = of(&plain).map(|(t, r)| ((t, r.problem, r.seed), r.text.as_str())).collect();
    let plain_tps = tokens_per_second(of(&plain).map(|(_, r)| r));
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
            let has_plain = !mode.is_plain() && !plain_text.is_empty();
            PooledOverTasks {
                mode: mode.clone(),
                problems: mine.len(),
                correct: mine.iter().filter(|(_, r)| r.correct).count(),
                identical_to_plain: has_plain.then(|| {
                    mine.iter().filter(|(t, r)| plain_text.get(&(*t, r.problem, r.seed)) == Some(&r.text.as_str())).count()
                }),
                tau: counters.as_ref().map(Counters::mean_acceptance_length),
                tokens_per_second: tps,
                speed_vs_plain: (has_plain && plain_tps > 0.0).then(|| tps / plain_tps),
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
    let _ = writeln!(out, "| mode (all tasks) | problems | correct | identical text | τ | tokens/s | speed vs plain | slowest task vs plain |");
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|");
    for p in pooled {
        let _ = writeln!(
            out,
            "| {} | {} | {:.1}% | {} | {} | {:.2} | {} | {} |",
            p.mode.name(),
            p.problems,
            100.0 * p.correct as f64 / p.problems.max(1) as f64,
            p.identical_to_plain.map(|n| format!("{n}/{}", p.problems)).unwrap_or_else(dash),
            p.tau.map(|t| format!("{t:.2}")).unwrap_or_else(dash),
            p.tokens_per_second,
            p.speed_vs_plain.map(|r| format!("{r:.2}×")).unwrap_or_else(dash),
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
            // GSM8K: plain 100 tok in 10 s, ngram 100 tok in 5 s (2×).
            (TaskName::Gsm8k, vec![run(0, "plain", "a", 100, 10.0, true), run(0, "ngram:exact", "a", 100, 5.0, true)]),
            // MBPP: plain 100 tok in 10 s, ngram 100 tok in 12.5 s (0.8×), text differs.
            (TaskName::Mbpp, vec![run(0, "plain", "b", 100, 10.0, false), run(0, "ngram:exact", "c", 100, 12.5, true)]),
        ];
        let modes = [Mode::plain(), "ngram:exact".parse().unwrap()];
        let pooled = pool_over_tasks(&per_task, &modes);
        assert_eq!(pooled[0].speed_vs_plain, None);
        let ngram = &pooled[1];
        assert_eq!((ngram.problems, ngram.correct, ngram.identical_to_plain), (2, 2, Some(1)));
        // 200 tokens in 17.5 s against 200 in 20 s.
        assert!((ngram.speed_vs_plain.unwrap() - 20.0 / 17.5).abs() < 1e-9);
        let (task, ratio) = ngram.slowest_task.unwrap();
        assert_eq!(task, TaskName::Mbpp);
        assert!((ratio - 0.8).abs() < 1e-9);
        let table = pooled_table(&pooled);
        assert!(table.contains("| ngram:exact | 2 | 100.0% | 1/2 |") && table.contains("0.80× (mbpp)"), "{table}");
    }
}
