//! `train-head sv-profile`: SV's acceptance table for an EAGLE head that prices its own
//! drafts. Greedy `exact` speculation runs over GSM8K train problems, one at a time, and
//! every verified draft records the head's confidence before drawing it and whether the
//! target kept it (up to each step's first refusal, SV spec A7); the table maps a
//! confidence to the chance of a keep (equal-count bins, thin bins falling back to the
//! overall rate), saved with the models it was fitted for. Every `hold_out_every`-th problem
//! is held out to say whether the table predicts keeps better than the raw confidence.
//!
//! The head is its own companion here, so the paper's indicators degenerate (c = q gives
//! S = 1 and A = 1): the table's S axis holds the head's confidence and A is always 1.
//!
//! Resumable: each finished problem's outcomes are appended to `<out>.outcomes.jsonl`, and
//! a rerun skips the problems found there.

use std::{
    collections::BTreeMap,
    io::Write,
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use verdict::{
    config::{Config, EagleDrafting, ProposerKind},
    engine::{Engine, LoadedModels, Prompt, Scheduling, SpeculativeSetup, generate},
    judge::JudgeStack,
    metrics::Metrics,
    rules::BaseRule,
    sv::{
        policy::DraftOutcome,
        table::{AcceptanceTable, Observation, TableOrigin},
    },
};
use verdict_eval::{
    jsonl::parse_lines,
    tasks::{gsm8k, TaskAdapter},
};

#[derive(Clone, Debug, Serialize)]
pub struct SvProfilePlan {
    pub data_dir: PathBuf,
    pub split: String,
    pub first: usize,
    pub problems: usize,
    /// Every n-th problem is held out of the fit to evaluate it.
    pub hold_out_every: usize,
    /// Confidence bins (equal counts; fewer where confidences repeat).
    pub bins: usize,
    /// A bin with fewer observations falls back to the overall rate.
    pub min_count: u32,
    /// The table's JSON; its report and outcomes go beside it.
    pub out: PathBuf,
}

/// One profiled problem's verified drafts.
#[derive(Serialize, Deserialize)]
struct ProblemOutcomes {
    problem: usize,
    outcomes: Vec<DraftOutcome>,
}

/// How well a β predicts keeps on drafts it was not fitted on.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Calibration {
    /// Mean squared error of β against kept (1) / refused (0).
    pub brier: f64,
    /// Mean negative log-likelihood (β clamped to [1e-4, 1 − 1e-4]).
    pub log_loss: f64,
    /// Mean β over the drafts, against their keep rate (`kept_rate`).
    pub mean_beta: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct CalibrationBin {
    pub confidence_from: f32,
    pub drafts: usize,
    pub mean_confidence: f64,
    pub kept_rate: f64,
    pub table_beta: f32,
}

#[derive(Clone, Debug, Serialize)]
pub struct SvProfileReport {
    pub plan: SvProfilePlan,
    pub origin: TableOrigin,
    pub train_problems: usize,
    pub train_drafts: usize,
    pub held_out_problems: usize,
    pub held_out_drafts: usize,
    /// Keep rate of the held-out drafts.
    pub kept_rate: f64,
    /// The head's confidence used as β directly (what `[sv]` does without a table).
    pub raw_confidence: Calibration,
    pub table: Calibration,
    /// The held-out drafts by the table's bins.
    pub bins: Vec<CalibrationBin>,
}

pub fn outcomes_path(out: &Path) -> PathBuf {
    out.with_extension("outcomes.jsonl")
}

pub fn report_path(out: &Path) -> PathBuf {
    out.with_extension("report.json")
}

/// Profile every problem not yet profiled, fit the table, save it and its report.
pub fn profile_sv(config: &Config, plan: &SvProfilePlan) -> Result<SvProfileReport> {
    ensure!(plan.hold_out_every >= 2, "--hold-out-every must be at least 2, got {}", plan.hold_out_every);
    if config.speculative.proposer != ProposerKind::Eagle {
        bail!("sv-profile profiles an EAGLE head's drafts: the config needs speculative.proposer = \"eagle\"");
    }
    if config.sampling.temperature > 0.0 {
        bail!(
            "sv-profile records greedy keeps: sampling.temperature must be 0, got {}",
            config.sampling.temperature
        );
    }
    let head = config.eagle_head().context("sv-profile needs speculative.eagle_head")?;
    let outcomes_file = outcomes_path(&plan.out);
    let mut done = load_outcomes(&outcomes_file)?;
    let problems = gsm8k::load(&plan.data_dir, &plan.split)?;
    let wanted: Vec<usize> = (plan.first..plan.first + plan.problems)
        .filter(|i| *i < problems.len())
        .collect();
    ensure!(!wanted.is_empty(), "no problems from {} in {} ({} problems)", plan.first, plan.split, problems.len());
    let todo: Vec<usize> = wanted.iter().copied().filter(|i| !done.contains_key(i)).collect();

    let models = LoadedModels::load_with_draft(config, false)?;
    // Every draft verified: the profile records what the target keeps, not SV's choices.
    let drafting = EagleDrafting { sv: false, ..config.eagle_drafting() };
    let origin = TableOrigin {
        target: models.target_fingerprint.describe(),
        draft: head.display().to_string(),
        companion: "the EAGLE head's own confidence".to_string(),
        dataset: format!("gsm8k {} {}..{}", plan.split, plan.first, plan.first + plan.problems),
        gamma: drafting.gamma,
        target_fingerprint: Some(models.target_fingerprint.clone()),
    };
    tracing::info!("profiling {} problems ({} done) → {}", todo.len(), wanted.len() - todo.len(), outcomes_file.display());
    if !todo.is_empty() {
        let proposer = models.eagle_proposer_with(config, &drafting)?;
        proposer.record_outcomes();
        let runtime = tokio::runtime::Runtime::new()?;
        let engine = runtime.block_on(Engine::with_proposer(&models, proposer.clone(), SpeculativeSetup { gamma: drafting.gamma, stack: JudgeStack::lossless(BaseRule::Exact), seed: config.speculative.seed, metrics: Arc::new(Metrics::default()), scheduling: Scheduling::from(1) }))?;
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&outcomes_file)
            .with_context(|| format!("cannot open {}", outcomes_file.display()))?;
        let bar = indicatif::ProgressBar::new(todo.len() as u64);
        bar.set_style(indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} problems, {msg} [{elapsed} < {eta}]")?);
        for problem in todo {
            let prompt = Prompt::Chat(gsm8k::Gsm8k.prompt(&problems[problem]));
            runtime
                .block_on(generate(&engine.mistralrs, &prompt, &config.sampling))
                .with_context(|| format!("problem {problem}"))?;
            let record = ProblemOutcomes { problem, outcomes: proposer.take_outcomes() };
            writeln!(file, "{}", serde_json::to_string(&record)?)?;
            file.flush()?;
            done.insert(problem, record.outcomes);
            let (drafts, kept) = totals(done.values());
            bar.set_message(format!("{drafts} drafts, {:.1} % kept", 100.0 * kept as f64 / drafts.max(1) as f64));
            bar.inc(1);
        }
        bar.finish();
    }

    let (mut train, mut held_out) = (Vec::new(), Vec::new());
    let (mut train_problems, mut held_out_problems) = (0, 0);
    for problem in &wanted {
        let outcomes = &done[problem];
        if problem % plan.hold_out_every == 0 {
            held_out_problems += 1;
            held_out.extend(outcomes.iter().map(observation));
        } else {
            train_problems += 1;
            train.extend(outcomes.iter().map(observation));
        }
    }
    ensure!(!held_out.is_empty(), "the held-out problems verified no draft: profile more problems");
    let table = AcceptanceTable::fit(&train, plan.bins, 1, plan.min_count, origin.clone())?;
    table.save(&plan.out)?;
    let report = SvProfileReport {
        plan: plan.clone(),
        origin,
        train_problems,
        train_drafts: train.len(),
        held_out_problems,
        held_out_drafts: held_out.len(),
        kept_rate: held_out.iter().map(|o| o.alpha as f64).sum::<f64>() / held_out.len() as f64,
        raw_confidence: calibration(&held_out, |o| o.s),
        table: calibration(&held_out, |o| table.beta_by_s(o.s)),
        bins: bins(&table, &held_out),
    };
    std::fs::write(report_path(&plan.out), serde_json::to_string_pretty(&report)?)?;
    tracing::info!(
        "table {} from {} drafts of {} problems; held out ({} drafts of {} problems, {:.1} % kept): Brier {:.4} raw confidence → {:.4} table, log loss {:.4} → {:.4}",
        plan.out.display(),
        train.len(),
        train_problems,
        held_out.len(),
        held_out_problems,
        100.0 * report.kept_rate,
        report.raw_confidence.brier,
        report.table.brier,
        report.raw_confidence.log_loss,
        report.table.log_loss
    );
    Ok(report)
}

