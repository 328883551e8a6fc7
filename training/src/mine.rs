//! `train-head mine`: Algorithm 1 over a range of problems, resumable, with a progress bar.

use std::{
    path::Path,
    time::{Duration, Instant},
};

use anyhow::Result;
use indicatif::{ProgressBar, ProgressStyle};
use verdict_eval::tasks::TaskAdapter;

use crate::{
    labels::{LabelStore, ProblemLabels},
    miner::{mine_problem_with, MiningEngine, ProblemSearch},
    searches_in_flight::{SearchInFlight, SearchesInFlight},
};

/// What one mining run covers.
#[derive(Clone, Debug)]
pub struct MiningPlan {
    /// Indices into the split, in order.
    pub problems: std::ops::Range<usize>,
    pub max_response_tokens: usize,
    /// Label a draft the target gives less than this probability important without a
    /// regeneration ([`crate::miner::mine_problem_with`]); `None`: test every mismatch.
    pub important_below: Option<f32>,
    /// Problems mined together, their continuations decoded as one batch (1: one problem
    /// at a time). Labels are the same either way, up to the numerics of batched decoding.
    pub together: usize,
}

/// Totals over the label file, for the log and the note.
#[derive(Clone, Debug, Default)]
pub struct MiningTotals {
    pub problems: usize,
    pub problems_with_answer: usize,
    pub mismatches: usize,
    pub important: usize,
    pub generated_tokens: usize,
    pub seconds: f64,
    /// Mismatches labelled by a regeneration (not by the shortcut).
    pub tested: usize,
    /// Of those, the ones the shortcut at [`SHORTCUT_AUDIT_BELOW`] would have labelled
    /// important without a regeneration, and how many of them the regeneration found
    /// unimportant (labels the shortcut gets wrong).
    pub shortcut_would_settle: usize,
    pub shortcut_would_mislabel: usize,
}

/// The bound the log audits the AutoJudge shortcut at (`mine --important-below`'s usual
/// value), on labels mined without it: what it would save and what it would get wrong.
pub const SHORTCUT_AUDIT_BELOW: f32 = 0.01;

impl MiningTotals {
    pub fn add(&mut self, labels: &ProblemLabels) {
        for m in labels.mismatches.iter().filter(|m| !m.shortcut) {
            self.tested += 1;
            if m.draft_probability.is_some_and(|p| p < SHORTCUT_AUDIT_BELOW) {
                self.shortcut_would_settle += 1;
                self.shortcut_would_mislabel += usize::from(!m.important);
            }
        }
        self.problems += 1;
        self.problems_with_answer += usize::from(labels.target_answer.is_some());
        self.mismatches += labels.mismatches.len();
        self.important += labels.mismatches.iter().filter(|m| m.important).count();
        self.generated_tokens += labels.generated_tokens;
        self.seconds += labels.seconds;
    }

    pub fn of_file(path: &Path) -> Result<Self> {
        let mut totals = Self::default();
        if path.exists() {
            for labels in LabelStore::read_all(path)? {
                totals.add(&labels);
            }
        }
        Ok(totals)
    }

    /// What the shortcut at [`SHORTCUT_AUDIT_BELOW`] would do to the tested labels.
    pub fn shortcut_audit(&self) -> String {
        format!(
            "the shortcut at {SHORTCUT_AUDIT_BELOW} would label {} of {} tested mismatches important without a regeneration ({:.0}%), {} of them wrongly",
            self.shortcut_would_settle,
            self.tested,
            100.0 * self.shortcut_would_settle as f64 / self.tested.max(1) as f64,
            self.shortcut_would_mislabel
        )
    }

    pub fn summary(&self) -> String {
        let hours = self.seconds / 3600.0;
        format!(
            "{} problems ({} with an answer), {} mismatches ({} important, {:.1}%), {} target tokens in {:.2} h: {:.0} problems/h, {:.0} tokens/h; {}",
            self.problems,
            self.problems_with_answer,
            self.mismatches,
            self.important,
            100.0 * self.important as f64 / self.mismatches.max(1) as f64,
            self.generated_tokens,
            hours,
            self.problems as f64 / hours.max(1e-9),
            self.generated_tokens as f64 / hours.max(1e-9),
            self.shortcut_audit()
        )
    }
}

/// How often batched mining logs that its searches move.
const PROGRESS_EVERY: Duration = Duration::from_secs(300);

