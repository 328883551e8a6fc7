//! Algorithm 1 on a scripted engine whose important tokens are known in advance.
//!
//! World: the target's response to any prompt is `BASE` (then EOS); its answer is the last
//! token. A swapped-in token changes the answer iff it is odd. The draft mismatches at the
//! positions in `MISMATCHES`, and also two positions after any swapped token, so only an
//! implementation that recomputes the draft's predictions on the new response finds those
//! (position 3 here).

use std::cell::Cell;

use anyhow::{bail, Result};
use verdict_eval::tasks::TaskAdapter;
use verdict_training::{
    labels::{LabelStore, Mismatch, ProblemLabels},
    mine::{mine as run_mining, MiningPlan, MiningTotals},
    miner::{mine_problem, mine_problem_with, probability_bound, Continuation, MiningEngine},
    searches_in_flight::SearchesInFlight,
};

const BASE: [u32; 8] = [10, 12, 14, 16, 18, 20, 22, 40];
const MISMATCHES: [usize; 2] = [1, 6];

/// Draft token proposed at a mismatch: odd at position 3 (important), even elsewhere.
fn draft_token(position: usize, target: u32) -> u32 {
    if position == 3 {
        target + 1
    } else {
        target + 100
    }
}

struct Scripted {
    /// Fail (as a killed run would stop) after this many calls.
    fail_after: Option<usize>,
    calls: Cell<usize>,
    /// Report the target's best tokens: its own at 0.95 and a runner-up at this probability
    /// (never a draft token, so a draft's probability is bounded by it).
    runner_up: Option<f32>,
    /// The number of requests of each `continue_responses` call.
    batches: Vec<usize>,
    /// Leave the draft's predictions out of batched continuations, for `predictions` (as
    /// the EAGLE miner does), and count the responses predicted apart.
    predicts_apart: bool,
    predicted_apart: Cell<usize>,
}

impl Scripted {
    fn new(fail_after: Option<usize>) -> Self {
        Self {
            fail_after,
            calls: Cell::new(0),
            runner_up: None,
            batches: Vec::new(),
            predicts_apart: false,
            predicted_apart: Cell::new(0),
        }
    }

    fn predicting_apart(self) -> Self {
        Self { predicts_apart: true, ..self }
    }

    fn reporting_top(self, runner_up: f32) -> Self {
        Self { runner_up: Some(runner_up), ..self }
    }

    fn tick(&self) -> Result<()> {
        self.calls.set(self.calls.get() + 1);
        if self.fail_after.is_some_and(|n| self.calls.get() > n) {
            bail!("killed");
        }
        Ok(())
    }
}

/// The target's response to problem `k` (prompt `p{k}`; `p` is problem 0): `BASE` with
/// 1000·k added to every token (parity kept, so the same positions are important).
fn base(k: u32, i: usize) -> u32 {
    BASE[i] + 1000 * k
}

fn problem_of(prompt: &str) -> u32 {
    prompt[1..].parse().unwrap_or(0)
}

/// The target continues with its problem's `BASE` from wherever the prefix ends; the
/// answer (last token) is shifted by one for every odd (important) token in the prefix.
fn target_response(k: u32, prefix: &[u32], max: usize) -> Vec<u32> {
    let mut out = prefix.to_vec();
    let shift = prefix.iter().filter(|t| *t % 2 == 1).count() as u32;
    while out.len() < BASE.len().min(max) {
        let i = out.len();
        out.push(if i == BASE.len() - 1 {
            base(k, i) + shift
        } else {
            base(k, i)
        });
    }
    out
}

impl Scripted {
    /// The draft's arg-max at position `i` of `response`, given the tokens before it.
    fn draft_at(k: u32, response: &[u32], i: usize) -> u32 {
        let swapped_before = i >= 2 && response[i - 2] != base(k, i - 2);
        let target_next = target_response(k, &response[..i], i + 1)[i];
        if MISMATCHES.contains(&i) || swapped_before {
            draft_token(i, target_next)
        } else {
            target_next
        }
    }
}

impl MiningEngine for Scripted {
    fn continue_response(&mut self, prompt: &str, prefix: &[u32], max: usize) -> Result<Continuation> {
        self.tick()?;
        let k = problem_of(prompt);
        let response = target_response(k, prefix, max);
        let predictions = (prefix.len()..response.len())
            .map(|i| Self::draft_at(k, &response, i))
            .collect();
        let target_top = match self.runner_up {
            Some(p) => (prefix.len()..response.len()).map(|i| vec![(response[i], 0.95), (1, p)]).collect(),
            None => Vec::new(),
        };
        Ok(Continuation {
            response,
            predictions,
            target_top,
        })
    }

