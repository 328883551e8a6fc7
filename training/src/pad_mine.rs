//! `train-head mine --method pad`: PAD's pivot labels from Monte-Carlo rollouts.
//!
//! Candidates are the mismatches AutoJudge's mining found (greedy speculative decoding
//! rejects exactly these) on problems whose greedy target answer is right. For each, N
//! target rollouts at T = 0.7 continue the prefix with the target's own token (base) and
//! with the draft token (candidate); a rollout succeeds when its answer is the reference.
//! PIVOT iff the candidate's success rate falls below α × the base rate (the paper's
//! α = 0.8). The paper's LLM-judge sanity check (which can only turn NON-PIVOT into PIVOT)
//! has no counterpart here: no judge model runs on this machine.

use std::{
    collections::BTreeSet,
    fs::{File, OpenOptions},
    io::Write,
    path::Path,
    time::Instant,
};

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};
use serde::{Deserialize, Serialize};
use verdict_eval::tasks::TaskAdapter;

use crate::labels::LabelStore;

/// What PAD's labelling needs from the models.
pub trait RolloutEngine {
    /// Called before each candidate (engines with caches drop the previous one's).
    fn start_candidate(&mut self) -> Result<()> {
        Ok(())
    }
    /// For each prefix, `n` sampled target responses to `prompt` that start with it,
    /// decoded whole (prefix included), each at most `max_response_tokens` tokens in total.
    /// All prefixes are asked at once so an engine can batch their rollouts.
    fn rollouts(
        &mut self,
        prompt: &str,
        prefixes: &[Vec<u32>],
        n: usize,
        temperature: f64,
        max_response_tokens: usize,
    ) -> Result<Vec<Vec<String>>>;
}

#[derive(Clone, Debug)]
pub struct PadPlan {
    pub rollouts: usize,
    pub temperature: f64,
    /// PIVOT iff candidate success rate < alpha × base success rate.
    pub alpha: f64,
    /// Candidates to label in this file (a seeded sample of all mined mismatches).
    pub candidates: usize,
    pub seed: u64,
    pub max_response_tokens: usize,
}

impl Default for PadPlan {
    fn default() -> Self {
        Self {
            rollouts: 4,
            temperature: 0.7,
            alpha: 0.8,
            candidates: 200,
            seed: 42,
            max_response_tokens: 320,
        }
    }
}

/// One labelled candidate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PivotLabel {
    pub problem_id: usize,
    pub position: usize,
    pub target_token: u32,
    pub draft_token: u32,
    pub prefix: Vec<u32>,
    pub rollouts: usize,
    pub base_successes: usize,
    pub candidate_successes: usize,
    pub pivot: bool,
    pub seconds: f64,
}

impl PivotLabel {
    pub fn key(&self) -> (usize, usize) {
        (self.problem_id, self.position)
    }
}

/// Read every label of a PAD label file (a cut-off last line is ignored).
pub fn read_pivot_labels(path: &Path) -> Result<Vec<PivotLabel>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let complete = text.rfind('\n').map_or(0, |i| i + 1);
    verdict_eval::jsonl::parse_lines(&text[..complete], path, "pivot label")
}

/// PIVOT iff Û_cand < α · Û_base.
pub fn is_pivot(base_successes: usize, candidate_successes: usize, alpha: f64) -> bool {
    (candidate_successes as f64) < alpha * base_successes as f64
}

