//! AutoJudge's Algorithm 1: which draft/target mismatches change the final answer.
//!
//! Start from the target's greedy response y and its answer α (fixed for the whole search).
//! Take the earliest mismatch t (draft's teacher-forced arg-max ≠ y_t), swap in the draft
//! token and let the target continue. Same answer: the token is unimportant and the search
//! continues from the new response (whose later mismatches are recomputed). Different
//! answer: important, and y keeps the target token. Only mismatches after t are tested
//! next. Responses never exceed `max_response_tokens` in total, so continuations cannot grow
//! without bound. Only committed answers count ([`TaskAdapter::problem_answer`]): a
//! problem whose target response has none yields no labels, and a swap whose continuation
//! has none is important.

use std::time::Instant;

use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};
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
    /// tokens before it (what the draft proposes there when speculating); empty when left
    /// out ([`MiningEngine::continue_responses_unpredicted`]).
    pub predictions: Vec<u32>,
    /// The target's best tokens and their probabilities at each position from
    /// `prefix.len()` on, best first (empty: the engine does not report them).
    pub target_top: Vec<TopTokens>,
}

/// What Algorithm 1 needs from the models.
pub trait MiningEngine {
    /// Called before each problem mined alone, and once before problems mined together
    /// (engines with caches drop what they hold).
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
    /// [`Self::continue_response`] for several `(prompt, prefix)` requests, one per problem
    /// mined together, in their order. Engines that batch decode them together; the default
    /// runs them one after another.
    fn continue_responses(&mut self, requests: &[(&str, &[u32])], max_response_tokens: usize) -> Result<Vec<Continuation>> {
        requests.iter().map(|(prompt, prefix)| self.continue_response(prompt, prefix, max_response_tokens)).collect()
    }
    /// [`Self::continue_responses`], the draft's predictions left out where the engine
    /// computes them apart ([`Self::predictions`]): a search then pays for them only on the
    /// continuations it keeps (the first response and swaps that keep the answer). The
    /// default predicts as it goes.
    fn continue_responses_unpredicted(&mut self, requests: &[(&str, &[u32])], max_response_tokens: usize) -> Result<Vec<Continuation>> {
        self.continue_responses(requests, max_response_tokens)
    }
    /// The draft's predictions at positions `from..` of `response` to `prompt`, for a
    /// continuation [`Self::continue_responses_unpredicted`] returned without them.
    fn predictions(&mut self, _prompt: &str, _response: &[u32], _from: usize) -> Result<Vec<u32>> {
        anyhow::bail!("this engine returns continuations with their draft predictions")
    }
    /// Called when a problem mined together with others is done (engines drop what they
    /// keep for it alone).
    fn finish_problem(&mut self, _prompt: &str) -> Result<()> {
        Ok(())
    }
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
    problem: &T::Problem,
    max_response_tokens: usize,
) -> Result<ProblemLabels> {
    mine_problem_with(engine, task, problem_id, problem, max_response_tokens, None)
}

/// [`mine_problem`] with the AutoJudge paper's shortcut for EAGLE mining: a draft token the
/// target gives less than `important_below` (its probability among the target's best tokens,
/// or below the least of them when it is not there) is labelled important without a
/// regeneration. Saves the continuations of drafts the target would almost never write.
pub fn mine_problem_with<E: MiningEngine, T: TaskAdapter>(
    engine: &mut E,
    task: &T,
    problem_id: usize,
    problem: &T::Problem,
    max_response_tokens: usize,
    important_below: Option<f32>,
) -> Result<ProblemLabels> {
    engine.start_problem()?;
    let prompt = task.prompt(problem);
    let mut search = ProblemSearch::new(problem_id, &prompt, max_response_tokens, important_below);
    while let Some(prefix) = search.wanted_prefix() {
        let found = engine.continue_response(&prompt, &prefix, max_response_tokens)?;
        search.take(found, task, problem, &|tokens| engine.decode(tokens))?;
    }
    Ok(search.finish())
}

