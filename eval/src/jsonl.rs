//! JSON Lines files: one record a line, errors naming the file and the line.

use std::path::Path;

use anyhow::{Context, Result};
use serde::de::DeserializeOwned;

/// Parse every non-empty line of `text` (read from `path`) as a `what`.
pub fn parse_lines<T: DeserializeOwned>(text: &str, path: &Path, what: &str) -> Result<Vec<T>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .with_context(|| format!("{}:{}: not a {what}", path.display(), i + 1))
        })
        .collect()
}
