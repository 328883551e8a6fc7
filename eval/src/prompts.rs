//! A prompts file: JSON Lines of the requests a head should learn to draft for, each a
//! plain prompt (one user turn) or a chat (`messages`, as the OpenAI API sends them), for
//! example a deployment's own request log.
//!
//! ```text
//! {"id": "math-17", "source": "math", "prompt": "Solve …"}
//! {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
//! ```

use std::{collections::HashSet, path::Path};

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatTurn {
    pub role: String,
    pub content: String,
}

/// One line of a prompts file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptRecord {
    /// Unique in the file; defaults to the line's number.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    /// Where it came from (`gsm8k`, `math`, `code`, `qa`, …): reports count by it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<Vec<ChatTurn>>,
}

impl PromptRecord {
    pub fn plain(id: impl Into<String>, source: impl Into<String>, prompt: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            source: source.into(),
            prompt: Some(prompt.into()),
            messages: None,
        }
    }

    /// The conversation to answer: the prompt as one user turn, or the messages.
    pub fn turns(&self) -> Vec<ChatTurn> {
        match (&self.prompt, &self.messages) {
            (Some(prompt), _) => vec![ChatTurn {
                role: "user".into(),
                content: prompt.clone(),
            }],
            (None, Some(messages)) => messages.clone(),
            (None, None) => Vec::new(),
        }
    }
}

const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// Read a prompts file, checking every line: exactly one of `prompt` and `messages`, known
/// roles, a last turn from the user, non-empty text, unique ids.
pub fn load(path: &Path) -> Result<Vec<PromptRecord>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read the prompts file {}", path.display()))?;
    let mut records: Vec<PromptRecord> = crate::jsonl::parse_lines(&text, path, "prompt record ({\"prompt\": …} or {\"messages\": […]})")?;
    ensure!(!records.is_empty(), "the prompts file {} holds no prompt", path.display());
    let mut ids = HashSet::new();
    for (i, record) in records.iter_mut().enumerate() {
        let at = || format!("{}: record {}", path.display(), i + 1);
        if record.id.is_empty() {
            record.id = (i + 1).to_string();
        }
        match (&record.prompt, &record.messages) {
            (Some(_), Some(_)) => bail!("{}: has both `prompt` and `messages`; give one", at()),
            (None, None) => bail!("{}: has neither `prompt` nor `messages`", at()),
            _ => {}
        }
        let turns = record.turns();
        ensure!(!turns.is_empty(), "{}: `messages` is empty", at());
        for turn in &turns {
            ensure!(ROLES.contains(&turn.role.as_str()), "{}: unknown role {:?} (system, user or assistant)", at(), turn.role);
            ensure!(!turn.content.trim().is_empty(), "{}: a {} turn with no text", at(), turn.role);
        }
        ensure!(turns.last().unwrap().role == "user", "{}: the last turn is from the {}, not the user: nothing to answer", at(), turns.last().unwrap().role);
        ensure!(ids.insert(record.id.clone()), "{}: id {:?} is used twice", at(), record.id);
    }
    Ok(records)
}

/// Write records as JSON Lines.
pub fn save(path: &Path, records: &[PromptRecord]) -> Result<()> {
    let mut text = String::new();
    for record in records {
        text.push_str(&serde_json::to_string(record)?);
        text.push('\n');
    }
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        f
    }

    #[test]
    fn plain_prompts_and_chats_load_with_ids_by_line() {
        let f = file("{\"prompt\": \"Hi\"}\n\n{\"id\": \"c\", \"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"Why?\"}]}\n");
        let records = load(f.path()).unwrap();
        assert_eq!(records[0].id, "1");
        assert_eq!(records[0].turns(), vec![ChatTurn { role: "user".into(), content: "Hi".into() }]);
        assert_eq!(records[1].id, "c");
        assert_eq!(records[1].turns().len(), 2);
    }

    #[test]
    fn bad_records_are_named() {
        for (text, says) in [
            ("{\"prompt\": \"a\", \"messages\": []}", "both"),
            ("{\"id\": \"x\"}", "neither"),
            ("{\"messages\": [{\"role\": \"robot\", \"content\": \"a\"}]}", "unknown role \"robot\""),
            ("{\"messages\": [{\"role\": \"user\", \"content\": \" \"}]}", "no text"),
            ("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\"}]}", "not the user"),
            ("{\"id\": \"a\", \"prompt\": \"x\"}\n{\"id\": \"a\", \"prompt\": \"y\"}", "used twice"),
            ("", "holds no prompt"),
            ("{\"prompt\": 3}", "record"),
        ] {
            let f = file(text);
            let err = format!("{:#}", load(f.path()).unwrap_err());
            assert!(err.contains(says), "{text}: {err}");
        }
    }

    #[test]
    fn saved_records_load_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        let records = vec![PromptRecord::plain("a", "qa", "Who?"), PromptRecord::plain("b", "math", "2+2?")];
        save(&path, &records).unwrap();
        assert_eq!(load(&path).unwrap(), records);
    }
}