/// Algorithm 1 on one problem as a search that asks for one continuation at a time
/// ([`Self::wanted_prefix`]) and is handed it ([`Self::take`]), so that the searches of
/// several problems can have their continuations generated together. It serializes whole
/// (but for its clock), so that a killed run resumes it where it stood
/// ([`crate::searches_in_flight`]).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProblemSearch {
    problem_id: usize,
    prompt: String,
    max_response_tokens: usize,
    important_below: Option<f32>,
    #[serde(skip, default = "Instant::now")]
    started: Instant,
    generated: usize,
    /// The answer of the target's first response (`None`: no labels for this problem).
    alpha: Option<String>,
    /// The response so far (unimportant swaps kept), the draft's prediction and the target's
    /// best tokens at each of its positions.
    y: Vec<u32>,
    predicted: Vec<u32>,
    top: Vec<TopTokens>,
    /// Mismatches before this position are done.
    after: usize,
    mismatches: Vec<Mismatch>,
    next: Wanted,
}

/// The continuation a search waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Wanted {
    /// The target's own response.
    First,
    /// The response with the draft token swapped in at this position.
    Swap(usize),
    Nothing,
}

impl ProblemSearch {
    pub fn new(problem_id: usize, prompt: &str, max_response_tokens: usize, important_below: Option<f32>) -> Self {
        Self {
            problem_id,
            prompt: prompt.to_string(),
            max_response_tokens,
            important_below,
            started: Instant::now(),
            generated: 0,
            alpha: None,
            y: Vec::new(),
            predicted: Vec::new(),
            top: Vec::new(),
            after: 0,
            mismatches: Vec::new(),
            next: Wanted::First,
        }
    }

    pub fn prompt(&self) -> &str {
        &self.prompt
    }

    pub fn problem_id(&self) -> usize {
        self.problem_id
    }

    /// Whether this search was started by a run with this cap and shortcut: only then may
    /// such a run resume it (its labels would otherwise mix two plans).
    pub fn follows(&self, prompt: &str, max_response_tokens: usize, important_below: Option<f32>) -> bool {
        self.prompt == prompt && self.max_response_tokens == max_response_tokens && self.important_below == important_below
    }

    /// Mismatches labelled so far.
    pub fn labelled(&self) -> usize {
        self.mismatches.len()
    }

    /// Whether [`Self::take`] keeps `found`, the continuation of [`Self::wanted_prefix`], so
    /// that it needs the draft's predictions along it: the first response always, a swap's
    /// when its answer is the first response's (predictions may be left out of `found`).
    pub fn keeps<T: TaskAdapter>(&self, found: &Continuation, task: &T, problem: &T::Problem, decode: &dyn Fn(&[u32]) -> Result<String>) -> Result<bool> {
        match self.next {
            Wanted::First => Ok(true),
            Wanted::Swap(_) => self.keeps_the_answer(found, task, problem, decode),
            Wanted::Nothing => anyhow::bail!("a continuation handed to a finished search"),
        }
    }

    /// Whether a swap's continuation commits to the first response's answer (one that
    /// commits to none within the cap does not).
    fn keeps_the_answer<T: TaskAdapter>(&self, found: &Continuation, task: &T, problem: &T::Problem, decode: &dyn Fn(&[u32]) -> Result<String>) -> Result<bool> {
        let answer = task.problem_answer(problem, &decode(&found.response)?)?;
        Ok(match (&self.alpha, &answer) {
            (Some(a), Some(b)) => task.answers_equivalent(a, b),
            _ => false,
        })
    }

    /// The response prefix whose continuation the search needs next; `None` once done.
    pub fn wanted_prefix(&self) -> Option<Vec<u32>> {
        match self.next {
            Wanted::First => Some(Vec::new()),
            Wanted::Swap(t) => {
                let mut prefix = self.y[..t].to_vec();
                prefix.push(self.predicted[t]);
                Some(prefix)
            }
            Wanted::Nothing => None,
        }
    }

    /// Hand over the continuation of [`Self::wanted_prefix`]; the search then runs on to the
    /// next mismatch that needs a regeneration (shortcut labels need none). `problem` is the
    /// one searched: answers are read as [`TaskAdapter::problem_answer`] reads them.
    pub fn take<T: TaskAdapter>(
        &mut self,
        found: Continuation,
        task: &T,
        problem: &T::Problem,
        decode: &dyn Fn(&[u32]) -> Result<String>,
    ) -> Result<()> {
        let keeps = self.keeps(&found, task, problem, decode)?;
        self.take_judged(found, keeps, task, problem, decode)
    }