/// Label a seeded sample of the mismatches mined on problems the target solves, appending
/// one line per candidate.
pub fn mine_pivots<E, T>(
    engine: &mut E,
    task: &T,
    problems: &[T::Problem],
    autojudge_labels: &Path,
    plan: &PadPlan,
    out: &Path,
) -> Result<()>
where
    E: RolloutEngine,
    T: TaskAdapter,
{
    // Only problems the target answers right greedily: elsewhere the base rollouts rarely
    // succeed, so no candidate can fall below α × the base rate and the rollouts are wasted.
    let mut candidates: Vec<(usize, crate::labels::Mismatch)> =
        LabelStore::read_all(autojudge_labels)?
            .into_iter()
            .filter(|p| {
                p.target_answer
                    .as_deref()
                    .is_some_and(|answer| task.is_correct(&problems[p.problem_id], answer))
            })
            .flat_map(|p| p.mismatches.into_iter().map(move |m| (p.problem_id, m)))
            .collect();
    candidates.shuffle(&mut StdRng::seed_from_u64(plan.seed));
    candidates.truncate(plan.candidates);
    candidates.sort_by_key(|(id, m)| (*id, m.position));

    let existing = read_pivot_labels(out)?;
    let done: BTreeSet<(usize, usize)> = existing.iter().map(PivotLabel::key).collect();
    // Drop a cut-off last line before appending.
    if let Ok(text) = std::fs::read_to_string(out) {
        let complete = text.rfind('\n').map_or(0, |i| i + 1);
        if complete < text.len() {
            File::options()
                .write(true)
                .open(out)?
                .set_len(complete as u64)?;
        }
    }
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(out)
        .with_context(|| format!("cannot open {}", out.display()))?;
    let todo: Vec<_> = candidates
        .into_iter()
        .filter(|(id, m)| !done.contains(&(*id, m.position)))
        .collect();
    tracing::info!(
        "PAD labels: {} done, {} to go ({} rollouts per side at T = {}, α = {})",
        done.len(),
        todo.len(),
        plan.rollouts,
        plan.temperature,
        plan.alpha
    );
    let bar = ProgressBar::new(todo.len() as u64);
    bar.set_style(ProgressStyle::with_template(
        "{elapsed_precise} [{bar:30}] {pos}/{len} candidates, ETA {eta} {msg}",
    )?);
    let mut pivots = existing.iter().filter(|l| l.pivot).count();
    for (problem_id, m) in todo {
        let start = Instant::now();
        engine.start_candidate()?;
        let problem = &problems[problem_id];
        let prompt = task.prompt(problem);
        let mut base = m.prefix.clone();
        base.push(m.target_token);
        let mut candidate = m.prefix.clone();
        candidate.push(m.draft_token);
        let sides = engine.rollouts(
            &prompt,
            &[base, candidate],
            plan.rollouts,
            plan.temperature,
            plan.max_response_tokens,
        )?;
        let successes =
            |texts: &[String]| texts.iter().filter(|t| task.is_correct(problem, t)).count();
        let (base_successes, candidate_successes) = match sides.as_slice() {
            [base, candidate] => (successes(base), successes(candidate)),
            _ => anyhow::bail!("{} rollout sides for 2 prefixes", sides.len()),
        };
        let label = PivotLabel {
            problem_id,
            position: m.position,
            target_token: m.target_token,
            draft_token: m.draft_token,
            prefix: m.prefix,
            rollouts: plan.rollouts,
            base_successes,
            candidate_successes,
            pivot: is_pivot(base_successes, candidate_successes, plan.alpha),
            seconds: start.elapsed().as_secs_f64(),
        };
        pivots += usize::from(label.pivot);
        let mut line = serde_json::to_string(&label)?;
        line.push('\n');
        file.write_all(line.as_bytes())?;
        file.sync_data()?;
        bar.set_message(format!("| {pivots} pivots"));
        bar.inc(1);
    }
    bar.finish();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pivot_rule_by_hand() {
        // 4 of 4 base successes: a candidate needs at least 3.2, so 3 is a pivot.
        assert!(is_pivot(4, 3, 0.8));
        assert!(!is_pivot(4, 4, 0.8));
        // 2 base successes: 1.6 needed, so 2 is not a pivot and 1 is.
        assert!(!is_pivot(2, 2, 0.8));
        assert!(is_pivot(2, 1, 0.8));
        // A base that never succeeds cannot be undercut.
        assert!(!is_pivot(0, 0, 0.8));
    }
}