fn load_outcomes(path: &Path) -> Result<BTreeMap<usize, Vec<DraftOutcome>>> {
    if !path.is_file() {
        return Ok(BTreeMap::new());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    // A kill mid-write leaves a partial last line: drop it, its problem runs again.
    let whole = match text.rfind('\n') {
        Some(end) => &text[..=end],
        None => "",
    };
    let records: Vec<ProblemOutcomes> = parse_lines(whole, path, "profiled problem")?;
    Ok(records.into_iter().map(|r| (r.problem, r.outcomes)).collect())
}

fn totals<'a>(outcomes: impl Iterator<Item = &'a Vec<DraftOutcome>>) -> (usize, usize) {
    outcomes.flatten().fold((0, 0), |(n, k), o| (n + 1, k + o.kept as usize))
}

/// The head's confidence as S; A is 1 (the head is its own companion).
fn observation(o: &DraftOutcome) -> Observation {
    Observation { s: o.confidence.clamp(0.0, 1.0), a: 1.0, alpha: o.kept as u8 as f32 }
}

fn calibration(held_out: &[Observation], beta: impl Fn(&Observation) -> f32) -> Calibration {
    let n = held_out.len() as f64;
    let (mut brier, mut log_loss, mut mean_beta) = (0.0, 0.0, 0.0);
    for o in held_out {
        let b = beta(o) as f64;
        let kept = o.alpha as f64;
        brier += (b - kept).powi(2);
        let p = b.clamp(1e-4, 1.0 - 1e-4);
        log_loss -= kept * p.ln() + (1.0 - kept) * (1.0 - p).ln();
        mean_beta += b;
    }
    Calibration { brier: brier / n, log_loss: log_loss / n, mean_beta: mean_beta / n }
}

