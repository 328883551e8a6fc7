//! T_v learned on this machine, kept across restarts (`sv.learned_verify_ms_file`). A
//! server that learned what a verify row costs here starts its next run from that, not
//! from a table measured on another CPU, and two bench runs on one machine price rows
//! alike (a T_v learned afresh in each process made SV send different drafts, and τ
//! stopped comparing across runs).
//!
//! The file names the target and the machine it was learned for; a file learned for
//! another target, or on another machine, is set aside with a warning naming both (row
//! costs differ several-fold between CPUs). It is written whole, through a temporary file,
//! so a crash leaves the last save.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use verdict_heads::{compute_pool::compute_threads, ModelFingerprint};

use super::learned_latency::LearnedLatency;
use crate::verify_latency::VerifyLatency;

/// Samples between saves while decoding (a few hundred bytes every ≈ 10 s of steps).
pub const SAVE_EVERY_SAMPLES: u64 = 64;

/// What the file holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StoredLatency {
    /// The target whose verify forward was timed.
    pub target: ModelFingerprint,
    /// The CPU and the threads it was learned with ([`this_machine`]).
    pub machine: String,
    /// Steps timed, over the runs that learned it.
    pub samples: u64,
    /// (rows, milliseconds) of T_v as learned.
    pub verify_ms: Vec<(usize, f64)>,
}

/// Where the learned T_v of one target on this machine is kept.
#[derive(Clone, Debug)]
pub struct LatencyStore {
    path: PathBuf,
    target: ModelFingerprint,
    machine: String,
}

impl LatencyStore {
    /// The file `path` for `target` on this machine.
    pub fn new(path: PathBuf, target: ModelFingerprint) -> Self {
        Self::on_machine(path, target, this_machine())
    }

    /// As [`Self::new`] on a machine described as `machine`.
    pub fn on_machine(path: PathBuf, target: ModelFingerprint, machine: String) -> Self {
        Self { path, target, machine }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The T_v saved for this target on this machine and how many steps taught it; `None`
    /// when there is no file yet or it was learned elsewhere (a warning says which).
    pub fn load(&self) -> Result<Option<(VerifyLatency, u64)>> {
        if !self.path.exists() {
            return Ok(None);
        }
        let stored = self.read()?;
        if !stored.target.same_model(&self.target) {
            tracing::warn!(
                "sv.learned_verify_ms_file {} was learned for the target {}, but the loaded target is {}: learning T_v afresh (the file will be overwritten)",
                self.path.display(),
                stored.target.describe(),
                self.target.describe()
            );
            return Ok(None);
        }
        if stored.machine != self.machine {
            tracing::warn!(
                "sv.learned_verify_ms_file {} was learned on {:?}, this machine is {:?}: learning T_v afresh (the file will be overwritten)",
                self.path.display(),
                stored.machine,
                self.machine
            );
            return Ok(None);
        }
        let latency = VerifyLatency::fit(&stored.verify_ms)
            .with_context(|| format!("{}: its verify_ms do not make a T_v; delete the file to learn afresh", self.path.display()))?;
        Ok(Some((latency, stored.samples)))
    }

    fn read(&self) -> Result<StoredLatency> {
        let text = std::fs::read_to_string(&self.path).with_context(|| format!("cannot read {}", self.path.display()))?;
        serde_json::from_str(&text).with_context(|| {
            format!("{} is not a learned T_v (sv.learned_verify_ms_file); delete it to learn afresh", self.path.display())
        })
    }

    /// Write `learned` (after `earlier_samples` from the runs before this one), whole.
    pub fn save(&self, learned: &LearnedLatency, earlier_samples: u64) -> Result<()> {
        let stored = StoredLatency {
            target: self.target.clone(),
            machine: self.machine.clone(),
            samples: earlier_samples + learned.samples(),
            verify_ms: learned.current().points().to_vec(),
        };
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        let partial = self.path.with_extension("json.partial");
        std::fs::write(&partial, serde_json::to_string_pretty(&stored)?)
            .with_context(|| format!("cannot write {}", partial.display()))?;
        std::fs::rename(&partial, &self.path)
            .with_context(|| format!("cannot move {} to {}", partial.display(), self.path.display()))
    }
}

/// The CPU (its model name, and family and model number where the name is generic, as in
/// many virtual machines) and the threads the kernels use: what a verify row's cost depends
/// on besides the target.
pub fn this_machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|info| cpu_of(&info));
    let cpu = cpu.unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("{cpu}, {} threads", compute_threads())
}

