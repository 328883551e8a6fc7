//! Searches in flight on disk: the state of every problem a batched mining run has started
//! and not finished, rewritten whole after each step beside the label file. A run killed
//! between steps loses no continuation it had generated: the next run resumes each search
//! where it stood, and labels it exactly as an uninterrupted run would (greedy continuations
//! of the same prefixes).

use std::{
    fs::File,
    io::Write,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::miner::ProblemSearch;

/// A started search and the wall time spent on it so far.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SearchInFlight {
    pub search: ProblemSearch,
    pub seconds: f64,
}

/// The file of searches in flight that belongs to a label file.
pub struct SearchesInFlight {
    path: PathBuf,
}

impl SearchesInFlight {
    /// Beside `labels`: `x.jsonl` keeps its searches in flight in `x.searches.json`.
    pub fn of_labels(labels: &Path) -> Self {
        Self { path: labels.with_extension("searches.json") }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every search the file holds; none when there is no file. A file that does not parse
    /// is set aside (renamed `*.unreadable`) with a warning: it only saves time, and the
    /// problems it held are mined again from their start.
    pub fn load(&self) -> Result<Vec<SearchInFlight>> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", self.path.display())),
        };
        match serde_json::from_str(&text) {
            Ok(searches) => Ok(searches),
            Err(e) => {
                let aside = self.path.with_extension("json.unreadable");
                tracing::warn!(
                    "{}: not a file of searches in flight ({e}); moved to {}, its problems start over",
                    self.path.display(),
                    aside.display()
                );
                std::fs::rename(&self.path, &aside).with_context(|| format!("cannot move {} aside", self.path.display()))?;
                Ok(Vec::new())
            }
        }
    }

    /// Replace the file with `searches` (through a synced temporary file, so a kill leaves
    /// the old file or the new one); no searches: no file.
    pub fn save<'a>(&self, searches: impl IntoIterator<Item = &'a SearchInFlight>) -> Result<()> {
        let searches: Vec<&SearchInFlight> = searches.into_iter().collect();
        if searches.is_empty() {
            return match std::fs::remove_file(&self.path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(e).with_context(|| format!("cannot remove {}", self.path.display()))
                }
                _ => Ok(()),
            };
        }
        let tmp = self.path.with_extension("json.tmp");
        let written = File::create(&tmp).and_then(|mut file| {
            file.write_all(&serde_json::to_vec(&searches)?)?;
            file.sync_data()
        });
        written.with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, &self.path).with_context(|| format!("cannot move searches in flight into {}", self.path.display()))
    }
}