fn bins(table: &AcceptanceTable, held_out: &[Observation]) -> Vec<CalibrationBin> {
    let lower: Vec<f32> = std::iter::once(0.0).chain(table.s_edges.iter().copied()).collect();
    lower
        .iter()
        .map(|&from| {
            let bin = table.bin_of_s(from);
            let members: Vec<&Observation> = held_out.iter().filter(|o| table.bin_of_s(o.s) == bin).collect();
            let n = members.len().max(1) as f64;
            CalibrationBin {
                confidence_from: from,
                drafts: members.len(),
                mean_confidence: members.iter().map(|o| o.s as f64).sum::<f64>() / n,
                kept_rate: members.iter().map(|o| o.alpha as f64).sum::<f64>() / n,
                table_beta: table.beta_by_s(from),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(s: f32, kept: bool) -> Observation {
        Observation { s, a: 1.0, alpha: kept as u8 as f32 }
    }

    #[test]
    fn calibration_on_hand_values() {
        let held_out = [obs(0.9, true), obs(0.5, false)];
        let c = calibration(&held_out, |o| o.s);
        // (0.1² + 0.5²) / 2; −(ln 0.9 + ln 0.5) / 2; (0.9 + 0.5) / 2.
        assert!((c.brier - 0.13).abs() < 1e-6, "{c:?}");
        assert!((c.log_loss - 0.5 * -(0.9f64.ln() + 0.5f64.ln())).abs() < 1e-6, "{c:?}");
        assert!((c.mean_beta - 0.7).abs() < 1e-6, "{c:?}");
    }

    #[test]
    fn a_partial_last_line_is_dropped_and_its_problem_runs_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.outcomes.jsonl");
        let line = |problem: usize| {
            serde_json::to_string(&ProblemOutcomes {
                problem,
                outcomes: vec![DraftOutcome { confidence: 0.5, position: 0, kept: true }],
            })
            .unwrap()
        };
        let full = format!("{}\n{}\n", line(3), line(4));
        std::fs::write(&path, format!("{full}{}", &line(5)[..10])).unwrap();
        let loaded = load_outcomes(&path).unwrap();
        assert_eq!(loaded.keys().copied().collect::<Vec<_>>(), vec![3, 4]);
        assert!(load_outcomes(&dir.path().join("none.jsonl")).unwrap().is_empty());
    }

    #[test]
    fn the_table_calibrates_an_overconfident_head() {
        // Kept half as often as the confidence says: the table learns it, the raw
        // confidence stays off.
        let data: Vec<Observation> = (0..2000)
            .map(|i| {
                let s = 0.2 + 0.6 * (i % 100) as f32 / 100.0;
                obs(s, (i * 7919 % 1000) as f32 / 1000.0 < s / 2.0)
            })
            .collect();
        let (train, held_out) = data.split_at(1500);
        let table = AcceptanceTable::fit(train, 6, 1, 20, TableOrigin::default()).unwrap();
        let raw = calibration(held_out, |o| o.s);
        let fitted = calibration(held_out, |o| table.beta_by_s(o.s));
        assert!(fitted.brier < raw.brier, "{fitted:?} vs {raw:?}");
        assert!((fitted.mean_beta - raw.mean_beta / 2.0).abs() < 0.05, "{fitted:?} vs {raw:?}");
        let report = bins(&table, held_out);
        assert_eq!(report.iter().map(|b| b.drafts).sum::<usize>(), held_out.len());
    }
}
