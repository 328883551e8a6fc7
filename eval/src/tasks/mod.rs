//! Tasks with checkable answers. One prompt format per task is shared by the benchmark and
//! by mining, so what is mined is what is measured.

pub mod code;
pub mod gsm8k;
pub mod math;
pub mod mbpp;

/// A task: how to ask a problem and how to judge a response.
pub trait TaskAdapter {
    type Problem;
    /// The user turn sent to the model.
    fn prompt(&self, problem: &Self::Problem) -> String;
    /// The answer a response commits to, if any.
    fn extract_answer(&self, response: &str) -> Option<String>;
    /// The answer a response explicitly commits to (mining compares only these: a response
    /// cut off before its answer has none). Defaults to [`Self::extract_answer`].
    fn committed_answer(&self, response: &str) -> Option<String> {
        self.extract_answer(response)
    }
    /// The answer mining compares, with the problem at hand: by default the committed one;
    /// a code task answers whether the response's code passes the problem's tests.
    fn problem_answer(&self, _problem: &Self::Problem, response: &str) -> anyhow::Result<Option<String>> {
        Ok(self.committed_answer(response))
    }
    /// Whether a response's answer is the reference one.
    fn is_correct(&self, problem: &Self::Problem, response: &str) -> bool;
    /// Whether two extracted answers are the same answer (mining labels a swapped token
    /// unimportant when the answer stays equivalent).
    fn answers_equivalent(&self, a: &str, b: &str) -> bool {
        a.trim() == b.trim()
    }
}

/// A task's answer reading over prompts given as text (a prompts file's) instead of its own
/// problems: what mining needs, which compares a response's answer with another response's
/// and never with a reference. Such a problem has no reference, so none is correct.
pub struct GivenPrompts<A>(pub A);

impl<A: TaskAdapter> TaskAdapter for GivenPrompts<A> {
    type Problem = String;

    fn prompt(&self, problem: &String) -> String {
        problem.clone()
    }

    fn extract_answer(&self, response: &str) -> Option<String> {
        self.0.extract_answer(response)
    }

    fn committed_answer(&self, response: &str) -> Option<String> {
        self.0.committed_answer(response)
    }

    fn is_correct(&self, _: &String, _: &str) -> bool {
        false
    }

    fn answers_equivalent(&self, a: &str, b: &str) -> bool {
        self.0.answers_equivalent(a, b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_prompts_read_answers_as_their_task_does() {
        let math = GivenPrompts(math::Math);
        assert_eq!(math.prompt(&"Solve x.".to_string()), "Solve x.");
        assert_eq!(math.committed_answer("so \\boxed{\\dfrac{1}{2}}"), Some("\\dfrac{1}{2}".to_string()));
        assert!(math.answers_equivalent("\\dfrac{1}{2}", "\\frac12"), "MATH's normalisation applies");
        let gsm8k = GivenPrompts(gsm8k::Gsm8k);
        assert_eq!(gsm8k.committed_answer("The final answer is 1,200."), gsm8k::Gsm8k.committed_answer("The final answer is 1,200."));
        assert!(!gsm8k.is_correct(&String::new(), "The final answer is 3."), "no reference, nothing correct");
    }
}
