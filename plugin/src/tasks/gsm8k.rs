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

/// Load `<dir>/<split>.jsonl`.
pub fn load(dir: &Path, split: &str) -> Result<Vec<Problem>> {
    let path = dir.join(format!("{split}.jsonl"));
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read GSM8K split {}", path.display()))?;
    crate::jsonl::parse_lines(&text, &path, "GSM8K record")
}

pub struct Gsm8k;

static FINAL_ANSWER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)final answer is[:\s]*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)").unwrap()
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

    fn prompt(&self, problem: &Problem) -> String {
        format!(
            "Solve the following math problem step by step. End your response with \"The final answer is N\", where N is a number.\n\n{}",
            problem.question.trim()
        )
    }

    /// The number after the last "final answer is"; failing that, the last number.
    fn extract_answer(&self, response: &str) -> Option<String> {
        let tagged = FINAL_ANSWER
            .captures_iter(response)
            .last()
            .map(|c| c[1].to_string());
        tagged.or_else(|| {
            ANY_NUMBER
                .find_iter(response)
                .last()
                .map(|m| m.as_str().to_string())
        })
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
    fn negative_and_decimal_answers() {
        assert!(Gsm8k.is_correct(&problem("-2.5"), "The final answer is -2.50"));
    }

    #[test]
    fn reference_comes_after_the_marker() {
        assert_eq!(problem("72").reference().as_deref(), Some("72"));
    }
}