    fn continue_responses(&mut self, requests: &[(&str, &[u32])], max: usize) -> Result<Vec<Continuation>> {
        self.batches.push(requests.len());
        requests.iter().map(|(prompt, prefix)| self.continue_response(prompt, prefix, max)).collect()
    }

    fn continue_responses_unpredicted(&mut self, requests: &[(&str, &[u32])], max: usize) -> Result<Vec<Continuation>> {
        let mut found = self.continue_responses(requests, max)?;
        if self.predicts_apart {
            found.iter_mut().for_each(|c| c.predictions.clear());
        }
        Ok(found)
    }

    fn predictions(&mut self, prompt: &str, response: &[u32], from: usize) -> Result<Vec<u32>> {
        self.predicted_apart.set(self.predicted_apart.get() + 1);
        let k = problem_of(prompt);
        Ok((from..response.len()).map(|i| Self::draft_at(k, response, i)).collect())
    }

    fn decode(&self, tokens: &[u32]) -> Result<String> {
        Ok(tokens
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(" "))
    }
}

/// Answer: the last number.
struct LastNumber;

impl TaskAdapter for LastNumber {
    type Problem = ();
    fn prompt(&self, _: &()) -> String {
        "p".into()
    }
    fn extract_answer(&self, response: &str) -> Option<String> {
        response.split_whitespace().last().map(str::to_string)
    }
    fn is_correct(&self, _: &(), _: &str) -> bool {
        false
    }
}

fn mine(engine: &mut Scripted, max: usize) -> Result<ProblemLabels> {
    mine_problem(engine, &LastNumber, 7, &(), max)
}

#[test]
fn labels_follow_algorithm_1() {
    let labels = mine(&mut Scripted::new(None), 100).unwrap();
    let found: Vec<(usize, u32, u32, bool)> = labels
        .mismatches
        .iter()
        .map(|m| (m.position, m.target_token, m.draft_token, m.important))
        .collect();
    assert_eq!(
        found,
        vec![
            // Unimportant: the response continues from the swapped token…
            (1, 12, 112, false),
            // …where the draft now also mismatches at 3, with an odd token: important, and
            // the target token stays.
            (3, 16, 17, true),
            (6, 22, 122, false),
        ]
    );
    assert_eq!(labels.target_answer.as_deref(), Some("40"));
    // Unimportant swaps are kept in the final response, the important one is not.
    assert_eq!(
        labels.final_response,
        vec![10, 112, 14, 16, 18, 20, 122, 40]
    );
    // Each mismatch was tested on the response prefix of that moment.
    assert_eq!(labels.mismatches[2].prefix, vec![10, 112, 14, 16, 18, 20]);
}

#[test]
fn only_mismatches_after_the_last_tested_one_are_tested() {
    let labels = mine(&mut Scripted::new(None), 100).unwrap();
    let positions: Vec<usize> = labels.mismatches.iter().map(|m| m.position).collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "{positions:?}");
}

#[test]
fn the_length_cap_bounds_every_response() {
    let labels = mine(&mut Scripted::new(None), 5).unwrap();
    assert!(labels.final_response.len() <= 5);
    assert!(labels.mismatches.iter().all(|m| m.position < 5));
    // Position 6 is beyond the cap and never tested.
    assert_eq!(labels.mismatches.len(), 2);
}

#[test]
fn a_killed_run_resumes_with_every_finished_problem_and_redoes_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("labels.jsonl");
    let problems = [(), (), ()];
    let plan = MiningPlan {
        problems: 0..3,
        max_response_tokens: 100,
        important_below: None,
        together: 1,
    };
    // Each problem takes 4 engine calls; the engine dies in the middle of problem 1.
    assert!(run_mining(
        &mut Scripted::new(Some(6)),
        &LastNumber,
        &problems,
        &plan,
        &path
    )
    .is_err());
    // A crash in the middle of writing leaves half a line behind.
    std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"{\"problem_id\": 1, \"targ"))
        .unwrap();
    assert_eq!(LabelStore::open(&path).unwrap().done_count(), 1);
    let totals = run_mining(
        &mut Scripted::new(None),
        &LastNumber,
        &problems,
        &plan,
        &path,
    )
    .unwrap();
    assert_eq!(
        (totals.problems, totals.mismatches, totals.important),
        (3, 9, 3)
    );
    let all = LabelStore::read_all(&path).unwrap();
    let ids: Vec<usize> = all.iter().map(|p| p.problem_id).collect();
    assert_eq!(ids, vec![0, 1, 2]);
    let reference = mine(&mut Scripted::new(None), 100).unwrap();
    for p in &all {
        assert_eq!(p.mismatches, reference.mismatches);
    }
}

