#!/usr/bin/env bash
# Verdict against llama.cpp on this CPU: the same GGUF target, the same prompts (the target's
# chat template rendered by `verdict prompts`), greedy, answers capped at MAX_TOKENS, 2 threads,
# rounds A-B-A (llama.cpp, Verdict, llama.cpp again) so drift in the machine shows. Run it
# alone on the cores (hold other jobs first).
#   llama.cpp: plain decoding (`llama-speculative-simple` whose n-gram drafter never fires: it
#     looks up 1024-token n-grams), the 0.5B draft model (`draft-simple`, 4 drafts a step) and
#     its prompt lookup (`ngram-simple`);
#   Verdict: plain decoding and prompt lookup + the general EAGLE-3 head (`exact`).
# Writes OUT (bench-results/peer-llama): llama-runs.jsonl, Verdict's bench reports, summary.md.
# Needs llama.cpp built from the llama-cpp-python 0.3.36 sdist (docs/patches-and-kernels.md);
# LLAMA_BIN names its build/bin. N problems of GSM8K test and HumanEval (default 5).
set -euo pipefail
cd "$(dirname "$0")/.."
verdict="${CARGO_TARGET_DIR:-$HOME/.cache/verdict/target}/release/verdict"
llama="${LLAMA_BIN:-$HOME/.cache/verdict/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}"
models="${VERDICT_CACHE:-$HOME/.cache/verdict}/models"
target="$models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
draft="$models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
n="${N:-5}"
max_tokens="${MAX_TOKENS:-512}"
out="${OUT:-bench-results/peer-llama}"
work=.verdict-work/peer
tasks="gsm8k humaneval"
for f in "$verdict" "$llama/llama-speculative-simple"; do
  [ -x "$f" ] || { echo "missing $f (build it first)" >&2; exit 1; }
done
for f in "$target" "$draft"; do
  [ -f "$f" ] || { echo "missing $f: run verdict fetch-models" >&2; exit 1; }
done
mkdir -p "$work" "$out"
rm -f "$out/llama-runs.jsonl"

for task in $tasks; do
  "$verdict" prompts --config configs/tasks.toml --task "$task" --limit "$n" --out "$work/prompts-$task.jsonl"
  # One file per prompt, byte for byte (a shell variable would drop the final newline).
  python3 - "$work/prompts-$task.jsonl" "$work/$task" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    p = json.loads(line)
    open(f"{sys.argv[2]}-{p['problem']}.txt", "w").write(p["rendered"])
EOF
done

llama_round() {
  local round=$1
  for task in $tasks; do
    for prompt in "$work/$task"-*.txt; do
      problem="${prompt##*-}"; problem="${problem%.txt}"
      for mode in plain ngram-simple draft-simple; do
        case $mode in
          plain) args=(--spec-type ngram-simple --spec-ngram-simple-size-n 1024) ;;
          ngram-simple) args=(--spec-type ngram-simple) ;;
          draft-simple) args=(--spec-type draft-simple -md "$draft" --spec-draft-n-max 4) ;;
        esac
        log="$work/llama-$round-$task-$problem-$mode.log"
        "$llama/llama-speculative-simple" -m "$target" "${args[@]}" -f "$prompt" -n "$max_tokens" \
          -t 2 --temp 0 -c 4096 > "$log.out" 2> "$log"
        python3 - "$log" "$round" "$task" "$problem" "$mode" >> "$out/llama-runs.jsonl" <<'EOF'
import json, re, sys
log, round_, task, problem, mode = sys.argv[1:]
text = open(log).read()
def grab(pattern):
    m = re.search(pattern, text)
    if not m:
        sys.exit(f"{log}: no match for {pattern!r}")
    return m.groups()
enc_tokens, enc_s = grab(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
dec_tokens, dec_s = grab(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
drafted, = grab(r"n_drafted\s*=\s*(\d+)")
accepted, = grab(r"n_accept\s*=\s*(\d+)")
print(json.dumps({"engine": "llama.cpp", "round": int(round_), "task": task, "problem": int(problem), "mode": mode,
                  "prompt_tokens": int(enc_tokens), "prompt_seconds": float(enc_s),
                  "tokens": int(dec_tokens), "decode_seconds": float(dec_s),
                  "drafted": int(drafted), "accepted": int(accepted)}))
EOF
      done
    done
  done
}

verdict_round() {
  for task in $tasks; do
    rm -f "$out/verdict-$task.json" "$out/verdict-$task.json.runs.jsonl"
    "$verdict" bench --config configs/tasks.toml --task "$task" --limit "$n" --max-tokens "$max_tokens" \
      --modes plain,ngram+eagle@general:exact --no-divergences --out "$out/verdict-$task.json"
  done
}

llama_round 1
verdict_round
llama_round 2
python3 scripts/peer_llama_summary.py "$out" | tee "$out/summary.md"
