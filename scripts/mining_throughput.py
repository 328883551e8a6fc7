#!/usr/bin/env python3
"""Mining throughput from an AutoJudge label file (the miner records seconds and tokens per problem)."""
import argparse
import json
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labels", nargs="?", default="heads/gsm8k_labels.jsonl")
    parser.add_argument("--from-problem", type=int, default=0, help="skip problems below this id")
    args = parser.parse_args()
    path, first = args.labels, args.from_problem
    problems = [json.loads(line) for line in open(path) if line.strip()]
    problems = [p for p in problems if p["problem_id"] >= first]
    if not problems:
        sys.exit(f"no problems with id >= {first} in {path}")
    mismatches = sum(len(p["mismatches"]) for p in problems)
    important = sum(m["important"] for p in problems for m in p["mismatches"])
    tokens = sum(p["generated_tokens"] for p in problems)
    hours = sum(p["seconds"] for p in problems) / 3600
    no_answer = sum(p["target_answer"] is None for p in problems)
    print(f"{len(problems)} problems ({no_answer} without an answer), {mismatches} mismatches, "
          f"{important} important ({100 * important / max(mismatches, 1):.1f}%)")
    print(f"{tokens} target tokens in {hours:.2f} h: {len(problems) / hours:.1f} problems/h, "
          f"{tokens / hours:.0f} tokens/h, {mismatches / hours / 60:.1f} mismatches/min")


if __name__ == "__main__":
    main()