/// Commits to an answer only when the response ends with "40".
struct CommitsTo40;

impl TaskAdapter for CommitsTo40 {
    type Problem = ();
    fn prompt(&self, _: &()) -> String {
        "p".into()
    }
    fn extract_answer(&self, response: &str) -> Option<String> {
        LastNumber.extract_answer(response)
    }
    fn committed_answer(&self, response: &str) -> Option<String> {
        self.extract_answer(response).filter(|a| a == "40")
    }
    fn is_correct(&self, _: &(), _: &str) -> bool {
        false
    }
}

#[test]
fn a_response_cut_off_before_its_answer_yields_no_labels() {
    // Capped at 7 tokens the target never reaches its answer token (40, the 8th).
    let labels = mine_problem(&mut Scripted::new(None), &CommitsTo40, 7, &(), 7).unwrap();
    assert_eq!(labels.target_answer, None);
    assert!(labels.mismatches.is_empty());
}

#[test]
fn a_swap_whose_continuation_commits_to_nothing_is_important() {
    // Every swap here keeps the length, so the response still ends with an answer token; an
    // odd swap makes it end with 41, which this task does not count as an answer at all.
    let labels = mine_problem(&mut Scripted::new(None), &CommitsTo40, 7, &(), 100).unwrap();
    let important: Vec<bool> = labels.mismatches.iter().map(|m| m.important).collect();
    let reference: Vec<bool> = mine(&mut Scripted::new(None), 100)
        .unwrap()
        .mismatches
        .iter()
        .map(|m| m.important)
        .collect();
    assert_eq!(important, reference);
}

/// The AutoJudge paper's shortcut: a draft the target gives less than the bound is labelled
/// important without a regeneration; with a bound below every reported probability each
/// mismatch is tested, and the labels are plain Algorithm 1's.
#[test]
fn unlikely_drafts_are_important_without_a_regeneration() {
    let mut engine = Scripted::new(None).reporting_top(0.004);
    let labels = mine_problem_with(&mut engine, &LastNumber, 7, &(), 100, Some(0.01)).unwrap();
    assert_eq!(engine.calls.get(), 1, "a mismatch was regenerated");
    assert_eq!(labels.mismatches.iter().map(|m| (m.position, m.important, m.shortcut)).collect::<Vec<_>>(), vec![(1, true, true), (6, true, true)]);

    let mut engine = Scripted::new(None).reporting_top(0.004);
    let tested = mine_problem_with(&mut engine, &LastNumber, 7, &(), 100, Some(0.001)).unwrap();
    let plain = mine_problem(&mut Scripted::new(None), &LastNumber, 7, &(), 100).unwrap();
    assert!(tested.mismatches.iter().all(|m| !m.shortcut) && engine.calls.get() > 1);
    // Every label keeps the draft's probability as read (no draft is among the reported
    // tokens: bounded by the runner-up's 0.004), so the shortcut can be judged offline.
    assert!(tested.mismatches.iter().all(|m| m.draft_probability == Some(0.004)), "{:?}", tested.mismatches);
    assert!(plain.mismatches.iter().all(|m| m.draft_probability.is_none()));
    let without_probability = |labels: &ProblemLabels| labels.mismatches.iter().map(|m| Mismatch { draft_probability: None, ..m.clone() }).collect::<Vec<_>>();
    assert_eq!(without_probability(&tested), without_probability(&plain));
}

#[test]
fn a_drafts_probability_is_read_or_bounded_by_the_least_reported() {
    let top = [(5, 0.6), (9, 0.3), (2, 0.05)];
    assert_eq!(probability_bound(&top, 9), Some(0.3));
    assert_eq!(probability_bound(&top, 7), Some(0.05), "not among them: below the least");
    assert_eq!(probability_bound(&[], 7), None);
}

