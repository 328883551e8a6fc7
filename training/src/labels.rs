//! Mined labels on disk: JSONL, one line per finished problem, appended and synced as a
//! whole, so a run killed at any moment resumes with every finished problem intact.

use std::{
    collections::BTreeSet,
    fs::{File, OpenOptions},
    io::{Read, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// One tested mismatch: at `position` of the response the draft predicted `draft_token`
/// where the target wrote `target_token`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Mismatch {
    /// Index in the response (0 = first generated token).
    pub position: usize,
    pub target_token: u32,
    pub draft_token: u32,
    /// Swapping in the draft token changed the target's final answer.
    pub important: bool,
    /// The response tokens before `position` when the swap was tested.
    pub prefix: Vec<u32>,
    /// Labelled important without a regeneration: the target gave the draft token almost
    /// no probability (`mine --important-below`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shortcut: bool,
    /// The target's probability of the draft token there, read among its best tokens, or
    /// the least of theirs (a bound) when it is not among them; `None` when the engine did
    /// not report them. With it, a file mined without the shortcut says which labels the
    /// shortcut would have given at any bound, and how many of those a regeneration refutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_probability: Option<f32>,
}

/// Everything mined from one problem.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProblemLabels {
    pub problem_id: usize,
    /// The answer of the target's own response, which every swap is compared with.
    pub target_answer: Option<String>,
    pub mismatches: Vec<Mismatch>,
    /// The response after every unimportant swap was kept.
    pub final_response: Vec<u32>,
    /// Tokens the target generated for this problem (first response and continuations).
    pub generated_tokens: usize,
    pub seconds: f64,
}

/// The append-only label file.
pub struct LabelStore {
    path: PathBuf,
    file: File,
    done: BTreeSet<usize>,
}

impl LabelStore {
    /// Open (or create) `path`, dropping a last line a crash cut short.
    pub fn open(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open label file {}", path.display()))?;
        let mut text = String::new();
        file.read_to_string(&mut text)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let complete = text.rfind('\n').map_or(0, |i| i + 1);
        if complete < text.len() {
            tracing::warn!(
                "{}: dropping an unfinished last line ({} bytes) left by an interrupted run",
                path.display(),
                text.len() - complete
            );
            file.set_len(complete as u64)?;
            file.seek(SeekFrom::End(0))?;
        }
        let done = read_lines(&text[..complete], path)?
            .into_iter()
            .map(|p| p.problem_id)
            .collect();
        Ok(Self {
            path: path.to_path_buf(),
            file,
            done,
        })
    }

    pub fn is_done(&self, problem_id: usize) -> bool {
        self.done.contains(&problem_id)
    }

    pub fn done_count(&self) -> usize {
        self.done.len()
    }

    /// Append one problem's labels as a single synced line.
    pub fn append(&mut self, labels: &ProblemLabels) -> Result<()> {
        let mut line = serde_json::to_string(labels)?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.sync_data())
            .with_context(|| format!("cannot append to {}", self.path.display()))?;
        self.done.insert(labels.problem_id);
        Ok(())
    }

    /// Every problem in the file.
    pub fn read_all(path: &Path) -> Result<Vec<ProblemLabels>> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read label file {}", path.display()))?;
        let complete = text.rfind('\n').map_or(0, |i| i + 1);
        read_lines(&text[..complete], path)
    }
}

fn read_lines(text: &str, path: &Path) -> Result<Vec<ProblemLabels>> {
    verdict_eval::jsonl::parse_lines(text, path, "label record")
}
