//! GSM8K: grade-school maths word problems with a numeric answer after `####`.

use std::{path::Path, sync::LazyLock};

use anyhow::{Context, Result};
use regex::Regex;
use serde::Deserialize;

use super::TaskAdapter;

#[derive(Clone, Debug, Deserialize)]
pub struct Problem {
    pub question: String,
    /// Worked solution ending in `#### <number>`.
    pub answer: String,
}

impl Problem {
    /// The reference number after `####`.
    pub fn reference(&self) -> Option<String> {
        self.answer
            .rsplit("####")
            .next()
            .map(|s| s.trim().to_string())
    }
}

/// Where the splits are unless a command names a folder: `$VERDICT_GSM8K`, else
/// `../shared/data/gsm8k`.
pub fn default_data_dir() -> std::path::PathBuf {
    std::env::var_os("VERDICT_GSM8K")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("../shared/data/gsm8k"))
}

/// Load `<dir>/<split>.jsonl`.
pub fn load(dir: &Path, split: &str) -> Result<Vec<Problem>> {
    let path = dir.join(format!("{split}.jsonl"));
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read GSM8K split {}", path.display()))?;
    crate::jsonl::parse_lines(&text, &path, "GSM8K record")
}

pub struct Gsm8k;

/// "final answer is N" (N possibly in `$…$`, `\(…\)`, bold or `\boxed{…}`), or a bare
/// `\boxed{N}`: the two ways the model commits to an answer.
static FINAL_ANSWER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)(?:final answer is[:\s]*(?:\*\*)?\s*(?:\\\(|\\\[|\$)?\s*(?:\\boxed\{)?|\\boxed\{)\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)",
    )
    .unwrap()
});
static ANY_NUMBER: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"-?[0-9][0-9,]*(?:\.[0-9]+)?").unwrap());

/// `18`, `18.0`, `$18`, `1,800` → a number; anything else → None.
pub fn parse_number(text: &str) -> Option<f64> {
    let cleaned: String = text
        .trim()
        .trim_start_matches('$')
        .trim_end_matches('.')
        .chars()
        .filter(|c| *c != ',')
        .collect();
    cleaned.parse().ok()
}

pub fn numbers_equal(a: &str, b: &str) -> bool {
    match (parse_number(a), parse_number(b)) {
        (Some(x), Some(y)) => (x - y).abs() <= 1e-6 * y.abs().max(1.0),
        _ => false,
    }
}

impl TaskAdapter for Gsm8k {
    type Problem = Problem;

    /// Plain text, no code: asked to "solve step by step", the Qwen2.5-Coder models mostly
    /// write Python and then invent its printed output (0–1 of 3 train problems right,
    /// against 3–4 of 6 with this prompt).
    fn prompt(&self, problem: &Problem) -> String {
        format!(
            "Solve the following math problem step by step in plain text, without writing code. Finish with the sentence \"The final answer is <number>.\"\n\n{}",
            problem.question.trim()
        )
    }

    /// The committed answer; failing that, the last number.
    fn extract_answer(&self, response: &str) -> Option<String> {
        self.committed_answer(response).or_else(|| {
            ANY_NUMBER
                .find_iter(response)
                .last()
                .map(|m| m.as_str().to_string())
        })
    }

    /// The number after the last "final answer is" or in the last `\boxed{}`.
    fn committed_answer(&self, response: &str) -> Option<String> {
        FINAL_ANSWER
            .captures_iter(response)
            .last()
            .map(|c| c[1].to_string())
    }

    fn is_correct(&self, problem: &Problem, response: &str) -> bool {
        match (self.extract_answer(response), problem.reference()) {
            (Some(got), Some(want)) => numbers_equal(&got, &want),
            _ => false,
        }
    }

    fn answers_equivalent(&self, a: &str, b: &str) -> bool {
        numbers_equal(a, b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(answer: &str) -> Problem {
        Problem {
            question: "q".into(),
            answer: format!("work\n#### {answer}"),
        }
    }

    #[test]
    fn equivalent_number_spellings() {
        assert!(numbers_equal("18", "18.0"));
        assert!(numbers_equal("$18", "18"));
        assert!(numbers_equal("1,800", "1800"));
        assert!(numbers_equal("18.", "18"));
        assert!(!numbers_equal("18", "19"));
        assert!(!numbers_equal("eighteen", "18"));
    }

    #[test]
    fn tagged_answer_wins_over_later_numbers() {
        let r = "3 + 4 = 7. The final answer is $1,234. (checked 2 times)";
        assert_eq!(Gsm8k.extract_answer(r).as_deref(), Some("1,234"));
        assert!(Gsm8k.is_correct(&problem("1234"), r));
    }

    #[test]
    fn last_number_is_the_fallback() {
        assert_eq!(
            Gsm8k
                .extract_answer("so she has 5 + 3 = 8 apples")
                .as_deref(),
            Some("8")
        );
    }

    #[test]
    fn missing_answer_is_wrong() {
        assert_eq!(Gsm8k.extract_answer("I cannot tell."), None);
        assert!(!Gsm8k.is_correct(&problem("3"), "I cannot tell."));
    }

    #[test]
    fn boxed_and_latex_answers_are_committed() {
        for r in [
            "The final answer is \\(\\boxed{180}\\).",
            "Therefore, the final answer is $\\boxed{180}$",
            "The final answer is **180**",
            "so the boots cost \\(\\boxed{180}\\) dollars",
        ] {
            assert_eq!(Gsm8k.committed_answer(r).as_deref(), Some("180"), "{r}");
        }
    }

    #[test]
    fn a_cut_off_response_commits_to_nothing() {
        let r = "First, 3 + 4 = 7 eggs. Then 7 * 2 = ";
        assert_eq!(Gsm8k.committed_answer(r), None);
        assert_eq!(Gsm8k.extract_answer(r).as_deref(), Some("2"));
    }

    #[test]
    fn negative_and_decimal_answers() {
        assert!(Gsm8k.is_correct(&problem("-2.5"), "The final answer is -2.50"));
    }

    #[test]
    fn reference_comes_after_the_marker() {
        assert_eq!(problem("72").reference().as_deref(), Some("72"));
    }
}