/// Problem k: prompt `p{k}`, answer the last number.
struct Numbered;

impl TaskAdapter for Numbered {
    type Problem = u32;
    fn prompt(&self, k: &u32) -> String {
        format!("p{k}")
    }
    fn extract_answer(&self, response: &str) -> Option<String> {
        LastNumber.extract_answer(response)
    }
    fn is_correct(&self, _: &u32, _: &str) -> bool {
        false
    }
}

/// `mine --together`: searches of several problems wait for their continuations together.
/// Each problem gets the labels it gets alone (each continuation handed to the search that
/// asked for it), and a run killed in the middle of a batch resumes to the same labels.
#[test]
fn problems_mined_together_get_their_labels_alone_and_resume_after_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let problems: Vec<u32> = (0..5).collect();
    let plan = |together| MiningPlan {
        problems: 0..5,
        max_response_tokens: 100,
        important_below: None,
        together,
    };
    let alone = dir.path().join("alone.jsonl");
    run_mining(&mut Scripted::new(None), &Numbered, &problems, &plan(1), &alone).unwrap();

    let together = dir.path().join("together.jsonl");
    // Four continuations a problem: the first three finish in the fourth step; the engine
    // dies in the fifth, inside the batch of the last two problems' first continuations.
    let mut killed = Scripted::new(Some(13));
    assert!(run_mining(&mut killed, &Numbered, &problems, &plan(3), &together).is_err());
    assert_eq!(killed.batches, [3, 3, 3, 3, 2], "three problems' continuations at once, then the last two");
    assert_eq!(LabelStore::open(&together).unwrap().done_count(), 3);
    let mut resumed = Scripted::new(None);
    run_mining(&mut resumed, &Numbered, &problems, &plan(3), &together).unwrap();
    assert!(resumed.batches.iter().all(|&n| (1..=3).contains(&n)));

    let read = |path| {
        let mut all: Vec<ProblemLabels> = LabelStore::read_all(path).unwrap();
        all.sort_by_key(|p| p.problem_id);
        all.into_iter().map(|p| (p.problem_id, p.target_answer, p.mismatches, p.final_response)).collect::<Vec<_>>()
    };
    let (alone, together) = (read(&alone), read(&together));
    assert_eq!(together.len(), 5);
    assert_eq!(alone, together);
    // Problem k's labels are problem 0's with its tokens shifted by 1000·k.
    let shifted: Vec<(usize, u32, u32, bool)> = together[2].2.iter().map(|m| (m.position, m.target_token, m.draft_token, m.important)).collect();
    assert_eq!(shifted, vec![(1, 2012, 2112, false), (3, 2016, 2017, true), (6, 2022, 2122, false)]);
}

/// A batched run killed between steps loses none of its searches' continuations: the file
/// beside the labels holds the searches in flight, the next run resumes them, and the labels
/// are those mined alone. A run over another range keeps the searches it does not cover; a
/// search started with another length cap starts over.
#[test]
fn a_killed_batched_run_resumes_its_searches_where_they_stood() {
    let dir = tempfile::tempdir().unwrap();
    let problems: Vec<u32> = (0..5).collect();
    let plan = |range: std::ops::Range<usize>, max_response_tokens| MiningPlan { problems: range, max_response_tokens, important_below: None, together: 3 };
    let alone = dir.path().join("alone.jsonl");
    run_mining(&mut Scripted::new(None), &Numbered, &problems, &MiningPlan { together: 1, ..plan(0..5, 100) }, &alone).unwrap();
    let read = |path| {
        let mut all: Vec<ProblemLabels> = LabelStore::read_all(path).unwrap();
        all.sort_by_key(|p| p.problem_id);
        all.into_iter().map(|p| (p.problem_id, p.target_answer, p.mismatches, p.final_response, p.generated_tokens)).collect::<Vec<_>>()
    };
    // Four continuations a problem, 20 in all. The engine dies inside the third step:
    // problems 0–2 have had two continuations each.
    let labels = dir.path().join("together.jsonl");
    let in_flight = SearchesInFlight::of_labels(&labels);
    assert!(run_mining(&mut Scripted::new(Some(8)), &Numbered, &problems, &plan(0..5, 100), &labels).is_err());
    let held: Vec<usize> = in_flight.load().unwrap().iter().map(|s| s.search.problem_id()).collect();
    assert_eq!(held, [0, 1, 2]);

    // A run over problems 3 and 4 mines them whole and leaves the others' searches be.
    let mut other_range = Scripted::new(None);
    run_mining(&mut other_range, &Numbered, &problems, &plan(3..5, 100), &labels).unwrap();
    assert_eq!(other_range.calls.get(), 8);
    assert_eq!(in_flight.load().unwrap().len(), 3);

    // The run over all of them resumes the three searches: two continuations each are left.
    let mut resumed = Scripted::new(None);
    run_mining(&mut resumed, &Numbered, &problems, &plan(0..5, 100), &labels).unwrap();
    assert_eq!(resumed.calls.get(), 6, "a resumed search asks only for the continuations it lacked");
    assert!(!in_flight.path().exists(), "no searches in flight once every problem is done");
    assert_eq!(read(&alone), read(&labels));

    // Searches left by a run with another length cap are mined from their start.
    let capped = dir.path().join("capped.jsonl");
    assert!(run_mining(&mut Scripted::new(Some(8)), &Numbered, &problems, &plan(0..5, 100), &capped).is_err());
    let mut other_cap = Scripted::new(None);
    run_mining(&mut other_cap, &Numbered, &problems, &plan(0..5, 99), &capped).unwrap();
    assert_eq!(other_cap.calls.get(), 20);
    assert_eq!(read(&alone), read(&capped));
}

