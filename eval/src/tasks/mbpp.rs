//! MBPP (basic programming problems): a one-line task and the asserts that check it. The
//! multi-language sets (`mt_mbpp_<language>`) carry the same tasks written for other
//! languages, without tests; they serve as training prompts only.

use std::sync::Arc;

use serde::Deserialize;

use super::{code::{committed_code, extract_code}, TaskAdapter};
use crate::sandbox::Sandbox;

#[derive(Clone, Debug, Deserialize)]
pub struct Problem {
    pub task_id: u32,
    pub text: String,
    /// The reference solution.
    pub code: String,
    /// Python asserts (MBPP itself; the other languages' sets have none).
    #[serde(default)]
    pub test_list: Vec<String>,
    #[serde(default)]
    pub test_setup_code: String,
}

/// The first MBPP test task ids (11 up to this one, inclusive) are kept for evaluation: no
/// training prompt, in any language, is drawn from them.
pub const LAST_EVALUATION_TASK: u32 = 210;

/// How a language is named in a prompt and in its code fence.
pub fn language_names(language: &str) -> (&str, &str) {
    match language {
        "python" => ("Python", "python"),
        "javascript" => ("JavaScript", "javascript"),
        "typescript" => ("TypeScript", "typescript"),
        "cpp" => ("C++", "cpp"),
        "csharp" => ("C#", "csharp"),
        "c" => ("C", "c"),
        "go" => ("Go", "go"),
        "java" => ("Java", "java"),
        "rust" => ("Rust", "rust"),
        "php" => ("PHP", "php"),
        "ruby" => ("Ruby", "ruby"),
        "scala" => ("Scala", "scala"),
        "haskell" => ("Haskell", "haskell"),
        "bash" => ("Bash", "bash"),
        "matlab" => ("MATLAB", "matlab"),
        "r" => ("R", "r"),
        "swift" => ("Swift", "swift"),
        other => (other, other),
    }
}

/// The user turn: the task, its tests when it has them, and the fence to answer in.
pub fn prompt(problem: &Problem, language: &str) -> String {
    let (name, fence) = language_names(language);
    let mut text = problem.text.trim().to_string();
    if !problem.test_list.is_empty() {
        text.push_str("\nYour code should pass these tests:\n");
        for test in &problem.test_list {
            text.push_str(test.trim());
            text.push('\n');
        }
    } else {
        text.push('\n');
    }
    text.push_str(&format!("Write the {name} code in one ```{fence} block."));
    text
}

/// The program that checks a response: the problem's setup, the response's code, then each
/// of its asserts.
pub fn program(problem: &Problem, response: &str) -> String {
    let code = extract_code(response, None);
    let mut program = format!("{}\n{code}\n\n", problem.test_setup_code);
    for test in &problem.test_list {
        program.push_str(test);
        program.push('\n');
    }
    program
}

/// MBPP in Python as a task whose answer is whether the response's code passes the
/// problem's asserts, run in the sandbox: what mining compares, so that a swapped token is
/// important when it turns a pass into a fail or back.
pub struct MbppTests {
    pub sandbox: Arc<Sandbox>,
}

impl MbppTests {
    /// Whether the response's code passes; an error only when the sandbox cannot run at all.
    fn passes(&self, problem: &Problem, response: &str) -> anyhow::Result<bool> {
        Ok(self.sandbox.run(&program(problem, response))?.passed)
    }
}

impl TaskAdapter for MbppTests {
    type Problem = Problem;

    fn prompt(&self, problem: &Problem) -> String {
        prompt(problem, "python")
    }

    fn extract_answer(&self, response: &str) -> Option<String> {
        committed_code(response)
    }

    /// Code in a closed fence: a response cut off inside its block commits to nothing.
    fn committed_answer(&self, response: &str) -> Option<String> {
        (response.matches("```").count() >= 2).then(|| self.extract_answer(response)).flatten()
    }

    fn problem_answer(&self, problem: &Problem, response: &str) -> anyhow::Result<Option<String>> {
        if self.committed_answer(response).is_none() {
            return Ok(None);
        }
        Ok(Some(if self.passes(problem, response)? { "pass" } else { "fail" }.to_string()))
    }

    fn is_correct(&self, problem: &Problem, response: &str) -> bool {
        self.passes(problem, response).unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prompt_lists_the_tests_and_names_the_fence() {
        let p = Problem { task_id: 11, text: "Write a function to add.".into(), code: String::new(), test_list: vec!["assert add(1, 2) == 3".into()], test_setup_code: String::new() };
        assert_eq!(prompt(&p, "python"), "Write a function to add.\nYour code should pass these tests:\nassert add(1, 2) == 3\nWrite the Python code in one ```python block.");
        let q = Problem { test_list: vec![], ..p };
        assert_eq!(prompt(&q, "cpp"), "Write a function to add.\nWrite the C++ code in one ```cpp block.");
    }

    #[test]
    fn mining_reads_pass_or_fail_on_the_problems_tests() {
        let limits = crate::sandbox::SandboxLimits { wall_seconds: 5.0, cpu_seconds: 3, ..Default::default() };
        let task = MbppTests { sandbox: Arc::new(Sandbox::new(Sandbox::default_python(), limits).unwrap()) };
        let p = Problem {
            task_id: 300,
            text: "Write a function to add.".into(),
            code: String::new(),
            test_list: vec!["assert add(1, 2) == 3".into(), "assert add(0, 0) == 0".into()],
            test_setup_code: String::new(),
        };
        let right = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```";
        let wrong = "Sure:\n```python\ndef add(a, b):\n    return a - b\n```";
        assert_eq!(task.problem_answer(&p, right).unwrap().as_deref(), Some("pass"));
        assert_eq!(task.problem_answer(&p, wrong).unwrap().as_deref(), Some("fail"));
        assert!(task.is_correct(&p, right) && !task.is_correct(&p, wrong));
        // Cut off inside its block: no answer, whatever the code so far would do.
        assert_eq!(task.problem_answer(&p, "```python\ndef add(a, b):\n    return a + b\n").unwrap(), None);
        // Two responses agree when both pass (or both fail), however their code differs.
        let other_right = "```python\ndef add(x, y):\n    return y + x\n```";
        let answers = (task.problem_answer(&p, right).unwrap().unwrap(), task.problem_answer(&p, other_right).unwrap().unwrap());
        assert!(task.answers_equivalent(&answers.0, &answers.1));
    }
}
