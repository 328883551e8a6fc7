//! MBPP (basic programming problems): a one-line task and the asserts that check it. The
//! multi-language sets (`mt_mbpp_<language>`) carry the same tasks written for other
//! languages, without tests; they serve as training prompts only.

use serde::Deserialize;

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
}
