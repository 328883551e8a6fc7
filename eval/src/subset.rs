//! Which problems of a split a command runs: a list of indices from a file, or a range
//! (`--offset`, `--limit`). Reports name problems by their index in the split, so a subset
//! run and a full run line up problem by problem.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

#[derive(Clone, Debug, Default)]
pub struct Subset {
    /// A file with one problem index per line (`#` comments and blank lines skipped).
    pub ids: Option<PathBuf>,
    /// Problems to skip from the start (of the split, or of the ids file's list).
    pub offset: usize,
    /// Problems to run at most after the offset; `None` runs to the end.
    pub limit: Option<usize>,
}

impl Subset {
    /// The selected indices into a split of `split_len` problems, in run order.
    pub fn indices(&self, split_len: usize) -> Result<Vec<usize>> {
        let listed = match &self.ids {
            Some(path) => read_ids(path, split_len)?,
            None => (0..split_len).collect(),
        };
        if self.offset > listed.len() {
            bail!(
                "--offset {} is past the {} problems selected",
                self.offset,
                listed.len()
            );
        }
        let end = match self.limit {
            Some(limit) => (self.offset + limit).min(listed.len()),
            None => listed.len(),
        };
        Ok(listed[self.offset..end].to_vec())
    }
}

fn read_ids(path: &Path, split_len: usize) -> Result<Vec<usize>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read problem ids from {}", path.display()))?;
    let mut seen = std::collections::HashSet::new();
    let mut ids = Vec::new();
    for (line_no, line) in text.lines().enumerate() {
        let entry = line.split('#').next().unwrap_or("").trim();
        if entry.is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), line_no + 1);
        let id: usize = entry
            .parse()
            .with_context(|| format!("{}: {entry:?} is not a problem index", at()))?;
        if id >= split_len {
            bail!("{}: problem {id} is out of range (the split has {split_len})", at());
        }
        if !seen.insert(id) {
            bail!("{}: problem {id} is listed twice", at());
        }
        ids.push(id);
    }
    if ids.is_empty() {
        bail!("{} lists no problem index", path.display());
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids_file(text: &str) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), text).unwrap();
        file
    }

    #[test]
    fn range_is_offset_then_limit() {
        let subset = Subset { offset: 3, limit: Some(4), ..Default::default() };
        assert_eq!(subset.indices(10).unwrap(), vec![3, 4, 5, 6]);
        let to_end = Subset { offset: 8, limit: Some(5), ..Default::default() };
        assert_eq!(to_end.indices(10).unwrap(), vec![8, 9]);
        assert_eq!(Subset::default().indices(3).unwrap(), vec![0, 1, 2]);
    }

    #[test]
    fn ids_keep_file_order_and_skip_comments() {
        let file = ids_file("# hard ones\n22\n\n5  # short\n1300\n");
        let subset = Subset { ids: Some(file.path().into()), ..Default::default() };
        assert_eq!(subset.indices(1319).unwrap(), vec![22, 5, 1300]);
        let sliced = Subset { ids: Some(file.path().into()), offset: 1, limit: Some(1) };
        assert_eq!(sliced.indices(1319).unwrap(), vec![5]);
    }

    #[test]
    fn out_of_range_id_names_the_line() {
        let file = ids_file("1\n1319\n");
        let subset = Subset { ids: Some(file.path().into()), ..Default::default() };
        let err = subset.indices(1319).unwrap_err().to_string();
        assert!(err.contains(":2:") && err.contains("1319") && err.contains("out of range"), "{err}");
    }

    #[test]
    fn bad_and_repeated_ids_are_errors() {
        let bad = ids_file("7\nseven\n");
        let subset = Subset { ids: Some(bad.path().into()), ..Default::default() };
        assert!(format!("{:#}", subset.indices(10).unwrap_err()).contains("\"seven\""));
        let twice = ids_file("7\n7\n");
        let subset = Subset { ids: Some(twice.path().into()), ..Default::default() };
        assert!(subset.indices(10).unwrap_err().to_string().contains("listed twice"));
    }

    #[test]
    fn offset_past_the_end_is_an_error() {
        let subset = Subset { offset: 11, ..Default::default() };
        assert!(subset.indices(10).unwrap_err().to_string().contains("--offset 11"));
    }
}
