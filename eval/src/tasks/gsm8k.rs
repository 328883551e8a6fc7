//! GSM8K: grade-school maths word problems with a numeric answer after `####`.

use std::{path::Path, sync::LazyLock};

use anyhow::{bail, Context, Result};
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

/// Load `<dir>/<split>.jsonl`. A missing file says how to get it: the test split is fetched
/// (`verdict fetch-data`); the train split is in no registry package, so its folder is named.
pub fn load(dir: &Path, split: &str) -> Result<Vec<Problem>> {
    let path = dir.join(format!("{split}.jsonl"));
    if !path.is_file() {
        let how = match split {
            "test" => "run `verdict fetch-data` to fetch it, or pass --data-dir / set VERDICT_GSM8K to a folder holding test.jsonl".to_string(),
            _ => format!("GSM8K {split} is in no registry package: pass --data-dir or set VERDICT_GSM8K to a folder holding {split}.jsonl (GSM8K's own release, MIT)"),
        };
        bail!("GSM8K split {} not found: {how}", path.display());
    }
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read GSM8K split {}", path.display()))?;
    crate::jsonl::parse_lines(&text, &path, "GSM8K record")
}

pub struct Gsm8k;

/// The instruction and the worked examples every GSM8K prompt starts with.
const FEW_SHOT_PROMPT: &str = "Solve the math problem. Reason step by step in plain text, one calculation per line, without code. End with the line \"The final answer is <number>.\"

Problem: Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much more money does Betty need to buy the wallet?
Solution:
In the beginning, Betty has only 100 / 2 = $50.
Betty's grandparents gave her 15 * 2 = $30.
This means, Betty needs 100 - 50 - 30 - 15 = $5 more.
The final answer is 5.

Problem: Mark has a garden with flowers. He planted plants of three different colors in it. Ten of them are yellow, and there are 80% more of those in purple. There are only 25% as many green flowers as there are yellow and purple flowers. How many flowers does Mark have in his garden?
Solution:
There are 80/100 * 10 = 8 more purple flowers than yellow flowers.
So in Mark's garden, there are 10 + 8 = 18 purple flowers.
Purple and yellow flowers sum up to 10 + 18 = 28 flowers.
That means in Mark's garden there are 25/100 * 28 = 7 green flowers.
So in total Mark has 28 + 7 = 35 plants in his garden.
The final answer is 35.

Problem: ";

/// Repeated after the problem: far from the instruction at the top, the target ended some
/// test answers with a sentence like "So, John paid $360." and no committed line.
const REMINDER: &str = "(Plain text, no code. Last line: \"The final answer is <number>.\")";

/// "final answer is N" (N possibly in `$…$`, `\(…\)`, bold or `\boxed{…}`), or a bare
/// `\boxed{N}`: the two ways the model commits to an answer.
static FINAL_ANSWER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)(?:final answer is[:\s]*(?:\*\*)?\s*(?:\\\(|\\\[|\$)?\s*(?:\\boxed\{)?|\\boxed\{)\s*(-)?\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)",
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

    /// Two worked examples in GSM8K's own style (train problems 2 and 5, calculator
    /// annotations removed), then the problem. Zero-shot, the Qwen2.5-Coder target wrote
    /// Python and invented its printed output on 3–7 of 16 train problems, or ran past 256
    /// tokens; with these examples it reasoned in plain text and committed an answer on 16 of
    /// 16 (mean 130 tokens, longest 351). See README "GSM8K evaluation".
    fn prompt(&self, problem: &Problem) -> String {
        format!("{FEW_SHOT_PROMPT}{}\n{REMINDER}\nSolution:", problem.question.trim())
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
            .map(|c| format!("{}{}", c.get(1).map_or("", |m| m.as_str()), &c[2]))
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
        // A minus sign before the dollar sign (the target wrote "-$7" on test problem 1169).
        for r in ["The final answer is -$7.", "The final answer is $-7", "The final answer is -7."] {
            assert_eq!(Gsm8k.committed_answer(r).as_deref(), Some("-7"), "{r}");
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
    fn prompt_gives_worked_examples_then_the_problem() {
        let prompt = Gsm8k.prompt(&Problem {
            question: "  How many legs do 3 cats have?\n".into(),
            answer: String::new(),
        });
        assert!(prompt.starts_with("Solve the math problem."));
        assert_eq!(prompt.matches("The final answer is").count(), 4);
        assert!(prompt.ends_with(&format!("Problem: How many legs do 3 cats have?\n{REMINDER}\nSolution:")), "{prompt}");
    }

    #[test]
    fn reference_comes_after_the_marker() {
        assert_eq!(problem("72").reference().as_deref(), Some("72"));
    }
}