    /// [`Self::take`] with [`Self::keeps`] already asked of `found`: a swap's answer is read
    /// once (for MBPP that runs the task's tests in the sandbox).
    pub fn take_judged<T: TaskAdapter>(
        &mut self,
        found: Continuation,
        keeps: bool,
        task: &T,
        problem: &T::Problem,
        decode: &dyn Fn(&[u32]) -> Result<String>,
    ) -> Result<()> {
        let prefix = self.wanted_prefix().context("a continuation handed to a finished search")?;
        check_continuation(&found, &prefix, self.max_response_tokens)?;
        self.generated += found.response.len() - prefix.len();
        let predicted = found.predictions.len() == found.response.len() - prefix.len();
        match self.next {
            Wanted::First => {
                ensure!(predicted, "the first response came without the draft's predictions");
                self.alpha = task.problem_answer(problem, &decode(&found.response)?)?;
                (self.y, self.predicted, self.top) = (found.response, found.predictions, found.target_top);
                if self.alpha.is_none() {
                    // Nothing to compare swaps with (typically cut off before the answer).
                    self.predicted.clear();
                }
            }
            Wanted::Swap(t) => {
                let equivalent = keeps;
                self.push_mismatch(t, !equivalent, false);
                if equivalent {
                    ensure!(predicted, "a swap's continuation that keeps the answer came without the draft's predictions");
                    // The response goes on from the swap.
                    self.predicted.truncate(t + 1);
                    self.predicted.extend(found.predictions);
                    self.top.truncate(t + 1);
                    self.top.extend(found.target_top);
                    self.y = found.response;
                }
                self.after = t + 1;
            }
            Wanted::Nothing => unreachable!("checked above"),
        }
        self.next = self.next_regeneration();
        Ok(())
    }

    /// Label the mismatches from `after` on that the shortcut settles, up to the first one
    /// that needs a regeneration.
    fn next_regeneration(&mut self) -> Wanted {
        while let Some(t) = (self.after..self.predicted.len()).find(|&i| self.y[i] != self.predicted[i]) {
            let unlikely = self.important_below.zip(self.top.get(t)).is_some_and(|(below, top)| {
                probability_bound(top, self.predicted[t]).is_some_and(|p| p < below)
            });
            if !unlikely {
                return Wanted::Swap(t);
            }
            self.push_mismatch(t, true, true);
            self.after = t + 1;
        }
        Wanted::Nothing
    }

    fn push_mismatch(&mut self, t: usize, important: bool, shortcut: bool) {
        self.mismatches.push(Mismatch {
            position: t,
            target_token: self.y[t],
            draft_token: self.predicted[t],
            important,
            prefix: self.y[..t].to_vec(),
            shortcut,
            draft_probability: self.top.get(t).and_then(|top| probability_bound(top, self.predicted[t])),
        });
    }

    /// The labels, once [`Self::wanted_prefix`] is `None`.
    pub fn finish(self) -> ProblemLabels {
        debug_assert_eq!(self.next, Wanted::Nothing, "a search finished before it was done");
        ProblemLabels {
            problem_id: self.problem_id,
            target_answer: self.alpha,
            mismatches: self.mismatches,
            final_response: self.y,
            generated_tokens: self.generated,
            seconds: self.started.elapsed().as_secs_f64(),
        }
    }
}

/// The probability the target gives `token` among its best tokens `top`, or the least of
/// theirs when it is not among them (a bound from above); `None` when none are known.
pub fn probability_bound(top: &[(u32, f32)], token: u32) -> Option<f32> {
    match top.iter().find(|(t, _)| *t == token) {
        Some(&(_, p)) => Some(p),
        None => top.iter().map(|&(_, p)| p).reduce(f32::min),
    }
}

/// A continuation checked against what was asked: the response extends the prefix within
/// the cap and there is one prediction per new position, or none (left out).
fn check_continuation(c: &Continuation, prefix: &[u32], max_response_tokens: usize) -> Result<()> {
    ensure!(
        c.response.starts_with(prefix) && c.response.len() <= max_response_tokens.max(prefix.len()),
        "the engine's response does not extend the prefix within the length cap"
    );
    ensure!(
        c.predictions.is_empty() || c.predictions.len() == c.response.len() - prefix.len(),
        "draft predicted {} positions for {} new tokens",
        c.predictions.len(),
        c.response.len() - prefix.len()
    );
    ensure!(
        c.target_top.is_empty() || c.target_top.len() == c.response.len() - prefix.len(),
        "the target's best tokens at {} positions for {} new tokens",
        c.target_top.len(),
        c.response.len() - prefix.len()
    );
    Ok(())
}
