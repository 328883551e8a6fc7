#!/usr/bin/env bash
# The open issues' long jobs in their order, each resumable: rerun it after an interruption
# and it goes on where it stopped. Start it under nohup and leave the cores to it:
#   nohup bash scripts/long-jobs.sh >> .verdict-work/long-jobs.log 2>&1 &
#   1. the general EAGLE head (issue 50): `train-head eagle` on the prompt mixture (prompts,
#      responses, features, training: every stage resumes);
#   2. issue 50's acceptance runs (scripts/acceptance.sh: resumable reports), then its
#      temperature-0.7 runs again with SV choosing how many drafts to verify;
#   3. labels for a judge of EAGLE drafts (issue 53), mined with the general head's first
#      drafts: MBPP's tasks after the evaluated ones first (pass/fail on their asserts; short
#      answers make it the cheapest set; the head saw them all, and the last 50 are left to
#      choose a stack on), then GSM8K train problems the head never trained on (from 1000;
#      its mixture took 0-599), then MATH problems outside MATH-500 and outside the head's
#      mixture (its 600 MATH prompts come first in a mixture of MATH alone, so mining starts
#      at 600 there);
#   4. their target-only features and one judge head over the three label sets
#      (heads/gsm8k_head.safetensors);
#   5. PAD's rollout labels (500 of the EAGLE head's GSM8K train mismatches, the paper's
#      α 0.8, 4 rollouts a side at T 0.7, batched) and its pivot head
#      (heads/gsm8k_pad_head.safetensors);
#   6. the training-free judges against lossless drafting on training-side problems
#      (scripts/judges-tuning.sh, PASS=free: resumable reports);
#   7. the judge of EAGLE drafts against lossless drafting on the same problems
#      (scripts/judges-tuning.sh, PASS=autojudge).
# Stages 3-5 time nothing, so builds and tests may share the cores with them; stages 2, 6
# and 7 time every run and must have the cores alone (`touch .verdict-work/hold-bench` lends
# them out between problems).
# What to commit before a session ends: heads/general-eagle3 (after 1), bench-results/suite-*
# (2), heads/eagle_labels_{gsm8k,mbpp,math}.jsonl (3), heads/gsm8k_head.* (4),
# heads/eagle_pad_labels.jsonl and heads/gsm8k_pad_head.* (5), bench-results/tuning-* (6, 7).
# GSM8K_DIR names GSM8K train's folder (default ../shared/data/gsm8k); MINE_GSM8K, MINE_MBPP
# and MINE_MATH the problems to mine of each (default 300, 250 and 100, ≈ 10,000 labels; a
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
# STAGES lists the stages to run (default all: "1 2 3 4 5 6 7"), e.g. STAGES=5 for PAD alone.
stages=" ${STAGES:-1 2 3 4 5 6 7} "
want() { [[ "$stages" == *" $1 "* ]]; }
# glibc gives each thread that allocates its own arena, and the engines' threads free KV
# tensors into arenas that other threads then seldom reuse: a long mining run's resident
# memory then grows past what it holds. Two arenas keep it near what it uses.
export MALLOC_ARENA_MAX="${MALLOC_ARENA_MAX:-2}"

if want 1 && [ ! -f heads/general-eagle3/config.json ]; then
  say "1/7 the general EAGLE head"
  [ -f "$work/prompts.jsonl" ] || "$bin/train-head" mixture --data-dir "$gsm8k_dir"
  "$bin/train-head" eagle --config configs/default.toml --data-dir "$gsm8k_dir" \
    --prompts "$work/prompts.jsonl" --problems 2198 --temperature 0 --max-tokens 512 \
    --generate-batch 8 --work "$work/eagle" --out heads/general-eagle3 --draft-vocab 8192
fi

# Issue 50's reports are committed; a clone that has them all skips stage 2 (its markers live in
# .verdict-work, which a new machine does not have).
have_reports() { for t in gsm8k humaneval mbpp math500; do [ -f "bench-results/$1-$t.json" ] || return 1; done; }
if want 2 && [ ! -f .verdict-work/long-jobs/acceptance.done ] && ! have_reports suite-t0; then
  say "2/7 issue 50's acceptance runs"
  CARGO_TARGET_DIR=.verdict-work/long-jobs bash scripts/acceptance.sh
  touch .verdict-work/long-jobs/acceptance.done
fi

if want 2 && [ ! -f .verdict-work/long-jobs/acceptance-sv.done ] && ! have_reports suite-t07-sv; then
  # Chosen on MBPP's training split (bench-results/t07-drafting-mbpp-train.json): SV at 0.7.
  say "2/7 issue 50's temperature-0.7 runs with SV choosing how many drafts to verify"
  STAGE=t07 BEST=lookup+head-sampled-sv OUT07=bench-results/suite-t07-sv.json \
    CARGO_TARGET_DIR=.verdict-work/long-jobs bash scripts/acceptance.sh
  touch .verdict-work/long-jobs/acceptance-sv.done
