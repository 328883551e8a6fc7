//! The code in a chat answer: the fenced block that holds the function asked for (else the
//! first fenced block, else the whole answer), as pass@1 graders extract it.

/// Every fenced block of `response` (```lang … ```), in order; an unclosed last fence runs
/// to the end (an answer cut off by the token budget).
pub fn fenced_blocks(response: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut rest = response;
    while let Some(open) = rest.find("```") {
        let after = &rest[open + 3..];
        // The language tag runs to the end of the fence's line.
        let body_start = after.find('\n').map_or(after.len(), |i| i + 1);
        let body = &after[body_start..];
        match body.find("```") {
            Some(close) => {
                blocks.push(body[..close].to_string());
                rest = &body[close + 3..];
            }
            None => {
                blocks.push(body.to_string());
                break;
            }
        }
    }
    blocks
}

/// The code answering for `entry_point`: the first block defining it, else the first block,
/// else the whole response.
pub fn extract_code(response: &str, entry_point: Option<&str>) -> String {
    let blocks = fenced_blocks(response);
    if let Some(name) = entry_point {
        let def = format!("def {name}(");
        if let Some(block) = blocks.iter().find(|b| b.contains(&def)) {
            return block.clone();
        }
    }
    blocks.into_iter().next().unwrap_or_else(|| response.to_string())
}

/// The code a response commits to: its extracted code, trimmed, unless there is none.
pub fn committed_code(response: &str) -> Option<String> {
    let code = extract_code(response, None);
    (!code.trim().is_empty()).then(|| code.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_defining_the_function_is_taken() {
        let r = "Here:\n```python\nimport math\n```\nand\n```python\ndef f(x):\n    return x\n```\nDone.";
        assert_eq!(extract_code(r, Some("f")), "def f(x):\n    return x\n");
        assert_eq!(extract_code(r, Some("g")), "import math\n");
    }

    #[test]
    fn an_unclosed_fence_runs_to_the_end_and_no_fence_is_all_code() {
        assert_eq!(extract_code("```py\ndef f():\n    pass", Some("f")), "def f():\n    pass");
        assert_eq!(extract_code("def f(): pass", Some("f")), "def f(): pass");
        assert_eq!(fenced_blocks("a ``` b"), vec![String::new()]);
    }
}
