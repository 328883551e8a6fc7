#!/usr/bin/env bash
# Issue "Judges that pay": the acceptance runs on the task suite (GSM8K test, HumanEval, MBPP,
# MATH-500), answers capped at 512 tokens, modes interleaved in one process per task, every
# report resumable (rerun the script to go on):
#   1. temperature 0, problems 0-49 of each task: plain decoding, the lossless configuration
#      (prompt lookup with the general head, `exact`), the recommended stack, and EAGLE with
#      AutoJudge, FLy, DropMatch and FSD;
#   2. temperature 0, problems 50-99: plain, lossless and the recommended stack (100 a task);
#   3. temperature 0.7, top-p 0.95, 2 seeds, problems 0-49: plain sampling, the lossless
#      configuration under `rejection` and the recommended stack's sampled form;
#   4. the figures, and the reports pooled over the tasks (`verdict pool-reports`).
# LOSSLESS names the lossless configuration the stacks are measured against, listed first so
# that the pooled tables' "vs" columns use it (default lookup+head, γ 4; where SV drafting up
# to 8 is faster, as on the Xeon of session 43, ngram+eagle@general-sv-g8:exact); stage 1
# runs both; LOSSLESS_SAMPLED is its form under `rejection` at temperature 0.7 (default
# lookup+head-sampled; for SV up to 8, ngram+eagle@general-sv-g8:rejection). RECOMMENDED and RECOMMENDED_SAMPLED name the recommended stack's modes at temperature 0 and
# 0.7 (chosen on training-side problems by scripts/judges-tuning.sh; configs/recommended.toml
# says why). STAGE=1, 2 or 3 runs one stage. Run it alone on the cores;
# `touch .verdict-work/hold-bench` lends them out between problems (HOLD names another file).
set -euo pipefail
cd "$(dirname "$0")/.."
verdict="${CARGO_TARGET_DIR:-$HOME/.cache/verdict/target}/release/verdict"
[ -x "$verdict" ] || { echo "build first: cargo build --release --workspace --bins" >&2; exit 1; }
: "${RECOMMENDED:?name the recommended stack's mode at temperature 0 (configs/recommended.toml)}"
: "${RECOMMENDED_SAMPLED:?name the recommended stack's mode at temperature 0.7}"
[ -f heads/gsm8k_head.safetensors ] || { echo "no heads/gsm8k_head.safetensors: fit the judge of EAGLE drafts first (scripts/long-jobs.sh)" >&2; exit 1; }
hold="${HOLD:-.verdict-work/hold-bench}"
stage="${STAGE:-all}"
head=ngram+eagle@general
stacks="$head:autojudge,$head:fly,$head:dropmatch,$head:fsd-rescue"
lossless="${LOSSLESS:-lookup+head}"
lossless_sampled="${LOSSLESS_SAMPLED:-lookup+head-sampled}"
# A mode named twice (LOSSLESS among the lossless forms, the recommended stack a lossless
# configuration) runs once, where it is first named.
unique() { printf '%s' "$1" | tr ',' '\n' | awk 'NF && !seen[$0]++' | paste -sd, -; }
bench() { "$verdict" bench --config configs/tasks.toml --max-tokens 512 --hold-while "$hold" "$@"; }
if [ "$stage" = all ] || [ "$stage" = 1 ]; then
  bench --suite 50 --modes "$(unique "plain,$lossless,$RECOMMENDED,lookup+head,$head-sv-g8:exact,$stacks")" --out bench-results/judges-t0.json
fi
if [ "$stage" = all ] || [ "$stage" = 2 ]; then
  bench --suite 50 --offset 50 --modes "$(unique "plain,$lossless,$RECOMMENDED")" --out bench-results/judges-t0-50.json
fi
if [ "$stage" = all ] || [ "$stage" = 3 ]; then
  bench --suite 50 --temperature 0.7 --top-p 0.95 --seeds 2 \
    --modes "$(unique "plain,$lossless_sampled,$RECOMMENDED_SAMPLED")" --out bench-results/judges-t07.json
fi
for report in bench-results/judges-t0-*.json bench-results/judges-t07-*.json; do
  [ -f "$report" ] && "$verdict" plot "$report" --out "${report%.json}"
done
shopt -s nullglob
t0=(bench-results/judges-t0-{gsm8k,humaneval,mbpp,math500}.json bench-results/judges-t0-50-*.json)
[ ${#t0[@]} -gt 0 ] && "$verdict" pool-reports "${t0[@]}" > bench-results/judges-t0-pooled.md
t07=(bench-results/judges-t07-*.json)
[ ${#t07[@]} -gt 0 ] && "$verdict" pool-reports "${t07[@]}" > bench-results/judges-t07-pooled.md
exit 0