/// An engine that predicts apart (the EAGLE miner: the head's drafts need a forward of their
/// own) is asked for the draft's predictions only along the continuations a search keeps:
/// each problem's first response and its two swaps that keep the answer, not the swap that
/// changes it. The labels are those of an engine that predicts every continuation.
#[test]
fn predictions_are_asked_only_for_continuations_a_search_keeps() {
    let dir = tempfile::tempdir().unwrap();
    let problems: Vec<u32> = (0..4).collect();
    let plan = MiningPlan { problems: 0..4, max_response_tokens: 100, important_below: None, together: 2 };
    let read = |path| {
        let mut all: Vec<ProblemLabels> = LabelStore::read_all(path).unwrap();
        all.sort_by_key(|p| p.problem_id);
        all.into_iter().map(|p| (p.problem_id, p.target_answer, p.mismatches, p.final_response)).collect::<Vec<_>>()
    };
    let eager = dir.path().join("eager.jsonl");
    run_mining(&mut Scripted::new(None), &Numbered, &problems, &plan, &eager).unwrap();
    let apart = dir.path().join("apart.jsonl");
    let mut engine = Scripted::new(None).predicting_apart();
    run_mining(&mut engine, &Numbered, &problems, &plan, &apart).unwrap();
    assert_eq!(read(&eager), read(&apart));
    assert_eq!(engine.calls.get(), 4 * problems.len(), "a first response and three swaps a problem");
    assert_eq!(engine.predicted_apart.get(), 3 * problems.len(), "predicted along the important swap's continuation, or not along a kept one");
}

/// The log audits the shortcut on labels mined without it: every draft here has probability
/// at most 0.004 (the runner-up's), so at 0.01 the shortcut would label all three tested
/// mismatches important, two of them wrongly (positions 1 and 6 keep the answer). Labels the
/// shortcut made are not audited.
#[test]
fn the_shortcut_is_audited_on_tested_labels() {
    let tested = mine_problem_with(&mut Scripted::new(None).reporting_top(0.004), &LastNumber, 7, &(), 100, None).unwrap();
    let mut totals = MiningTotals::default();
    totals.add(&tested);
    assert_eq!((totals.tested, totals.shortcut_would_settle, totals.shortcut_would_mislabel), (3, 3, 2));
    let likely = mine_problem_with(&mut Scripted::new(None).reporting_top(0.02), &LastNumber, 7, &(), 100, None).unwrap();
    let mut totals = MiningTotals::default();
    totals.add(&likely);
    assert_eq!((totals.tested, totals.shortcut_would_settle), (3, 0), "drafts at 0.02 are above the bound");
    let by_shortcut = mine_problem_with(&mut Scripted::new(None).reporting_top(0.004), &LastNumber, 7, &(), 100, Some(0.01)).unwrap();
    let mut totals = MiningTotals::default();
    totals.add(&by_shortcut);
    assert_eq!((totals.mismatches, totals.tested, totals.shortcut_would_settle), (2, 0, 0));
}
