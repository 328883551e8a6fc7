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
