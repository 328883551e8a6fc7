#!/usr/bin/env bash
# The open issues' long jobs in their order, each resumable: rerun it after an interruption
# and it goes on where it stopped. Start it under nohup and leave the cores to it:
#   nohup bash scripts/long-jobs.sh >> .verdict-work/long-jobs.log 2>&1 &
#   1. the general EAGLE head (issue 50): `train-head eagle` on the prompt mixture (prompts,
#      responses, features, training: every stage resumes);
#   2. issue 50's acceptance runs (scripts/acceptance.sh: resumable reports);
#   3. labels for a judge of EAGLE drafts (issue 53): GSM8K train problems, MBPP's tasks
#      after the evaluated ones (pass/fail on their asserts), then the mixture's MATH
#      prompts, mined with the general head's first drafts;
#   4. their target-only features and one judge head over the three label sets
#      (heads/gsm8k_head.safetensors).
# What to commit before a session ends: heads/general-eagle3 (after 1), bench-results/suite-*
# (2), heads/eagle_labels_{gsm8k,mbpp,math}.jsonl (3), heads/gsm8k_head.* (4).
# GSM8K_DIR names GSM8K train's folder (default ../shared/data/gsm8k); MINE_GSM8K, MINE_MBPP
# and MINE_MATH the problems to mine of each (default 300, 300 and 100, ≈ 10,000 labels; a
# larger count later mines on from where the file stops). MATH's long answers make each
# regeneration dear, so its mining takes the paper's shortcut (--important-below 0.01),
# answers capped at 512 tokens as in the evaluation (320 elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
release="${CARGO_TARGET_DIR:-$HOME/.cache/verdict/target}/release"
gsm8k_dir="${GSM8K_DIR:-../shared/data/gsm8k}"
work=.verdict-work/general
mkdir -p "$work" .verdict-work/long-jobs
# Copies, so that a rebuild while a job runs does not swap the binary under it.
bin=.verdict-work/long-jobs/release
mkdir -p "$bin"
for b in verdict train-head; do
  [ -x "$release/$b" ] || { echo "build first: cargo build --release --workspace --bins" >&2; exit 1; }
  cp "$release/$b" "$bin/$b.new" && mv "$bin/$b.new" "$bin/$b"
done
say() { echo "$(date -u +%FT%TZ) long-jobs: $*"; }

if [ ! -f heads/general-eagle3/config.json ]; then
  say "1/4 the general EAGLE head"
  [ -f "$work/prompts.jsonl" ] || "$bin/train-head" mixture --data-dir "$gsm8k_dir"
  "$bin/train-head" eagle --config configs/default.toml --data-dir "$gsm8k_dir" \
    --prompts "$work/prompts.jsonl" --problems 2198 --temperature 0 --max-tokens 512 \
    --generate-batch 8 --work "$work/eagle" --out heads/general-eagle3 --draft-vocab 8192
fi

if [ ! -f .verdict-work/long-jobs/acceptance.done ]; then
  say "2/4 issue 50's acceptance runs"
  CARGO_TARGET_DIR=.verdict-work/long-jobs bash scripts/acceptance.sh
  touch .verdict-work/long-jobs/acceptance.done
fi

say "3/4 labels for a judge of EAGLE drafts"
# The mixture's prompts (MATH's are mined) are rebuilt where a new machine lacks them.
[ -f "$work/prompts.jsonl" ] || "$bin/train-head" mixture --data-dir "$gsm8k_dir"
"$bin/train-head" mine --eagle-head heads/general-eagle3 --data-dir "$gsm8k_dir" \
  --first 0 --problems "${MINE_GSM8K:-300}" --labels heads/eagle_labels_gsm8k.jsonl
"$bin/train-head" mine --eagle-head heads/general-eagle3 --task mbpp \
  --first 0 --problems "${MINE_MBPP:-300}" --labels heads/eagle_labels_mbpp.jsonl
"$bin/train-head" mine --eagle-head heads/general-eagle3 --prompts "$work/prompts.jsonl" \
  --source math --first 0 --problems "${MINE_MATH:-100}" --max-response-tokens 512 \
  --important-below 0.01 --labels heads/eagle_labels_math.jsonl

# 4: the judge of EAGLE drafts: target-only features of each label set (resumable), then one
# head over the three sets (each holding out its own problems) as heads/gsm8k_head.safetensors.
say "4/4 features and the judge of EAGLE drafts"
features=.verdict-work/eagle-judge
"$bin/train-head" features --target-only --config configs/tasks.toml --data-dir "$gsm8k_dir" \
  --labels heads/eagle_labels_gsm8k.jsonl --features "$features/gsm8k"
"$bin/train-head" features --target-only --config configs/tasks.toml --task mbpp \
  --labels heads/eagle_labels_mbpp.jsonl --features "$features/mbpp"
"$bin/train-head" features --target-only --config configs/tasks.toml --prompts "$work/prompts.jsonl" \
  --source math --labels heads/eagle_labels_math.jsonl --features "$features/math"
"$bin/train-head" fit --spec target --labels heads/eagle_labels_gsm8k.jsonl --features "$features/gsm8k" \
  --and "heads/eagle_labels_mbpp.jsonl,$features/mbpp" --and "heads/eagle_labels_math.jsonl,$features/math"
say "done"