/// Mine every problem of `plan` not yet in `labels`, appending each as it finishes.
pub fn mine<E, T>(
    engine: &mut E,
    task: &T,
    problems: &[T::Problem],
    plan: &MiningPlan,
    labels: &Path,
) -> Result<MiningTotals>
where
    E: MiningEngine,
    T: TaskAdapter,
{
    let mut store = LabelStore::open(labels)?;
    let mut totals = MiningTotals::of_file(labels)?;
    let todo: Vec<usize> = plan
        .problems
        .clone()
        .filter(|&id| id < problems.len() && !store.is_done(id))
        .collect();
    tracing::info!(
        "{}: {} problems already mined, {} to go (problems {}..{}, responses capped at {} tokens)",
        labels.display(),
        store.done_count(),
        todo.len(),
        plan.problems.start,
        plan.problems.end.min(problems.len()),
        plan.max_response_tokens
    );
    let bar = ProgressBar::new(todo.len() as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} problems, ETA {eta} {msg}",
        )?
        .progress_chars("=> "),
    );
    let run_start = Instant::now();
    let mut run_tokens = 0usize;
    let in_flight = SearchesInFlight::of_labels(labels);
    let (resumed, elsewhere) = match plan.together {
        0 | 1 => (Vec::new(), Vec::new()),
        _ => sort_searches_in_flight(&in_flight, &store, task, problems, plan, &todo)?,
    };
    let mut record = |mined: ProblemLabels| -> Result<()> {
        store.append(&mined)?;
        totals.add(&mined);
        run_tokens += mined.generated_tokens;
        let important = mined.mismatches.iter().filter(|m| m.important).count();
        bar.suspend(|| {
            tracing::info!(
                "problem {}: answer {}, {} mismatches ({important} important), {} tokens in {:.0}s",
                mined.problem_id,
                mined.target_answer.as_deref().unwrap_or("none (skipped)"),
                mined.mismatches.len(),
                mined.generated_tokens,
                mined.seconds
            )
        });
        bar.set_message(format!(
            "| {} mismatches, {} important | {:.1} target tok/s",
            totals.mismatches,
            totals.important,
            run_tokens as f64 / run_start.elapsed().as_secs_f64()
        ));
        bar.inc(1);
        Ok(())
    };
    if plan.together <= 1 {
        for id in todo {
            record(mine_problem_with(engine, task, id, &problems[id], plan.max_response_tokens, plan.important_below)?)?;
        }
    } else {
        mine_together(engine, task, problems, plan, todo, Resumable { file: &in_flight, resumed, elsewhere }, &mut record)?;
    }
    bar.finish();
    tracing::info!("{}: {}", labels.display(), totals.summary());
    Ok(totals)
}

/// The searches a batched run finds in flight: those it resumes, those of problems outside
/// its range (kept in the file for the run that covers them), and the file they live in.
struct Resumable<'a> {
    file: &'a SearchesInFlight,
    resumed: Vec<SearchInFlight>,
    elsewhere: Vec<SearchInFlight>,
}

/// Sort the file's searches: resume those of problems this run has to do that were started
/// with the same prompt, cap and shortcut; keep those of problems outside its range; drop
/// the rest (finished problems, and other plans' searches, which start over).
fn sort_searches_in_flight<T: TaskAdapter>(
    file: &SearchesInFlight,
    store: &LabelStore,
    task: &T,
    problems: &[T::Problem],
    plan: &MiningPlan,
    todo: &[usize],
) -> Result<(Vec<SearchInFlight>, Vec<SearchInFlight>)> {
    let (mut resumed, mut elsewhere) = (Vec::new(), Vec::new());
    for found in file.load()? {
        let id = found.search.problem_id();
        if store.is_done(id) {
            continue;
        }
        if !todo.contains(&id) {
            elsewhere.push(found);
        } else if found.search.wanted_prefix().is_some() && found.search.follows(&task.prompt(&problems[id]), plan.max_response_tokens, plan.important_below) {
            resumed.push(found);
        } else {
            tracing::warn!(
                "{}: problem {id}'s search was started with another prompt, length cap or shortcut; mining it from its start",
                file.path().display()
            );
        }
    }
    if !resumed.is_empty() {
        tracing::info!(
            "{}: resuming {} searches where a killed run left them (problems {:?}, {} mismatches already labelled)",
            file.path().display(),
            resumed.len(),
            resumed.iter().map(|s| s.search.problem_id()).collect::<Vec<_>>(),
            resumed.iter().map(|s| s.search.labelled()).sum::<usize>()
        );
    }
    Ok((resumed, elsewhere))
}

