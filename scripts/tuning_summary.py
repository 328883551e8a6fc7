#!/usr/bin/env python3
"""Modes of `verdict bench` checkpoints (<out>.runs.jsonl) compared on the problems every mode
finished, pooled over the files given (one per task): answers right, tokens written, tokens/s,
wall clock against plain decoding and against lossless drafting, τ, refusals a judge overturned
and a verify step's cost. A lossy mode writes texts of other lengths, so how soon its answers
come (time) is the figure to judge it by, beside tokens/s:
    python3 scripts/tuning_summary.py bench-results/tuning-free-*-train.json.runs.jsonl
"""
import argparse
import collections
import json


def load(paths):
    by_task = {}
    for path in paths:
        runs = collections.defaultdict(dict)
        order = []
        for line in open(path):
            r = json.loads(line)
            runs[(r["problem"], r.get("seed", 0))][r["mode"]] = r
            if r["mode"] not in order:
                order.append(r["mode"])
        by_task[path] = (runs, order)
    return by_task


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--reference", default="ngram+eagle@general:exact", help="the lossless mode the 'vs' columns use")
    args = parser.parse_args()
    by_task = load(args.checkpoints)
    modes = next(iter(by_task.values()))[1]
    rows = collections.defaultdict(lambda: collections.Counter())
    for runs, _ in by_task.values():
        done = [k for k, v in runs.items() if all(m in v for m in modes)]
        for m in modes:
            for k in done:
                r, ref, plain = runs[k][m], runs[k][args.reference], runs[k]["plain"]
                c = r.get("counters") or {}
                row = rows[m]
                row["problems"] += 1
                row["correct"] += r["correct"]
                row["tokens"] += r["completion_tokens"]
                row["seconds"] += r["seconds"]
                row["ref_tokens"] += ref["completion_tokens"]
                row["ref_seconds"] += ref["seconds"]
                row["plain_tokens"] += plain["completion_tokens"]
                row["plain_seconds"] += plain["seconds"]
                row["plain_decode_seconds"] += plain["seconds"] - (plain.get("prompt_seconds") or 0)
                row["same_text"] += r["text"] == plain["text"]
                row["steps"] += c.get("steps", 0)
                row["accepted"] += c.get("accepted_tokens", 0)
                row["verify_seconds"] += c.get("verify_seconds", 0.0)
                for judge in (c.get("judges") or {}).values():
                    row["judge_calls"] += judge["calls"]
                    row["rescues"] += judge["rescues"]
    print("| mode | problems | correct | identical to plain | tokens vs reference | τ | tokens/s vs plain | time vs plain | time vs reference | overturned / refusals judged | verify ms / plain ms a token |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m in modes:
        r = rows[m]
        tps = r["tokens"] / r["seconds"]
        plain_tps = r["plain_tokens"] / r["plain_seconds"]
        plain_ms = 1000 * r["plain_decode_seconds"] / r["plain_tokens"]
        verify = f"{1000 * r['verify_seconds'] / r['steps'] / plain_ms:.2f}" if r["steps"] else "–"
        tau = f"{1 + r['accepted'] / r['steps']:.2f}" if r["steps"] else "–"
        judged = f"{r['rescues']} / {r['judge_calls']}" if r["judge_calls"] else "–"
        print(f"| {m} | {r['problems']} | {r['correct']} | {r['same_text']} | {r['tokens'] / r['ref_tokens']:.2f} | {tau} | "
              f"{tps / plain_tps:.2f}× | {r['plain_seconds'] / r['seconds']:.2f}× | {r['ref_seconds'] / r['seconds']:.2f}× | {judged} | {verify} |")


if __name__ == "__main__":
    main()
