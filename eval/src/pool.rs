//! Several `verdict bench` reports pooled over the union of their problems, mode by mode
//! (`verdict pool-reports`). A 50-problem run cannot settle a few per cent of τ or a few
//! points of accuracy, and a longer comparison is often split over reports (problems 0–49
//! in one, 50–199 in another, one mode per run).
//!
//! Each (problem, mode) counts once, from the first report of its task that has it. τ is
//! pooled over all steps as the bench computes it for one run; a mode is paired with the
//! baseline on the problems both have. Reports of several tasks give a table per task and
//! one over every task, each problem paired within its own task. Tokens/s are not pooled:
//! reports from different processes saw different machine speeds.

use std::{collections::BTreeMap, path::PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use verdict::metrics::Counters;

use crate::{
    bench::{pair, Run},
    modes::Mode,
    paired::{paired_stats, Pair, PairedStats},
};
use crate::benchmark::TaskName;

/// Every mode's runs by (problem, seed).
pub type RunsByMode = BTreeMap<Mode, BTreeMap<(usize, usize), Run>>;

/// The part of a bench report pooled here.
#[derive(Deserialize)]
struct Report {
    /// The task (reports written before there were others hold GSM8K).
    #[serde(default = "gsm8k")]
    dataset: String,
    runs: Vec<Run>,
}

fn gsm8k() -> String {
    TaskName::Gsm8k.as_str().into()
}

/// Every task's runs in `reports`, within a task the first report holding a (problem, mode)
/// winning (tasks number their problems independently, so they are kept apart).
pub fn load(reports: &[PathBuf]) -> Result<BTreeMap<TaskName, RunsByMode>> {
    let mut by_task: BTreeMap<TaskName, RunsByMode> = BTreeMap::new();
    for path in reports {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let report: Report = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a `verdict bench` report (its --out file)", path.display()))?;
        let task: TaskName = report.dataset.parse().with_context(|| format!("{}", path.display()))?;
        add_runs(by_task.entry(task).or_default(), report.runs);
    }
    if by_task.is_empty() {
        bail!("no reports given");
    }
    Ok(by_task)
}

/// `runs` by mode and (problem, seed), a run already there winning.
pub fn add_runs(by_mode: &mut RunsByMode, runs: impl IntoIterator<Item = Run>) {
    for run in runs {
        by_mode.entry(run.mode.clone()).or_default().entry((run.problem, run.seed)).or_insert(run);
    }
}

/// One mode over the pooled problems.
#[derive(Clone, Debug)]
pub struct PooledMode {
    pub mode: Mode,
    pub problems: usize,
    pub correct: usize,
    /// Step counters summed over the problems (none for plain decoding).
    pub counters: Option<Counters>,
    /// Against the baseline on the problems both ran: texts identical, and the pairing.
    pub against_baseline: Option<(usize, PairedStats)>,
}

/// Each mode pooled over one task's runs, the baseline first.
pub fn pool(task: TaskName, by_mode: &RunsByMode, baseline: &Mode) -> Vec<PooledMode> {
    pool_over_tasks(&[(task, by_mode)], baseline)
}

/// Each mode pooled over every task's runs, the baseline first; a run is paired with the
/// baseline's run of the same task, problem and seed.
pub fn pool_over_tasks(by_task: &[(TaskName, &RunsByMode)], baseline: &Mode) -> Vec<PooledMode> {
    let mut modes: Vec<&Mode> = by_task.iter().flat_map(|(_, by_mode)| by_mode.keys()).collect();
    modes.sort_by_key(|m| (*m != baseline, (*m).clone()));
    modes.dedup();
    let has_baseline = by_task.iter().any(|(_, by_mode)| by_mode.contains_key(baseline));
    modes
        .into_iter()
        .map(|mode| {
            let mut pooled = PooledMode { mode: mode.clone(), problems: 0, correct: 0, counters: None, against_baseline: None };
            let mut counters: Vec<&Counters> = Vec::new();
            let (mut identical, mut pairs) = (0, Vec::<Pair>::new());
            for &(task, by_mode) in by_task {
                let Some(mine) = by_mode.get(mode) else { continue };
                pooled.problems += mine.len();
                pooled.correct += mine.values().filter(|r| r.correct).count();
                counters.extend(mine.values().filter_map(|r| r.counters.as_ref()));
                let Some(base) = by_mode.get(baseline).filter(|_| mode != baseline) else { continue };
                let answers = task.answers();
                for (key, run) in mine.iter().filter(|(key, _)| base.contains_key(key)) {
                    identical += usize::from(run.text == base[key].text);
                    pairs.push(pair(&*answers, &base[key], run));
                }
            }
            pooled.counters = Counters::total(counters);
            pooled.against_baseline = (has_baseline && mode != baseline).then(|| (identical, paired_stats(&pairs)));
            pooled
        })
        .collect()
}

/// τ of mode `a` and of mode `b` on the problems both have, and how many those are.
pub fn tau_ratio(by_mode: &RunsByMode, a: &Mode, b: &Mode) -> Result<(usize, f64, f64)> {
    let (Some(runs_a), Some(runs_b)) = (by_mode.get(a), by_mode.get(b)) else {
        let known: Vec<&str> = by_mode.keys().map(|m| m.0.as_str()).collect();
        bail!("--ratio {}/{}: the modes in these reports are {}", a.0, b.0, known.join(", "));
    };
    let common: Vec<(usize, usize)> = runs_a.keys().filter(|p| runs_b.contains_key(p)).copied().collect();
    let tau = |runs: &BTreeMap<(usize, usize), Run>| {
        Counters::total(common.iter().filter_map(|p| runs[p].counters.as_ref())).map_or(f64::NAN, |c| c.mean_acceptance_length())
    };
    Ok((common.len(), tau(runs_a), tau(runs_b)))
}

/// How soon `mode`'s answers come against `baseline`'s, over every task: the baseline's wall
/// clock over the mode's, each summed over the (task, problem, seed) runs both have. A bench
/// interleaves a task's modes in one process, so each pair of runs saw one machine; a ratio of
/// sums weighs long answers as a user waiting on them does. `None` if no run is shared.
pub fn time_ratio(by_task: &[(TaskName, &RunsByMode)], mode: &Mode, baseline: &Mode) -> Option<f64> {
    let (mut baseline_seconds, mut mode_seconds) = (0.0, 0.0);
    for (_, by_mode) in by_task {
        let (Some(mine), Some(base)) = (by_mode.get(mode), by_mode.get(baseline)) else { continue };
        for (key, run) in mine.iter().filter(|(key, _)| base.contains_key(key)) {
            mode_seconds += run.seconds;
            baseline_seconds += base[key].seconds;
        }
    }
    (mode_seconds > 0.0).then(|| baseline_seconds / mode_seconds)
}

/// The pooled modes as a Markdown table.
pub fn table(pooled: &[PooledMode]) -> String {
    let mut out = String::from(
        "| mode | problems | correct | τ | tokens / step | vs baseline: problems, identical texts, Δ accuracy [95% CI], better / worse, McNemar p |\n|---|---|---|---|---|---|\n",
    );
    for m in pooled {
        let (tau, per_step) = match &m.counters {
            Some(c) if c.steps > 0 => (
                format!("{:.3}", c.mean_acceptance_length()),
                format!("{:.3}", c.emitted_tokens as f64 / c.steps as f64),
            ),
            _ => ("–".into(), "–".into()),
        };
        let paired = m.against_baseline.as_ref().map_or("–".into(), |(identical, s)| {
            format!(
                "{}, {identical}, {:+.1} [{:+.1}, {:+.1}], {} / {}, {:.2}",
                s.problems,
                100.0 * s.accuracy_difference,
                100.0 * s.difference_ci95.0,
                100.0 * s.difference_ci95.1,
                s.better,
                s.worse,
                s.mcnemar_p
            )
        });
        out += &format!("| {} | {} | {} | {tau} | {per_step} | {paired} |\n", m.mode.0, m.problems, m.correct);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(problem: usize, mode: &str, correct: bool, text: &str, steps_accepted: Option<(u64, u64)>) -> Run {
        Run {
            problem,
            seed: 0,
            mode: Mode(mode.into()),
            correct,
            answer: Some(if correct { "1" } else { "2" }.into()),
            text: text.into(),
            completion_tokens: 10,
            seconds: 1.0,
            prompt_seconds: None,
            counters: steps_accepted.map(|(steps, accepted)| Counters {
                steps,
                accepted_tokens: accepted,
                emitted_tokens: steps + accepted,
                ..Counters::default()
            }),
            batch_size: 1,
            combined_choices: None,
        }
    }

    /// A report file of `runs`; without a task it names no dataset, as early reports did.
    fn task_report(dir: &std::path::Path, name: &str, task: Option<TaskName>, runs: Vec<Run>) -> PathBuf {
        let path = dir.join(name);
        let mut report = serde_json::json!({ "summary": [], "runs": runs });
        if let Some(task) = task {
            report["dataset"] = task.as_str().into();
        }
        std::fs::write(&path, report.to_string()).unwrap();
        path
    }

    fn report(dir: &std::path::Path, name: &str, runs: Vec<Run>) -> PathBuf {
        task_report(dir, name, None, runs)
    }

    #[test]
    fn modes_pool_over_the_union_of_problems_each_counted_once() {
        let dir = tempfile::tempdir().unwrap();
        let first = report(
            dir.path(),
            "a.json",
            vec![
                run(0, "plain", true, "x", None),
                run(1, "plain", false, "y", None),
                run(0, "exact", true, "x", Some((10, 10))),
                run(1, "exact", true, "z", Some((10, 5))),
            ],
        );
        // Problem 1 again (the first report wins), and problem 2, only here.
        let second = report(
            dir.path(),
            "b.json",
            vec![run(1, "exact", false, "w", Some((100, 0))), run(2, "exact", false, "v", Some((20, 5)))],
        );
        let by_task = load(&[first, second]).unwrap();
        let (task, by_mode) = by_task.iter().next().unwrap();
        assert_eq!((by_task.len(), *task), (1, TaskName::Gsm8k), "reports without a dataset are GSM8K's");
        let pooled = pool(*task, by_mode, &Mode::plain());
        assert_eq!(pooled[0].mode, Mode::plain(), "the baseline first");
        assert!(pooled[0].against_baseline.is_none() && pooled[0].counters.is_none());
        let exact = &pooled[1];
        assert_eq!((exact.problems, exact.correct), (3, 2));
        // τ over all steps: 1 + (10 + 5 + 5) / (10 + 10 + 20); tokens a step: (20 + 15 + 25) / 40.
        assert!((exact.counters.as_ref().unwrap().mean_acceptance_length() - 1.5).abs() < 1e-12);
        // Against plain on problems 0 and 1: one identical text, one better, none worse.
        let (identical, stats) = exact.against_baseline.as_ref().unwrap();
        assert_eq!((stats.problems, *identical, stats.better, stats.worse), (2, 1, 1, 0));
        let shown = table(&pooled);
        assert!(shown.contains("| exact | 3 | 2 | 1.500 | 1.500 | 2, 1, +50.0 [+0.0, +100.0], 1 / 0, 1.00 |"), "{shown}");
        assert!(shown.contains("| plain | 2 | 1 | – | – | – |"), "{shown}");
    }

    /// Reports of two tasks pool apart (their problem 0s are different problems) and together,
    /// each run paired with the baseline of its own task.
    #[test]
    fn tasks_pool_apart_and_over_all_of_them() {
        let dir = tempfile::tempdir().unwrap();
        let gsm8k = task_report(
            dir.path(),
            "g.json",
            Some(TaskName::Gsm8k),
            vec![run(0, "plain", true, "x", None), run(0, "fly", false, "y", Some((10, 10)))],
        );
        let mbpp = task_report(
            dir.path(),
            "m.json",
            Some(TaskName::Mbpp),
            vec![
                run(0, "plain", false, "p", None),
                run(1, "plain", true, "q", None),
                run(0, "fly", false, "p", Some((10, 0))),
                run(1, "fly", true, "q", Some((20, 10))),
            ],
        );
        let by_task = load(&[gsm8k, mbpp]).unwrap();
        assert_eq!(by_task.keys().copied().collect::<Vec<_>>(), vec![TaskName::Gsm8k, TaskName::Mbpp]);
        assert_eq!(by_task[&TaskName::Gsm8k][&Mode("fly".into())].len(), 1, "MBPP's problem 0 is not GSM8K's");
        let all = pool_over_tasks(&by_task.iter().map(|(t, m)| (*t, m)).collect::<Vec<_>>(), &Mode::plain());
        let fly = &all[1];
        assert_eq!((fly.problems, fly.correct), (3, 1));
        // τ over all 40 steps: 1 + 20 / 40.
        assert!((fly.counters.as_ref().unwrap().mean_acceptance_length() - 1.5).abs() < 1e-12);
        // Paired within each task: GSM8K's answer lost, MBPP's two texts identical.
        let (identical, stats) = fly.against_baseline.as_ref().unwrap();
        assert_eq!((stats.problems, *identical, stats.better, stats.worse), (3, 2, 0, 1));
        assert!((stats.accuracy_difference + 1.0 / 3.0).abs() < 1e-12);
    }

    /// Seconds summed over shared runs, across tasks: (10 + 2) / (5 + 4), not the mean of 2 and
    /// 0.5; a run the baseline lacks and a task without the mode count nowhere.
    #[test]
    fn a_time_ratio_sums_the_shared_runs_of_every_task() {
        let timed = |problem, mode: &str, seconds| Run { seconds, ..run(problem, mode, true, "", None) };
        let runs = |list: Vec<Run>| {
            let mut by_mode = RunsByMode::new();
            add_runs(&mut by_mode, list);
            by_mode
        };
        let gsm8k = runs(vec![timed(0, "plain", 10.0), timed(0, "fly", 5.0), timed(1, "fly", 100.0)]);
        let mbpp = runs(vec![timed(0, "plain", 2.0), timed(0, "fly", 4.0)]);
        let math = runs(vec![timed(0, "plain", 7.0)]);
        let tasks = [(TaskName::Gsm8k, &gsm8k), (TaskName::Mbpp, &mbpp), (TaskName::Math500, &math)];
        let ratio = time_ratio(&tasks, &Mode("fly".into()), &Mode::plain()).unwrap();
        assert!((ratio - 12.0 / 9.0).abs() < 1e-12, "{ratio}");
        assert_eq!(time_ratio(&tasks, &Mode("exact".into()), &Mode::plain()), None);
    }

    #[test]
    fn a_tau_ratio_takes_the_problems_both_modes_have() {
        let by_mode = RunsByMode::from([
            (Mode("a".into()), BTreeMap::from([((0, 0), run(0, "a", true, "", Some((10, 10)))), ((1, 0), run(1, "a", true, "", Some((10, 0))))])),
            (Mode("b".into()), BTreeMap::from([((0, 0), run(0, "b", true, "", Some((10, 5))))])),
        ]);
        let (problems, a, b) = tau_ratio(&by_mode, &Mode("a".into()), &Mode("b".into())).unwrap();
        assert_eq!((problems, a, b), (1, 2.0, 1.5));
        let err = tau_ratio(&by_mode, &Mode("a".into()), &Mode("c".into())).unwrap_err().to_string();
        assert!(err.contains("a/c") && err.contains("a, b"), "{err}");
    }

    #[test]
    fn a_file_that_is_not_a_report_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("load.json");
        std::fs::write(&path, "{\"levels\": []}").unwrap();
        let err = format!("{:#}", load(&[path]).unwrap_err());
        assert!(err.contains("load.json") && err.contains("bench"), "{err}");
    }
}
