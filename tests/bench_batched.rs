//! `verdict bench --batch`: problems with equal prompt lengths are decoded together, and a
//! batched accuracy run writes the same answers as decoding one problem at a time.

mod common;

use std::collections::BTreeMap;

use common::{config, spec, tiny_pair};
use verdict::tiny_model::TinyArch;
use verdict_cli::{
    bench::{self, BenchOptions, Mode},
    subset::Subset,
};

fn run(dir: &std::path::Path, batch: usize, out: &str) -> BTreeMap<usize, (String, usize)> {
    let mut config = config(dir, 3, "exact", 12);
    config.speculative.enabled = false;
    let out = dir.join(out);
    bench::run(
        &config,
        &BenchOptions {
            data_dir: dir.join("gsm8k"),
            split: "test".into(),
            subset: Subset { ids: None, offset: 1, limit: None },
            modes: vec![Mode::plain()],
            out: out.clone(),
            explain_divergences: false,
            batch,
            prefix_cache: false,
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
                r["problem"].as_u64().unwrap() as usize,
                (r["text"].as_str().unwrap().to_string(), r["batch_size"].as_u64().unwrap() as usize),
            )
        })
        .collect()
}

#[test]
fn batched_accuracy_run_answers_as_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    tiny_pair(dir.path(), &spec(TinyArch::Qwen2, 5), 0.2);
    std::fs::create_dir(dir.path().join("gsm8k")).unwrap();
    // Problem 0 is skipped by the offset; 1, 2 and 4 have prompts of one length, 3 another.
    let questions = ["w1 w2", "w3 w4 w5", "w6 w7 w8", "w9 w10", "w11 w12 w13"];
    let lines: String = questions
        .iter()
        .map(|q| format!("{}\n", serde_json::json!({"question": q, "answer": "x\n#### 1"})))
        .collect();
    std::fs::write(dir.path().join("gsm8k/test.jsonl"), lines).unwrap();

    let alone = run(dir.path(), 1, "alone.json");
    let batched = run(dir.path(), 4, "batched.json");
    assert_eq!(alone.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    let sizes: BTreeMap<usize, usize> = batched.iter().map(|(&p, (_, size))| (p, *size)).collect();
    assert_eq!(sizes, BTreeMap::from([(1, 3), (2, 3), (3, 1), (4, 3)]));
    for (problem, (text, _)) in &alone {
        assert_eq!(&batched[problem].0, text, "problem {problem}");
    }
}