fi

if want 3; then
  say "3/7 labels for a judge of EAGLE drafts"
  math_prompts="$work/math-prompts.jsonl"
  [ -f "$math_prompts" ] || "$bin/train-head" mixture --data-dir "$gsm8k_dir" \
    --gsm8k 0 --math 1200 --code 0 --qa 0 --out "$math_prompts"
  # One process per MINE_SLICE problems (default 100), a guard on memory: before mistral.rs
  # 0037 the captures' prefix cache grew without bound (≈ 180 MB a minute), and a fresh
  # process starts from the model's. With 0037 a process levels off near 8 GB within two
  # hours; slices stay few, since each one's end runs a draining batch. Each process skips the
  # problems its label file holds and resumes the searches a killed one left in flight.
  mine_in_slices() {
    local first=$1 count=$2 slice=${MINE_SLICE:-100}
    shift 2
    for ((from = first; from < first + count; from += slice)); do
      "$bin/train-head" mine --eagle-head heads/general-eagle3 --first "$from" \
        --problems $((first + count - from < slice ? first + count - from : slice)) "$@"
    done
  }
  mine_in_slices 0 "${MINE_MBPP:-250}" --task mbpp --labels heads/eagle_labels_mbpp.jsonl
  mine_in_slices 1000 "${MINE_GSM8K:-300}" --data-dir "$gsm8k_dir" --labels heads/eagle_labels_gsm8k.jsonl
  mine_in_slices 600 "${MINE_MATH:-100}" --prompts "$math_prompts" --source math \
    --max-response-tokens 512 --important-below 0.01 --labels heads/eagle_labels_math.jsonl

fi

# 4: the judge of EAGLE drafts: target-only features of each label set (resumable), then one
# head over the three sets (each holding out its own problems) as heads/gsm8k_head.safetensors.
if want 4; then
  say "4/7 features and the judge of EAGLE drafts"
  features=.verdict-work/eagle-judge
  "$bin/train-head" features --target-only --config configs/tasks.toml --data-dir "$gsm8k_dir" \
    --labels heads/eagle_labels_gsm8k.jsonl --features "$features/gsm8k"
  "$bin/train-head" features --target-only --config configs/tasks.toml --task mbpp \
    --labels heads/eagle_labels_mbpp.jsonl --features "$features/mbpp"
  "$bin/train-head" features --target-only --config configs/tasks.toml --prompts "$work/math-prompts.jsonl" \
    --source math --labels heads/eagle_labels_math.jsonl --features "$features/math"
  "$bin/train-head" fit --spec target --labels heads/eagle_labels_gsm8k.jsonl --features "$features/gsm8k" \
    --and "heads/eagle_labels_mbpp.jsonl,$features/mbpp" --and "heads/eagle_labels_math.jsonl,$features/math"
fi

if want 5; then
  say "5/7 PAD's rollout labels and pivot head"
  # Candidates are the EAGLE head's GSM8K mismatches, the drafts a PAD judge meets at run
  # time (the 32 labels of heads/gsm8k_pad_labels.jsonl are the 0.5B draft's, kept as a record).
  # Rollouts and features read the target alone, but `mine` opens its engines over a config
  # that loads a draft model (configs/gsm8k-pad.toml's 0.5B, unused here).
  pad_features=.verdict-work/eagle-pad-features
  "$bin/train-head" mine --method pad --config configs/gsm8k-pad.toml --data-dir "$gsm8k_dir" \
    --labels heads/eagle_labels_gsm8k.jsonl --pad-labels heads/eagle_pad_labels.jsonl \
    --candidates "${PAD_CANDIDATES:-500}"
  "$bin/train-head" features --kind pad --config configs/gsm8k-pad.toml --data-dir "$gsm8k_dir" \
    --pad-labels heads/eagle_pad_labels.jsonl --pad-features "$pad_features"
  "$bin/train-head" fit --kind pad --pad-labels heads/eagle_pad_labels.jsonl \
    --pad-features "$pad_features" --pad-out heads/gsm8k_pad_head.safetensors
fi

if want 6; then
  say "6/7 the training-free judges on training-side problems"
  GSM8K_DIR="$gsm8k_dir" CARGO_TARGET_DIR=.verdict-work/long-jobs PASS=free bash scripts/judges-tuning.sh
fi

if want 7; then
  say "7/7 the judge of EAGLE drafts on training-side problems"
  GSM8K_DIR="$gsm8k_dir" CARGO_TARGET_DIR=.verdict-work/long-jobs PASS=autojudge bash scripts/judges-tuning.sh
fi

say "done"
