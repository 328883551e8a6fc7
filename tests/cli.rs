//! The `verdict` binary's user surface: help text and errors that name the bad value.

use std::process::Command;

fn verdict(args: &[&str]) -> (bool, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_verdict"))
        .args(args)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    (output.status.success(), text)
}

#[test]
fn help_lists_every_command() {
    let (ok, text) = verdict(&["--help"]);
    assert!(ok, "{text}");
    for command in ["serve", "generate", "bench", "fetch-models", "fetch-data", "forward-cost", "plot", "pool-reports"] {
        assert!(text.contains(command), "{command} missing from:\n{text}");
    }
}

#[test]
fn unknown_config_key_is_named_with_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "[models]\ntarget = \"t.gguf\"\ndraft = \"d.gguf\"\n[speculative]\ngama = 2\n",
    )
    .unwrap();
    let (ok, text) = verdict(&[
        "generate",
        "--config",
        path.to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert!(!ok);
    assert!(
        text.contains("unknown field `gama`") && text.contains("bad.toml"),
        "{text}"
    );
}

#[test]
fn missing_config_file_is_named() {
    let (ok, text) = verdict(&["serve", "--config", "/nonexistent/verdict.toml"]);
    assert!(!ok);
    assert!(text.contains("/nonexistent/verdict.toml"), "{text}");
}

#[test]
fn every_shipped_config_is_valid() {
    let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs"));
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            verdict::Config::load(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            checked += 1;
        }
    }
    assert!(checked >= 2, "only {checked} configs found in {}", dir.display());
    let eagle = verdict::Config::load(&dir.join("eagle-dropmatch.toml")).unwrap();
    assert!(verdict_eval::modes::known_modes(&eagle).contains(&"eagle:dropmatch".to_string()));
}

#[test]
fn unknown_bench_mode_is_named_with_the_known_ones() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stacks.toml");
    std::fs::write(
        &path,
        "[models]\ntarget = \"t.gguf\"\ndraft = \"d.gguf\"\n\
         [[stack]]\nname = \"fsd-0.1\"\n[[stack.judge]]\nkind = \"fsd\"\nthreshold = 0.1\n",
    )
    .unwrap();
    let config = path.to_str().unwrap();
    let (ok, text) = verdict(&["bench", "--config", config, "--modes", "plain,greedy"]);
    assert!(!ok);
    assert!(
        text.contains("\"greedy\"") && text.contains("exact") && text.contains("fsd-0.1"),
        "{text}"
    );
}

#[test]
fn unknown_model_name_lists_the_known_ones() {
    let (ok, text) = verdict(&["fetch-models", "qwen-9000"]);
    assert!(!ok);
    assert!(
        text.contains("qwen-9000") && text.contains("--list"),
        "{text}"
    );
}

/// `verdict bench` on a config and a three-problem GSM8K folder, with `extra` arguments:
/// it must refuse them before any model is loaded. What it said.
fn bench_refusal(extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    std::fs::write(&config, "[models]\ntarget = \"t.gguf\"\ndraft = \"d.gguf\"\n").unwrap();
    let data = dir.path().join("gsm8k");
    std::fs::create_dir(&data).unwrap();
    let problem = "{\"question\": \"q\", \"answer\": \"a\\n#### 1\"}\n";
    std::fs::write(data.join("test.jsonl"), problem.repeat(3)).unwrap();
    let mut args = vec!["bench", "--config", config.to_str().unwrap(), "--data-dir", data.to_str().unwrap()];
    args.extend_from_slice(extra);
    let (ok, text) = verdict(&args);
    assert!(!ok, "bench {extra:?} was accepted: {text}");
    text
}

#[test]
fn problem_ids_out_of_range_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let ids = dir.path().join("ids.txt");
    std::fs::write(&ids, "0\n3\n").unwrap();
    let text = bench_refusal(&["--ids", ids.to_str().unwrap()]);
    assert!(text.contains("ids.txt:2") && text.contains("problem 3 is out of range"), "{text}");
}

#[test]
fn an_empty_batch_is_refused() {
    let text = bench_refusal(&["--modes", "plain,exact", "--batch", "0"]);
    assert!(text.contains("--batch 0"), "{text}");
}

#[test]
fn zero_max_tokens_is_refused() {
    let text = bench_refusal(&["--modes", "plain", "--max-tokens", "0"]);
    assert!(text.contains("--max-tokens 0"), "{text}");
}

#[test]
fn missing_train_split_says_to_name_its_folder() {
    let text = bench_refusal(&["--split", "train"]);
    assert!(text.contains("train.jsonl") && text.contains("--data-dir"), "{text}");
}

/// `forward-cost` measures multi-token forwards on a draft-model engine, so it loads the
/// draft even when the config serves with another proposer (as the shipped default does).
#[test]
fn forward_cost_runs_on_a_config_whose_proposer_is_not_the_draft_model() {
    use verdict::tiny_model::{write_tiny_model, TinyArch, TinySpec};
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new(TinyArch::Qwen2, 7);
    write_tiny_model(&spec, &dir.path().join("target")).unwrap();
    write_tiny_model(&spec, &dir.path().join("draft")).unwrap();
    let config = dir.path().join("verdict.toml");
    std::fs::write(
        &config,
        format!(
            "[models]\ntarget = {:?}\ndraft = {:?}\n[speculative]\nproposer = \"ngram\"\n",
            dir.path().join("target"),
            dir.path().join("draft"),
        ),
    )
    .unwrap();
    let (ok, text) = verdict(&[
        "forward-cost", "--config", config.to_str().unwrap(), "--tokens", "1,2", "--kernels", "stock",
        "--repeats", "1", "--matmul-repeats", "0", "--max-tokens", "3",
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("| stock | pool | 2 |"), "no 2-token forward in:\n{text}");
}
