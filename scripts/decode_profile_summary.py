#!/usr/bin/env python3
"""The table of scripts/decode-profile.sh: per round, llama.cpp's one-token decode (`tg64`)
and its 5- and 8-token prompt batches against Verdict's forwards over 1, 5 and 8 tokens for
each kernel instruction set timed, and the ratio of one-token speeds (above 1: Verdict is
faster). Rounds pair figures taken minutes apart, so the machine's drift falls on both sides;
the median over rounds is the figure to quote.

Usage: decode_profile_summary.py OUT ISA [ISA ...]"""
import json
import statistics
import sys
from pathlib import Path


def llama_ms(path):
    """(tg ms a token, pp5 ms, pp8 ms) of one llama-bench JSON report."""
    runs = json.load(open(path))
    speed = lambda pick: next(r["avg_ts"] for r in runs if pick(r))
    tg = speed(lambda r: r["n_gen"] > 0)
    pp5 = speed(lambda r: r["n_gen"] == 0 and r["n_prompt"] == 5)
    pp8 = speed(lambda r: r["n_gen"] == 0 and r["n_prompt"] == 8)
    return 1000 / tg, 5000 / pp5, 8000 / pp8


def verdict_ms(path):
    """ms of Verdict's forwards over 1, 5 and 8 tokens in one forward-cost report."""
    report = json.load(open(path))
    by_tokens = {f["tokens"]: f["milliseconds"] for f in report["forwards"]}
    return by_tokens[1], by_tokens[5], by_tokens[8]


def main():
    out, isas = Path(sys.argv[1]), sys.argv[2:]
    rows = []
    for i in range(1, 1000):
        forwards = [out / f"forward-{isa}-{i}.json" for isa in isas]
        if not all(f.exists() for f in forwards):
            break
        llama = out / f"llama-{i}.json"
        row = {"round": i, "llama": llama_ms(llama) if llama.exists() else None}
        row["verdict"] = [verdict_ms(f) for f in forwards]
        rows.append(row)
    if not rows:
        sys.exit(f"{out}: no round with a forward-cost report for each of {isas}")
    with_llama = all(r["llama"] for r in rows)
    head = ["round"]
    if with_llama:
        head += ["llama.cpp tg64 ms", "pp5 ms", "pp8 ms"]
    for isa in isas:
        head += [f"{isa}: 1 token ms", "5 tokens", "8 tokens"]
        if with_llama:
            head.append(f"{isa} ÷ llama.cpp speed")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    columns = []
    for r in rows:
        cells = []
        if with_llama:
            cells += list(r["llama"])
        for v in r["verdict"]:
            cells += list(v)
            if with_llama:
                cells.append(r["llama"][0] / v[0])
        columns.append(cells)
        print(f"| {r['round']} | " + " | ".join(fmt(h, c) for h, c in zip(head[1:], cells)) + " |")
    medians = [statistics.median(c) for c in zip(*columns)]
    print("| median | " + " | ".join(fmt(h, c) for h, c in zip(head[1:], medians)) + " |")


def fmt(header, value):
    return f"{value:.2f}×" if "÷" in header else f"{value:.1f}"


if __name__ == "__main__":
    main()
