//! `verdict bench --batch`: problems are decoded together (consecutive ones with ragged
//! batches, else those of equal prompt length), plain and speculative modes taking turns, and a
//! batched run writes the same answers as decoding one problem at a time.

mod common;

use std::collections::BTreeMap;

use common::{config, spec, tiny_pair};
use verdict::tiny_model::{write_tiny_eagle3_head, TinyArch, FIRST_WORD_ID};
use verdict_eval::{
    bench::{self, BenchOptions},
    modes::Mode,
    subset::Subset,
};

/// Each run's (problem, mode) → (text, batch size).
type Runs = BTreeMap<(usize, String), (String, usize)>;

fn run(dir: &std::path::Path, batch: usize, ragged: bool, modes: &[&str], out: &str) -> Runs {
    let mut config = config(dir, 3, "exact", 12);
    config.speculative.enabled = modes.iter().any(|m| m.starts_with("eagle"));
    config.speculative.eagle_head = Some(dir.join("head"));
    config.server.ragged_batches = ragged;
    let out = dir.join(out);
    bench::run(
        &config,
        &BenchOptions {
            task: verdict_eval::bench::TaskName::Gsm8k,
            sandbox_python: "/usr/bin/python3".into(),
            data_dir: dir.join("gsm8k"),
            split: "test".into(),
            subset: Subset { ids: None, offset: 1, limit: None },
            modes: modes.iter().map(|m| m.parse::<Mode>().unwrap()).collect(),
            out: out.clone(),
            explain_divergences: false,
            batch,
            prefix_cache: false,
            seeds: 1,
            hold_while: None,
        },
    )
    .unwrap();
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
    report["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                (r["problem"].as_u64().unwrap() as usize, r["mode"].as_str().unwrap().to_string()),
                (r["text"].as_str().unwrap().to_string(), r["batch_size"].as_u64().unwrap() as usize),
            )
        })
        .collect()
}

/// Five problems (problem 0 skipped by the offset; 1, 2 and 4 have prompts of one length,
/// 3 another), a tiny Qwen2 pair and a random EAGLE head for it.
fn setup() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(TinyArch::Qwen2, 5);
    tiny_pair(dir.path(), &s, 0.2);
    let draft_vocab: Vec<u32> = (FIRST_WORD_ID as u32..FIRST_WORD_ID as u32 + 6).collect();
    write_tiny_eagle3_head(&s, &dir.path().join("head"), &draft_vocab, [1, 2, 2], 3).unwrap();
    std::fs::create_dir(dir.path().join("gsm8k")).unwrap();
    let questions = ["w1 w2", "w3 w4 w5", "w6 w7 w8", "w9 w10", "w11 w12 w13"];
    let lines: String = questions
        .iter()
        .map(|q| format!("{}\n", serde_json::json!({"question": q, "answer": "x\n#### 1"})))
        .collect();
    std::fs::write(dir.path().join("gsm8k/test.jsonl"), lines).unwrap();
    dir
}

#[test]
fn batched_accuracy_run_answers_as_one_at_a_time() {
    let dir = setup();
    let alone = run(dir.path(), 1, false, &["plain"], "alone.json");
    let batched = run(dir.path(), 4, false, &["plain"], "batched.json");
    let problems: Vec<usize> = alone.keys().map(|(p, _)| *p).collect();
    assert_eq!(problems, vec![1, 2, 3, 4]);
    let sizes: BTreeMap<usize, usize> = batched.iter().map(|((p, _), (_, size))| (*p, *size)).collect();
    assert_eq!(sizes, BTreeMap::from([(1, 3), (2, 3), (3, 1), (4, 3)]));
    for (key, (text, _)) in &alone {
        assert_eq!(&batched[key].0, text, "problem {key:?}");
    }
}

/// Draft-model and EAGLE modes decode their groups in batched steps and answer as plain
/// decoding one problem at a time does.
#[test]
fn speculative_modes_batch_with_plain_decoding_and_answer_as_one_at_a_time() {
    let dir = setup();
    let alone = run(dir.path(), 1, true, &["plain"], "alone.json");
    let modes = ["plain", "exact", "eagle:exact", "eagle-serial-g2:exact"];
    let verifies = mistralrs_core::batched_speculative_verifies();
    let batched = run(dir.path(), 3, true, &modes, "batched.json");
    assert!(mistralrs_core::batched_speculative_verifies() > verifies, "no step verified several sequences at once");
    assert_eq!(batched.len(), 4 * modes.len());
    for ((problem, mode), (text, size)) in &batched {
        // Ragged batches: consecutive problems, 1..=3 then 4 alone.
        assert_eq!(*size, if *problem == 4 { 1 } else { 3 }, "problem {problem}, {mode}");
        assert_eq!(text, &alone[&(*problem, "plain".to_string())].0, "problem {problem}, {mode}");
    }
}

