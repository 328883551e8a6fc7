//! AutoJudge's Algorithm 1: which draft/target mismatches change the final answer.
//!
//! Start from the target's greedy response y and its answer α (fixed for the whole search).
//! Take the earliest mismatch t (draft's teacher-forced arg-max ≠ y_t), swap in the draft
//! token and let the target continue. Same answer: the token is unimportant and the search
//! continues from the new response (whose later mismatches are recomputed). Different
//! answer: important, and y keeps the target token. Only mismatches after t are tested
//! next. Responses never exceed `max_response_tokens` in total, so continuations cannot grow
//! without bound.

use std::time::Instant;

use anyhow::{ensure, Result};
use verdict::tasks::TaskAdapter;

use crate::labels::{Mismatch, ProblemLabels};

/// The two operations Algorithm 1 needs from the models.
pub trait MiningEngine {
    /// The target's greedy response to `prompt` that starts with `prefix`, stopped at EOS or
    /// at `max_response_tokens` tokens in total (prefix included). Returns the whole response.
    fn continue_response(
        &mut self,
        prompt: &str,
        prefix: &[u32],
        max_response_tokens: usize,
    ) -> Result<Vec<u32>>;
    /// The draft's arg-max at every position of `response`, given the prompt and the
    /// response tokens before it (one teacher-forced pass).
    fn draft_predictions(&mut self, prompt: &str, response: &[u32]) -> Result<Vec<u32>>;
    fn decode(&self, tokens: &[u32]) -> Result<String>;
}

/// Run Algorithm 1 on one problem.
pub fn mine_problem<E: MiningEngine, T: TaskAdapter>(
    engine: &mut E,
    task: &T,
    problem_id: usize,
    prompt: &str,
    max_response_tokens: usize,
) -> Result<ProblemLabels> {
    let start = Instant::now();
    let mut y = engine.continue_response(prompt, &[], max_response_tokens)?;
    let mut generated = y.len();
    let alpha = task.extract_answer(&engine.decode(&y)?);
    let mut predicted = draft_predictions(engine, prompt, &y)?;
    let mut mismatches = Vec::new();
    let mut after = 0;
    while let Some(t) = (after..y.len()).find(|&i| y[i] != predicted[i]) {
        let mut prefix = y[..t].to_vec();
        prefix.push(predicted[t]);
        let swapped = engine.continue_response(prompt, &prefix, max_response_tokens)?;
        generated += swapped.len().saturating_sub(prefix.len());
        let answer = task.extract_answer(&engine.decode(&swapped)?);
        let equivalent = match (&alpha, &answer) {
            (Some(a), Some(b)) => task.answers_equivalent(a, b),
            _ => false,
        };
        mismatches.push(Mismatch {
            position: t,
            target_token: y[t],
            draft_token: predicted[t],
            important: !equivalent,
            prefix: y[..t].to_vec(),
        });
        if equivalent {
            y = swapped;
            predicted = draft_predictions(engine, prompt, &y)?;
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

fn draft_predictions<E: MiningEngine>(engine: &mut E, prompt: &str, y: &[u32]) -> Result<Vec<u32>> {
    let predicted = engine.draft_predictions(prompt, y)?;
    ensure!(
        predicted.len() == y.len(),
        "draft predicted {} positions for a response of {}",
        predicted.len(),
        y.len()
    );
    Ok(predicted)
}