/// "NAME (family F, model M)" from the first processor of a `/proc/cpuinfo`.
fn cpu_of(cpuinfo: &str) -> Option<String> {
    let field = |key: &str| {
        cpuinfo.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
    };
    let name = field("model name")?;
    Some(match (field("cpu family"), field("model")) {
        (Some(family), Some(model)) => format!("{name} (family {family}, model {model})"),
        _ => name,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn target(hidden_size: usize) -> ModelFingerprint {
        ModelFingerprint {
            architecture: "qwen2".into(),
            hidden_size,
            num_layers: 2,
            vocab_size: 64,
            tokenizer_sha256: "ab".repeat(32),
            source: "t.gguf".into(),
        }
    }

    /// The same points, to JSON's round trip of a float (its last digit may move).
    pub(crate) fn same_latency(a: &VerifyLatency, b: &VerifyLatency) -> bool {
        a.points().len() == b.points().len()
            && a.points().iter().zip(b.points()).all(|(x, y)| x.0 == y.0 && (x.1 - y.1).abs() <= 1e-9 * y.1.abs())
    }

    fn learned(ms_per_row: f64) -> LearnedLatency {
        let mut learned = LearnedLatency::without_prior();
        for rows in 1..=4 {
            learned.record(rows, 40.0 + ms_per_row * rows as f64);
        }
        learned
    }

    #[test]
    fn a_saved_latency_loads_as_learned_with_its_samples() {
        let dir = tempfile::tempdir().unwrap();
        let store = LatencyStore::on_machine(dir.path().join("sv/tv.json"), target(32), "cpu A, 2 threads".into());
        assert!(store.load().unwrap().is_none(), "no file yet");
        let learned = learned(10.0);
        store.save(&learned, 100).unwrap();
        let (latency, samples) = store.load().unwrap().unwrap();
        assert!(same_latency(&latency, learned.current()), "{latency:?} against {:?}", learned.current());
        assert_eq!(samples, 104);
        assert!(!dir.path().join("sv/tv.json.partial").exists());
    }

    #[test]
    fn another_target_or_machine_starts_afresh() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tv.json");
        LatencyStore::on_machine(path.clone(), target(32), "cpu A, 2 threads".into()).save(&learned(10.0), 0).unwrap();
        let other_target = LatencyStore::on_machine(path.clone(), target(64), "cpu A, 2 threads".into());
        assert!(other_target.load().unwrap().is_none());
        let other_machine = LatencyStore::on_machine(path.clone(), target(32), "cpu B, 2 threads".into());
        assert!(other_machine.load().unwrap().is_none());
        // The file name of the target may differ: the model is what counts.
        let renamed = ModelFingerprint { source: "elsewhere/t.gguf".into(), ..target(32) };
        assert!(LatencyStore::on_machine(path, renamed, "cpu A, 2 threads".into()).load().unwrap().is_some());
    }

    #[test]
    fn a_file_that_is_not_a_latency_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tv.json");
        std::fs::write(&path, "{\"rows\": 3}").unwrap();
        let err = format!("{:#}", LatencyStore::on_machine(path, target(32), "m".into()).load().unwrap_err());
        assert!(err.contains("tv.json") && err.contains("delete it"), "{err}");
    }

    #[test]
    fn the_machine_names_its_cpu_and_threads() {
        assert!(this_machine().ends_with(" threads"), "{}", this_machine());
        let info = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n\nprocessor\t: 1\nmodel name\t: AMD EPYC\n";
        assert_eq!(cpu_of(info).as_deref(), Some("AMD EPYC (family 25, model 1)"));
        assert_eq!(cpu_of("model name\t: Some CPU\n").as_deref(), Some("Some CPU"));
        assert_eq!(cpu_of("processor\t: 0\n"), None);
    }
}