/// Algorithm 1 over `plan.together` problems at a time: each step generates the continuation
/// every running search waits for as one batch, and the draft's predictions along those the
/// searches keep (an engine that predicts apart is spared the others'); a finished problem
/// is recorded at once and the next one takes its place. A step's wall time is shared
/// equally among its problems, so their `seconds` add up to the run's. After each step the
/// searches still running are written to the file of searches in flight, and a run starts
/// with the searches a killed one left there.
fn mine_together<E, T>(
    engine: &mut E,
    task: &T,
    problems: &[T::Problem],
    plan: &MiningPlan,
    todo: Vec<usize>,
    in_flight: Resumable,
    record: &mut dyn FnMut(ProblemLabels) -> Result<()>,
) -> Result<()>
where
    E: MiningEngine,
    T: TaskAdapter,
{
    engine.start_problem()?;
    let Resumable { file, resumed, elsewhere } = in_flight;
    let resumed_ids: Vec<usize> = resumed.iter().map(|s| s.search.problem_id()).collect();
    let mut waiting: std::collections::VecDeque<SearchInFlight> = resumed.into();
    let mut queue = todo.into_iter().filter(|id| !resumed_ids.contains(id));
    let mut running: Vec<SearchInFlight> = Vec::new();
    // A problem takes one step per regeneration its mismatches need, so the first labels can
    // take many minutes: say, now and then, that the searches move (the bar is not drawn
    // into a log file).
    let mut said = Instant::now();
    let mut steps = 0usize;
    loop {
        while running.len() < plan.together {
            let next = match waiting.pop_front() {
                Some(resumed) => resumed,
                None => {
                    let Some(id) = queue.next() else { break };
                    let search = ProblemSearch::new(id, &task.prompt(&problems[id]), plan.max_response_tokens, plan.important_below);
                    SearchInFlight { search, seconds: 0.0 }
                }
            };
            running.push(next);
        }
        if running.is_empty() {
            return Ok(());
        }
        let step = Instant::now();
        let prefixes: Vec<Vec<u32>> = running
            .iter()
            .map(|s| s.search.wanted_prefix().expect("a running search waits for a continuation"))
            .collect();
        let requests: Vec<(&str, &[u32])> = running.iter().zip(&prefixes).map(|(s, prefix)| (s.search.prompt(), prefix.as_slice())).collect();
        let found = engine.continue_responses_unpredicted(&requests, plan.max_response_tokens)?;
        anyhow::ensure!(found.len() == running.len(), "{} continuations for {} requests", found.len(), running.len());
        for ((SearchInFlight { search, .. }, mut continuation), prefix) in running.iter_mut().zip(found).zip(&prefixes) {
            let problem = &problems[search.problem_id()];
            let left_out = continuation.predictions.len() != continuation.response.len() - prefix.len();
            let keeps = search.keeps(&continuation, task, problem, &|tokens| engine.decode(tokens))?;
            if left_out && keeps {
                continuation.predictions = engine.predictions(search.prompt(), &continuation.response, prefix.len())?;
            }
            search.take_judged(continuation, keeps, task, problem, &|tokens| engine.decode(tokens))?;
        }
        steps += 1;
        if said.elapsed() >= PROGRESS_EVERY {
            said = Instant::now();
            tracing::info!(
                "mining: {steps} batched steps this run; problems in progress {:?}, {} mismatches labelled in them so far",
                running.iter().map(|s| s.search.problem_id()).collect::<Vec<_>>(),
                running.iter().map(|s| s.search.labelled()).sum::<usize>()
            );
        }
        let share = step.elapsed().as_secs_f64() / running.len() as f64;
        let mut still = Vec::with_capacity(running.len());
        for SearchInFlight { search, seconds } in running {
            let seconds = seconds + share;
            match search.wanted_prefix() {
                Some(_) => still.push(SearchInFlight { search, seconds }),
                None => {
                    engine.finish_problem(search.prompt())?;
                    let mut mined = search.finish();
                    mined.seconds = seconds;
                    record(mined)?;
                }
            }
        }
        running = still;
        // Recorded problems first, then the file without them: a kill in between leaves a
        // finished problem's search, which the next run drops.
        file.save(running.iter().chain(&waiting).chain(&elsewhere))?;
    }
}
