//! `verdict bench` with EAGLE modes: `eagle:<stack>` drafts with the head as configured and
//! `eagle-<weights>:<stack>` with its matrices in another format, and `eagle@<name>:<stack>`
//! with another head `eagle_heads` names, all in one run; greedy
//! `exact` writes plain decoding's text whatever the head's weights, and plain decoding after
//! them (`plain-again`) writes it too.

mod common;

use common::{config, spec, tiny_pair};
use verdict::{
    tiny_model::{write_tiny_eagle3_head, TinyArch, FIRST_WORD_ID},
};
use verdict_eval::{
    bench::{self, BenchOptions},
    modes::Mode,
    subset::Subset,
};

#[test]
fn eagle_modes_with_two_weight_formats_run_in_one_bench() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec(TinyArch::Qwen2, 8);
    tiny_pair(dir.path(), &s, 0.2);
    let draft_vocab: Vec<u32> = (FIRST_WORD_ID as u32..FIRST_WORD_ID as u32 + 6).collect();
    write_tiny_eagle3_head(&s, &dir.path().join("head"), &draft_vocab, [1, 2, 2], 3).unwrap();
    std::fs::create_dir(dir.path().join("gsm8k")).unwrap();
    let lines: String = ["w1 w2", "w3 w4 w5"]
        .iter()
        .map(|q| format!("{}\n", serde_json::json!({"question": q, "answer": "x\n#### 1"})))
        .collect();
    std::fs::write(dir.path().join("gsm8k/test.jsonl"), lines).unwrap();

    // A second head, another draft vocabulary: named, it drafts in its own mode. A third,
    // for a wider target, must be refused when a mode names it: the named head is the one
    // loaded.
    let other_vocab: Vec<u32> = (FIRST_WORD_ID as u32 + 2..FIRST_WORD_ID as u32 + 10).collect();
    write_tiny_eagle3_head(&s, &dir.path().join("other-head"), &other_vocab, [1, 2, 2], 11).unwrap();
    let mut wider = s.clone();
    wider.hidden_size *= 2;
    write_tiny_eagle3_head(&wider, &dir.path().join("wider-head"), &other_vocab, [1, 2, 2], 11).unwrap();

    let mut config = config(dir.path(), 3, "exact", 16);
    config.speculative.eagle_head = Some(dir.path().join("head"));
    config.speculative.eagle_heads.insert("other".into(), dir.path().join("other-head"));
    config.speculative.eagle_heads.insert("wider".into(), dir.path().join("wider-head"));
    let modes: Vec<Mode> = ["plain", "plain-again", "eagle:exact", "eagle-q8_0:exact", "eagle@other:exact"].iter().map(|m| m.parse().unwrap()).collect();
    let out = dir.path().join("report.json");
    let options = BenchOptions {
        task: verdict_eval::bench::TaskName::Gsm8k,
        sandbox_python: "/usr/bin/python3".into(),
        data_dir: dir.path().join("gsm8k"),
        split: "test".into(),
        subset: Subset { ids: None, offset: 0, limit: None },
        modes: modes.clone(),
        out: out.clone(),
        explain_divergences: false,
        batch: 1,
        prefix_cache: true,
        seeds: 1,
        hold_while: None,
    };
    bench::run(&config, &options).unwrap();
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2 * modes.len());
    for problem in 0..2u64 {
        let text = |mode: &str| {
            runs.iter()
                .find(|r| r["problem"] == problem && r["mode"] == mode)
                .unwrap_or_else(|| panic!("no run of {mode} on problem {problem}"))["text"]
                .as_str()
                .unwrap()
                .to_string()
        };
        assert_eq!(text("eagle:exact"), text("plain"), "problem {problem}");
        assert_eq!(text("eagle-q8_0:exact"), text("plain"), "problem {problem}");
        assert_eq!(text("eagle@other:exact"), text("plain"), "problem {problem}");
        assert_eq!(text("plain-again"), text("plain"), "problem {problem}");
        let last = runs.iter().rfind(|r| r["problem"] == problem).unwrap();
        assert_eq!(last["mode"], "plain-again", "problem {problem}: plain-again runs after every other mode");
    }

    // The head's forward over committed positions is timed and a step's time accounted for.
    let summaries = report["summary"].as_array().unwrap();
    let summary = |mode: &str| summaries.iter().find(|s| s["mode"] == mode).unwrap();
    assert!(summary("plain")["step_time"].is_null() && summary("plain-again")["step_time"].is_null());
    assert_eq!(summary("plain-again")["identical_to_plain"], 2);
    for mode in ["eagle:exact", "eagle-q8_0:exact"] {
        let counters = &summary(mode)["counters"];
        assert!(counters["observe_seconds"].as_f64().unwrap() > 0.0, "{mode}: {counters}");
        let t = &summary(mode)["step_time"];
        let part = |k: &str| t[k].as_f64().unwrap();
        let parts = part("draft_ms") + part("observe_ms") + part("prompt_ms") + part("verify_ms") + part("accept_ms") + part("other_ms");
        assert!(part("prompt_ms") > 0.0, "{mode}: the prompt forward is timed apart: {t}");
        assert!((parts - part("total_ms")).abs() < 1e-6 && part("other_ms") >= 0.0, "{mode}: {t}");
    }

    // A format that does not exist, a head name no table holds, or a named head for
    // another target is refused before any problem runs, naming the mode (and the heads
    // there are, or the head's hidden size).
    let hidden = format!("hidden size {}", wider.hidden_size);
    for (mode, named) in [("eagle-q3:exact", "\"q3\""), ("eagle@nope:exact", "\"other\""), ("eagle@wider:exact", hidden.as_str())] {
        let bad = BenchOptions {
            modes: vec![mode.parse().unwrap()],
            out: dir.path().join("bad.json"),
            data_dir: options.data_dir.clone(),
            split: options.split.clone(),
            sandbox_python: options.sandbox_python.clone(),
            subset: Subset { ids: None, offset: 0, limit: None },
            hold_while: None,
            ..options
        };
        let err = format!("{:#}", bench::run(&config, &bad).err().unwrap_or_else(|| panic!("{mode} was accepted")));
        assert!(err.contains(mode) && err.contains(named), "{err}");
    }
}
