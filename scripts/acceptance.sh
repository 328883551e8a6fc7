#!/usr/bin/env bash
# Issue 50's acceptance runs on the real pair, answers capped at 512 tokens, modes interleaved
# in one process per task, one resumable report per task (rerun the script to go on after an
# interruption: problems already in a report are skipped):
#   1. temperature 0, N0 problems (50) of each of GSM8K, HumanEval, MBPP and MATH-500: plain
#      decoding, EAGLE `exact` with the GSM8K head and with the general head, prompt lookup,
#      and prompt lookup with the general head;
#   2. temperature 0.7, top-p 0.95, N1 problems (30) of each task, 2 seeds: plain sampling
#      against BEST (the best lossless configuration of run 1, under `rejection`);
#   3. the figures of every report.
# Run it alone on the cores: a build or a training job beside it makes the speeds meaningless.
# STAGE=t0 or STAGE=t07 runs one stage only; OUT07 names stage 2's report (a run with another
# BEST keeps the first one's). To have the cores for something else meanwhile,
# `touch .verdict-work/hold-bench`: the bench waits before its next problem until the file is
# removed (HOLD names another file), so no run is timed beside the other work.
set -euo pipefail
cd "$(dirname "$0")/.."
verdict="${CARGO_TARGET_DIR:-$HOME/.cache/verdict/target}/release/verdict"
[ -x "$verdict" ] || { echo "build first: cargo build --release --workspace --bins" >&2; exit 1; }
[ -f heads/general-eagle3/config.json ] || { echo "no heads/general-eagle3: train it first (docs/training.md)" >&2; exit 1; }
stage="${STAGE:-all}"
# Modes by the [[mode]] names of configs/tasks.toml (the reports key runs by their spelling
# in the mode grammar, e.g. ngram+eagle@general:exact for lookup+head).
best="${BEST:-lookup+head-sampled}"
hold="${HOLD:-.verdict-work/hold-bench}"
if [ "$stage" = all ] || [ "$stage" = t0 ]; then
  "$verdict" bench --config configs/tasks.toml --suite "${N0:-50}" --max-tokens 512 \
    --modes plain,gsm8k-head,general-head,lookup,lookup+head \
    --out bench-results/suite-t0.json --hold-while "$hold"
fi
if [ "$stage" = all ] || [ "$stage" = t07 ]; then
  "$verdict" bench --config configs/tasks.toml --suite "${N1:-30}" --max-tokens 512 \
    --temperature 0.7 --top-p 0.95 --seeds 2 \
    --modes "plain,$best" --out "${OUT07:-bench-results/suite-t07.json}" --hold-while "$hold"
fi
for report in bench-results/suite-t0-*.json bench-results/suite-t07-*.json; do
  [ -f "$report" ] && "$verdict" plot "$report" --out "${report%.json}"
done
