#!/usr/bin/env bash
# Issue "Judges that pay": the judge stacks against lossless drafting on training-side
# problems only, to choose the recommended stack without touching an evaluated problem.
# Temperature 0, answers capped at 512 tokens, modes interleaved in one process per task, one
# resumable report per task (rerun to go on; problems already in a report are skipped):
#   - GSM8K train problems 1300-1329 (N_GSM8K): after the ones mined for AutoJudge (1000-1299)
#     and outside the general head's training mixture (0-599);
#   - MBPP's last 50 tasks after the evaluated ones (train split 250-299, N_MBPP): none mined.
# Every run drafts with prompt lookup and the general head (the lossless configuration of
# issue "Fast on what users send"; also drafting up to 8 under SV, lossless). PASS=free (default) compares FLy (windows 2 and 3, and
# drafting up to 8 with and without SV; DropMatch and FSD were measured before and are left
# to the acceptance runs); PASS=autojudge adds the
# judge of EAGLE drafts once heads/gsm8k_head.safetensors exists, at its report's threshold
# and held strict under SV drafting up to 8 (beside lossless SV up to 8, the mode it must beat).
# MODES replaces a pass's list of modes. Run it alone on the cores; `touch .verdict-work/hold-bench` lends them out
# between problems (HOLD names another file).
set -euo pipefail
cd "$(dirname "$0")/.."
verdict="${CARGO_TARGET_DIR:-$HOME/.cache/verdict/target}/release/verdict"
[ -x "$verdict" ] || { echo "build first: cargo build --release --workspace --bins" >&2; exit 1; }
gsm8k_dir="${GSM8K_DIR:-../shared/data/gsm8k}"
[ -f "$gsm8k_dir/train.jsonl" ] || { echo "no $gsm8k_dir/train.jsonl: set GSM8K_DIR to GSM8K train's folder" >&2; exit 1; }
hold="${HOLD:-.verdict-work/hold-bench}"
pass="${PASS:-free}"
head=ngram+eagle@general
case "$pass" in
  free)
    modes="plain,$head:exact,$head-sv-g8:exact,$head:fly,$head-g8:fly,$head-sv-g8:fly,$head:fly-w3"
    ;;
  autojudge)
    [ -f heads/gsm8k_head.safetensors ] || { echo "no heads/gsm8k_head.safetensors: fit the judge of EAGLE drafts first (scripts/long-jobs.sh)" >&2; exit 1; }
    modes="plain,$head:exact,$head-sv-g8:exact,$head:autojudge,$head-sv-g8:autojudge-strict"
    ;;
  *) echo "PASS is free or autojudge, got '$pass'" >&2; exit 1 ;;
esac
modes="${MODES:-$modes}"
"$verdict" bench --config configs/tasks.toml --task gsm8k --split train --data-dir "$gsm8k_dir" \
  --offset 1300 --limit "${N_GSM8K:-30}" --max-tokens 512 --modes "$modes" \
  --out "bench-results/tuning-$pass-gsm8k-train.json" --hold-while "$hold"
"$verdict" bench --config configs/tasks.toml --task mbpp --split train \
  --offset 250 --limit "${N_MBPP:-50}" --max-tokens 512 --modes "$modes" \
  --out "bench-results/tuning-$pass-mbpp-train.json" --hold-while "$hold"
for report in bench-results/tuning-"$pass"-*.json; do
  "$verdict" plot "$report" --out "${report%.json}"
done
