//! AutoJudge's Algorithm 1: which draft/target mismatches change the final answer.
//!
//! Start from the target's greedy response y and its answer α (fixed for the whole search).
//! Take the earliest mismatch t (draft's teacher-forced arg-max ≠ y_t), swap in the draft
//! token and let the target continue. Same answer: the token is unimportant and the search
//! continues from the new response (whose later mismatches are recomputed). Different
//! answer: important, and y keeps the target token. Only mismatches after t are tested
//! next. Responses never exceed `max_response_tokens` in total, so continuations cannot grow
//! without bound. Only committed answers count ([`TaskAdapter::committed_answer`]): a
//! problem whose target response has none yields no labels, and a swap whose continuation
//! has none is important.

use std::time::Instant;

use anyhow::{ensure, Result};
use verdict_eval::tasks::TaskAdapter;

use crate::labels::{Mismatch, ProblemLabels};

/// The target's best tokens at one position and their probabilities, best first.
pub type TopTokens = Vec<(u32, f32)>;

/// A target continuation and what the draft predicted along it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Continuation {
    /// The whole response: the prefix, then the target's greedy tokens.
    pub response: Vec<u32>,
    /// The draft's arg-max at each position from `prefix.len()` on, given the response
    /// tokens before it (what the draft proposes there when speculating).
    pub predictions: Vec<u32>,
    /// The target's best tokens and their probabilities at each position from
    /// `prefix.len()` on, best first (empty: the engine does not report them).
    pub target_top: Vec<TopTokens>,
}

/// What Algorithm 1 needs from the models.
pub trait MiningEngine {
    /// Called before each problem (engines with caches drop the previous problem's).
    fn start_problem(&mut self) -> Result<()> {
        Ok(())
    }
    /// The target's greedy response to `prompt` that starts with `prefix`, stopped at EOS or
    /// at `max_response_tokens` tokens in total (prefix included).
    fn continue_response(
        &mut self,
        prompt: &str,
        prefix: &[u32],
        max_response_tokens: usize,
    ) -> Result<Continuation>;
    fn decode(&self, tokens: &[u32]) -> Result<String>;
}

/// Run Algorithm 1 on one problem.
///
/// The draft's predictions along a response are assembled from the runs that produced it:
/// before a swapped position they are those of the response it was spliced from (same
/// prefix), at the swap the draft token itself (the draft's arg-max there), after it those
/// of the continuation. That equals one teacher-forced draft pass over the response.
pub fn mine_problem<E: MiningEngine, T: TaskAdapter>(
    engine: &mut E,
    task: &T,
    problem_id: usize,
    prompt: &str,
    max_response_tokens: usize,
) -> Result<ProblemLabels> {
    mine_problem_with(engine, task, problem_id, prompt, max_response_tokens, None)
}

/// [`mine_problem`] with the AutoJudge paper's shortcut for EAGLE mining: a draft token the
/// target gives less than `important_below` (its probability among the target's best tokens,
/// or below the least of them when it is not there) is labelled important without a
/// regeneration. Saves the continuations of drafts the target would almost never write.
pub fn mine_problem_with<E: MiningEngine, T: TaskAdapter>(
    engine: &mut E,
    task: &T,
    problem_id: usize,
    prompt: &str,
    max_response_tokens: usize,
    important_below: Option<f32>,
) -> Result<ProblemLabels> {
    let start = Instant::now();
    engine.start_problem()?;
    let first = continuation(engine, prompt, &[], max_response_tokens)?;
    let mut generated = first.response.len();
    let (mut y, mut predicted, mut top) = (first.response, first.predictions, first.target_top);
    let alpha = task.committed_answer(&engine.decode(&y)?);
    let mut mismatches = Vec::new();
    if alpha.is_none() {
        // Nothing to compare swaps with (typically cut off before the answer): no labels.
        predicted.clear();
    }
    let mut after = 0;
    while let Some(t) = (after..predicted.len()).find(|&i| y[i] != predicted[i]) {
        let unlikely = important_below.zip(top.get(t)).is_some_and(|(below, top)| {
            probability_bound(top, predicted[t]).is_some_and(|p| p < below)
        });
        // The swap's continuation, when it keeps the answer (the response goes on from it).
        let mut kept_swap = None;
        if !unlikely {
            let mut prefix = y[..t].to_vec();
            prefix.push(predicted[t]);
            let swapped = continuation(engine, prompt, &prefix, max_response_tokens)?;
            generated += swapped.response.len() - prefix.len();
            // A swap whose response commits to no answer within the cap counts as important.
            let answer = task.committed_answer(&engine.decode(&swapped.response)?);
            let equivalent = match (&alpha, &answer) {
                (Some(a), Some(b)) => task.answers_equivalent(a, b),
                _ => false,
            };
            kept_swap = equivalent.then_some(swapped);
        }
        mismatches.push(Mismatch {
            position: t,
            target_token: y[t],
            draft_token: predicted[t],
            important: kept_swap.is_none(),
            prefix: y[..t].to_vec(),
            shortcut: unlikely,
        });
        if let Some(swapped) = kept_swap {
            predicted.truncate(t + 1);
            predicted.extend(swapped.predictions);
            top.truncate(t + 1);
            top.extend(swapped.target_top);
            y = swapped.response;
        }
        after = t + 1;
    }
    Ok(ProblemLabels {
        problem_id,
        target_answer: alpha,
        mismatches,
        final_response: y,
        generated_tokens: generated,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The probability the target gives `token` among its best tokens `top`, or the least of
/// theirs when it is not among them (a bound from above); `None` when none are known.
pub fn probability_bound(top: &[(u32, f32)], token: u32) -> Option<f32> {
    match top.iter().find(|(t, _)| *t == token) {
        Some(&(_, p)) => Some(p),
        None => top.iter().map(|&(_, p)| p).reduce(f32::min),
    }
}

/// [`MiningEngine::continue_response`], checked: the response extends the prefix and there
/// is one prediction per new position.
fn continuation<E: MiningEngine>(
    engine: &mut E,
    prompt: &str,
    prefix: &[u32],
    max_response_tokens: usize,
) -> Result<Continuation> {
    let c = engine.continue_response(prompt, prefix, max_response_tokens)?;
    ensure!(
        c.response.starts_with(prefix) && c.response.len() <= max_response_tokens.max(prefix.len()),
        "the engine's response does not extend the prefix within the length cap"
    );
    ensure!(
        c.predictions.len() == c.response.len() - prefix.len(),
        "draft predicted {} positions for {} new tokens",
        c.predictions.len(),
        c.response.len() - prefix.len()
    );
    ensure!(
        c.target_top.is_empty() || c.target_top.len() == c.predictions.len(),
        "the target's best tokens at {} positions for {} new tokens",
        c.target_top.len(),
        c.predictions.len()
    );
    Ok(c)
}
