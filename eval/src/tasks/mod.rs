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
    /// Whether a response's answer is the reference one.
    fn is_correct(&self, problem: &Self::Problem, response: &str) -> bool;
    /// Whether two extracted answers are the same answer (mining labels a swapped token
    /// unimportant when the answer stays equivalent).
    fn answers_equivalent(&self, a: &str, b: &str) -> bool {
        a.trim() == b.trim()
    }
}
