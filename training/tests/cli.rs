//! `train-head`'s refusals that come before any model loads: each names the bad value.

use std::process::Command;

fn train_head(args: &[&str]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_train-head")).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

#[test]
fn mining_an_eagle_head_into_the_draft_models_labels_is_refused() {
    let (ok, text) = train_head(&["mine", "--eagle-head", "no-such-head"]);
    assert!(!ok && text.contains("--labels") && text.contains("heads/gsm8k_labels.jsonl"), "{text}");
}

#[test]
fn a_prompts_file_needs_its_source_and_a_source_its_file() {
    let (ok, text) = train_head(&["mine", "--eagle-head", "h", "--labels", "/tmp/l.jsonl", "--prompts", "p.jsonl"]);
    assert!(!ok && text.contains("--source") && text.contains("p.jsonl"), "{text}");
    let (ok, text) = train_head(&["mine", "--eagle-head", "h", "--labels", "/tmp/l.jsonl", "--source", "math"]);
    assert!(!ok && text.contains("--source math") && text.contains("--prompts"), "{text}");
}

#[test]
fn the_shortcut_bound_must_be_a_probability() {
    let (ok, text) = train_head(&["mine", "--important-below", "1.5"]);
    assert!(!ok && text.contains("1.5") && text.contains("probability"), "{text}");
}

#[test]
fn mining_problems_together_is_for_eagle_heads_only() {
    let (ok, text) = train_head(&["mine", "--together", "4"]);
    assert!(!ok && text.contains("--together 4") && text.contains("--eagle-head"), "{text}");
    let (ok, text) = train_head(&["mine", "--eagle-head", "h", "--labels", "/tmp/l.jsonl", "--together", "0"]);
    assert!(!ok && text.contains("--together") && text.contains('0'), "{text}");
}

/// `eagle --prompts` trains on that file's prompts: a missing one is named before anything
/// loads (when the flag was shadowed by the task's own `--prompts`, `eagle` went on to
/// answer GSM8K problems instead).
#[test]
fn eagle_reads_its_prompts_file_first() {
    let work = tempfile::tempdir().unwrap();
    let work = work.path().to_str().unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/default.toml");
    let (ok, text) = train_head(&["eagle", "--config", config, "--prompts", "/no/such/prompts.jsonl", "--work", work, "--out", work]);
    assert!(!ok && text.contains("/no/such/prompts.jsonl"), "{text}");
    let (ok, text) = train_head(&["eagle", "--prompts", "p.jsonl", "--source", "math"]);
    assert!(!ok && text.contains("--source math") && text.contains("eagle"), "{text}");
}

#[test]
fn mbpp_brings_its_own_prompts_and_pad_takes_gsm8k_only() {
    let (ok, text) = train_head(&["mine", "--eagle-head", "h", "--labels", "/tmp/l.jsonl", "--task", "mbpp", "--prompts", "p.jsonl", "--source", "math"]);
    assert!(!ok && text.contains("--task mbpp") && text.contains("p.jsonl"), "{text}");
    let (ok, text) = train_head(&["mine", "--task", "humaneval"]);
    assert!(!ok && text.contains("humaneval"), "{text}");
}

#[test]
fn a_further_label_set_names_its_labels_and_features() {
    let (ok, text) = train_head(&["fit", "--and", "only-labels.jsonl"]);
    assert!(!ok && text.contains("only-labels.jsonl") && text.contains("LABELS,FEATURES"), "{text}");
}