/// Problems 0 and 1, one at a time, plain decoding and `mode`, reported at `out`.
fn first_two(dir: &std::path::Path, mode: &str, out: &std::path::Path) -> BenchOptions {
    BenchOptions {
        task: verdict_eval::bench::TaskName::Gsm8k,
        sandbox_python: "/usr/bin/python3".into(),
        data_dir: dir.join("gsm8k"),
        split: "test".into(),
        subset: Subset { ids: None, offset: 0, limit: Some(2) },
        modes: vec![Mode::plain(), mode.parse().unwrap()],
        out: out.to_path_buf(),
        explain_divergences: false,
        batch: 1,
        prefix_cache: false,
        seeds: 1,
        hold_while: None,
    }
}

/// `--seeds 2` at temperature 1: each problem is sampled twice per mode (runs numbered by
/// seed, resumed by (problem, seed)), and each speculative sample is paired with plain
/// decoding's sample of the same number.
#[test]
fn seeds_sample_each_problem_again_and_pair_by_seed() {
    let dir = setup();
    let mut config = config(dir.path(), 3, "rejection", 6);
    config.sampling.temperature = 1.0;
    let out = dir.path().join("seeds.json");
    let options = BenchOptions { seeds: 2, ..first_two(dir.path(), "rejection", &out) };
    let report = bench::run(&config, &options).unwrap();
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let mut units: Vec<(u64, u64, String)> = json["runs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["problem"].as_u64().unwrap(), r["seed"].as_u64().unwrap(), r["mode"].as_str().unwrap().to_string()))
        .collect();
    units.sort();
    let expected: Vec<(u64, u64, String)> = (0..2)
        .flat_map(|p| (0..2).flat_map(move |s| ["plain", "rejection"].map(|m| (p, s, m.to_string()))))
        .collect();
    assert_eq!(units, expected);
    let speculative = report.summaries.iter().find(|s| s.mode == "rejection").unwrap();
    assert_eq!(speculative.problems, 4, "2 problems × 2 seeds");
    assert_eq!(speculative.paired.as_ref().unwrap().problems, 4, "each sample paired with plain decoding's of the same seed");
    // A rerun finds every (problem, seed, mode) done and decodes nothing; the report of
    // the process that made the runs stands (what it learned is in no run).
    let before = std::fs::read_to_string(bench::checkpoint_path(&out)).unwrap();
    let written = std::fs::metadata(&out).unwrap().modified().unwrap();
    let rerun = bench::run(&config, &options).unwrap();
    assert_eq!(std::fs::read_to_string(bench::checkpoint_path(&out)).unwrap(), before);
    assert_eq!(std::fs::metadata(&out).unwrap().modified().unwrap(), written, "a rerun with nothing to do rewrote the report");
    assert_eq!(rerun.runs.len(), 8);
    // One with another selection (plain decoding alone, all of its runs done) writes its own.
    let plain_only = BenchOptions { modes: vec![Mode::plain()], seeds: 2, ..first_two(dir.path(), "rejection", &out) };
    bench::run(&config, &plain_only).unwrap();
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(json["summary"].as_array().unwrap().len(), 1, "the report still covers the modes of the first run");
}

/// `--hold-while FILE`: while the file exists the bench decodes nothing (no run is timed while
/// another job has the cores); once it is removed the bench goes on and finishes.
#[test]
fn a_held_bench_waits_for_its_file_to_go() {
    let dir = setup();
    let config = config(dir.path(), 3, "exact", 6);
    let out = dir.path().join("held.json");
    let hold = dir.path().join("hold");
    std::fs::write(&hold, "").unwrap();
    let options = BenchOptions { hold_while: Some(hold.clone()), ..first_two(dir.path(), "exact", &out) };
    let bench = std::thread::spawn(move || bench::run(&config, &options).unwrap());
    // Long enough for the engines to load and the tiny pair to decode both problems.
    std::thread::sleep(std::time::Duration::from_secs(8));
    assert!(!bench.is_finished(), "the bench finished while held");
    let runs = std::fs::read_to_string(bench::checkpoint_path(&out)).unwrap_or_default();
    assert_eq!(runs.lines().count(), 0, "runs were decoded while held: {runs}");
    std::fs::remove_file(&hold).unwrap();
    let report = bench.join().unwrap();
    assert_eq!(report.runs.len(), 4, "2 problems × 2 modes once the hold is gone");
}
