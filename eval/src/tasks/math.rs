//! MATH (competition mathematics): the answer is the last `\boxed{…}` of a response,
//! compared with the reference after normalising how LaTeX writes the same value
//! (Hendrycks et al.'s equivalence: spacing, `\left`/`\right`, `\dfrac`, units, degrees,
//! `x =` prefixes, `\frac12`, trailing zeros).

use serde::Deserialize;

use super::TaskAdapter;

#[derive(Clone, Debug, Deserialize)]
pub struct Problem {
    pub problem: String,
    /// The worked solution, ending in a `\boxed{}` answer.
    #[serde(default)]
    pub solution: String,
    /// The reference answer.
    pub answer: String,
}

pub struct Math;

const INSTRUCTION: &str = "Solve the math problem. Reason step by step, then give the final answer in \\boxed{}.";

impl TaskAdapter for Math {
    type Problem = Problem;

    fn prompt(&self, problem: &Problem) -> String {
        format!("{INSTRUCTION}\n\nProblem: {}", problem.problem.trim())
    }

    fn extract_answer(&self, response: &str) -> Option<String> {
        last_boxed(response)
    }

    fn is_correct(&self, problem: &Problem, response: &str) -> bool {
        self.extract_answer(response)
            .is_some_and(|a| self.answers_equivalent(&a, &problem.answer))
    }

    fn answers_equivalent(&self, a: &str, b: &str) -> bool {
        normalise(a) == normalise(b)
    }
}

/// The content of the last `\boxed{…}` (or `\fbox{…}`), braces balanced.
pub fn last_boxed(text: &str) -> Option<String> {
    let start = ["\\boxed", "\\fbox"].iter().filter_map(|m| text.rfind(m).map(|i| i + m.len())).max()?;
    let rest = text[start..].trim_start();
    // `\boxed 5`: one token without braces.
    if !rest.starts_with('{') {
        let token: String = rest.chars().take_while(|c| !c.is_whitespace() && *c != '$').collect();
        return (!token.is_empty()).then_some(token);
    }
    matching_brace(rest).map(|close| rest[1..close].to_string())
}

/// A canonical spelling of an answer: two answers are equivalent when these are equal.
pub fn normalise(answer: &str) -> String {
    let mut s = answer.trim().to_string();
    s = s.replace("\n", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "");
    for (from, to) in [("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""), ("$", ""), ("\\%", ""), ("%", "")] {
        s = s.replace(from, to);
    }
    s = strip_text_units(&s);
    // `x = 5`, `k=5`: the value alone (not inequalities or equations with more sides).
    if let Some((lhs, rhs)) = s.split_once('=') {
        if lhs.trim().chars().count() <= 2 && !rhs.contains('=') {
            s = rhs.to_string();
        }
    }
    s.retain(|c| !c.is_whitespace());
    s = fix_fracs(&s);
    // `a/b` with plain integers is `\frac{a}{b}`.
    if let Some((a, b)) = s.split_once('/') {
        if is_integer(a) && is_integer(b) {
            s = format!("\\frac{{{a}}}{{{b}}}");
        }
    }
    // `.5` is `0.5`, which is `\frac{1}{2}`; `5.` and `5.0` are `5`.
    if s.starts_with('.') {
        s.insert(0, '0');
    }
    if s == "0.5" {
        s = "\\frac{1}{2}".into();
    }
    if let Some((int, frac)) = s.split_once('.') {
        if is_integer(int) && !frac.is_empty() && frac.chars().all(|c| c == '0') || is_integer(int) && frac.is_empty() {
            s = int.to_string();
        }
    }
    // `1,000` is `1000` (a thousands separator, not a tuple of two numbers).
    if s.split(',').skip(1).all(|g| g.len() == 3 && g.chars().all(|c| c.is_ascii_digit())) && s.contains(',') && is_integer(s.split(',').next().unwrap()) {
        s = s.replace(',', "");
    }
    s
}

fn is_integer(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit())
}

/// `5\text{ cm}` → `5`; `\text{(A)}` → `(A)`: text kept only when it is the whole answer.
fn strip_text_units(s: &str) -> String {
    let mut out = s.to_string();
    for marker in ["\\text{", "\\textbf{", "\\mbox{", "\\mathrm{"] {
        while let Some(i) = out.find(marker) {
            let open = i + marker.len();
            let Some(close) = out[open..].find('}').map(|j| open + j) else { break };
            let inner = out[open..close].to_string();
            let before = out[..i].trim();
            out = if before.is_empty() { format!("{inner}{}", &out[close + 1..]) } else { format!("{}{}", &out[..i], &out[close + 1..]) };
        }
    }
    out
}

/// `\frac12` → `\frac{1}{2}`, `\frac1{2}` → `\frac{1}{2}`, `\sqrt2` → `\sqrt{2}`.
fn fix_fracs(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find("\\frac").or_else(|| rest.find("\\sqrt")) {
        let name_len = 5;
        out.push_str(&rest[..i + name_len]);
        rest = &rest[i + name_len..];
        let arguments = if out.ends_with("\\frac") { 2 } else { 1 };
        for _ in 0..arguments {
            let mut chars = rest.chars();
            match chars.next() {
                Some('{') => {
                    let close = matching_brace(rest).unwrap_or(rest.len() - 1);
                    out.push_str(&rest[..=close]);
                    rest = &rest[close + 1..];
                }
                Some(c) => {
                    out.push('{');
                    out.push(c);
                    out.push('}');
                    rest = &rest[c.len_utf8()..];
                }
                None => break,
            }
        }
    }
    out.push_str(rest);
    out
}

fn matching_brace(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_boxed_answer_is_taken_with_nested_braces() {
        assert_eq!(last_boxed("so \\boxed{2} then \\boxed{\\frac{1}{2}}.").as_deref(), Some("\\frac{1}{2}"));
        assert_eq!(last_boxed("$\\boxed 7$").as_deref(), Some("7"));
        assert_eq!(last_boxed("no box"), None);
        assert_eq!(last_boxed("\\boxed{unclosed"), None);
    }

    #[test]
    fn equivalent_spellings_normalise_alike() {
        let same = [
            ("\\dfrac{1}{2}", "\\frac12"),
            ("\\frac{1}{2}", "0.5"),
            ("1/2", "\\frac{1}{2}"),
            ("x = 5", "5"),
            ("5.0", "5"),
            ("10^\\circ", "10"),
            ("\\$1,000", "1000"),
            ("50\\%", "50"),
            ("3\\text{ cm}", "3"),
            ("\\left( 1, 2 \\right)", "(1,2)"),
            ("\\sqrt2", "\\sqrt{2}"),
            ("\\text{(A)}", "(A)"),
            (".5", "\\frac{1}{2}"),
        ];
        for (a, b) in same {
            assert_eq!(normalise(a), normalise(b), "{a} vs {b}");
        }
    }

    #[test]
    fn different_values_stay_different() {
        for (a, b) in [("1,2", "12"), ("\\frac{1}{3}", "0.3"), ("-5", "5"), ("x+y=3", "3"), ("2\\sqrt{2}", "\\sqrt{2}")] {
            assert_ne!(normalise(a), normalise(b), "{a} vs {b}");
        }
    }

    #[test]
    fn a_response_is_graded_by_its_boxed_answer() {
        let p = Problem { problem: "?".into(), solution: String::new(), answer: "\\frac{3}{4}".into() };
        assert!(Math.is_correct(&p, "Thus the answer is $\\boxed{\\dfrac34}$."));
        assert!(!Math.is_correct(&p, "The answer is 3/4."));
        assert!(Math.prompt(&p).starts_with(INSTRUCTION));
    }
}
