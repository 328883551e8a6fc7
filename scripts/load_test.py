#!/usr/bin/env python3
"""Throughput of a running `verdict serve` against concurrency, through the `openai` client.

For each concurrency C, the same GSM8K test questions are sent as chat requests by C client
threads at once (greedy, `--max-tokens` each); total generated tokens / wall time is the
figure. The server's /metrics are read before and after each level, so speculative servers
also report tau (1 + accepted / steps) and the share of verified drafts that were rejected.
Every answer is kept, so runs of different servers can be compared text for text
(`--compare`).

  verdict serve --config configs/load-plain.toml &
  python3 scripts/load_test.py --label plain --out bench-results/load-plain.json

Needs `pip install openai`. Nothing here is timed against anything else on the machine:
run it alone.
"""

import argparse
import concurrent.futures
import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path


def default_data() -> Path:
    cache = Path(os.environ.get("VERDICT_CACHE", Path.home() / ".cache" / "verdict"))
    return cache / "data" / "gsm8k" / "test.jsonl"


def questions(path: Path, n: int) -> list:
    if not path.is_file():
        sys.exit(f"{path}: no GSM8K test split there; run `verdict fetch-data` or pass --data")
    out = []
    with path.open() as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line)["question"])
            if len(out) == n:
                break
    if len(out) < n:
        sys.exit(f"{path}: only {len(out)} questions, --prompts asked for {n}")
    return out


def scrape(metrics_url: str) -> dict:
    """The server's counters without labels, by name."""
    with urllib.request.urlopen(metrics_url, timeout=30) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(verdict_[a-z_]+) ([0-9.eE+-]+|NaN)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def speculation(before: dict, after: dict) -> dict:
    def d(name):
        return after.get(f"verdict_spec_decode_{name}", 0.0) - before.get(f"verdict_spec_decode_{name}", 0.0)

    steps, drafted, accepted = d("num_steps_total"), d("num_draft_tokens_total"), d("num_accepted_tokens_total")
    if steps == 0:
        return {}
    return {
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "tau": 1 + accepted / steps,
        # A verify scores the drafts plus one position; the rejected drafts are the waste.
        "verified_per_accepted_token": (drafted + steps) / (accepted + steps),
        "rejected_share_of_verified": (drafted - accepted) / (drafted + steps),
        # Seconds in the level: drafting, the head taking in verified rows, verify forwards.
        "draft_seconds": d("draft_seconds_total"),
        "observe_seconds": d("observe_seconds_total"),
        "verify_seconds": d("verify_seconds_total"),
    }


def run_level(client, model, prompts, concurrency, max_tokens):
    def one(i):
        start = time.perf_counter()
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompts[i]}],
            max_tokens=max_tokens,
            temperature=0.0,
        )
        return i, r.choices[0].message.content, r.usage.completion_tokens, time.perf_counter() - start

    texts, tokens, latencies = [None] * len(prompts), 0, []
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency) as pool:
        for i, text, n, latency in pool.map(one, range(len(prompts))):
            texts[i] = text
            tokens += n
            latencies.append(latency)
    wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_second": tokens / wall,
        "mean_latency_s": sum(latencies) / len(latencies),
        "texts": texts,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="the server (default %(default)s)")
    p.add_argument("--model", default="verdict", help="the served model's name")
    p.add_argument("--data", type=Path, default=default_data(), help="GSM8K test JSONL")
    p.add_argument("--prompts", type=int, default=32, help="questions per level (default %(default)s)")
    p.add_argument("--concurrency", default="1,2,4,8", help="levels (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default %(default)s)")
    p.add_argument("--label", required=True, help="this server's name in the report (plain, exact, ...)")
    p.add_argument("--out", type=Path, help="JSON report; an existing one gains this label")
    p.add_argument("--compare", help="a label already in --out: count answers identical to its")
    args = p.parse_args()

    try:
        from openai import OpenAI
    except ImportError:
        sys.exit("needs the openai client: pip install openai")
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in levels):
        sys.exit(f"--concurrency {args.concurrency}: every level must be at least 1")
    prompts = questions(args.data, args.prompts)
    client = OpenAI(base_url=f"{args.url}/v1", api_key="none", timeout=3600)
    # One short request first, so that no level pays for a cold start.
    client.chat.completions.create(
        model=args.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0.0
    )

    report = json.loads(args.out.read_text()) if args.out and args.out.is_file() else {}
    results = []
    print(f"{args.label}: {len(prompts)} GSM8K test questions, {args.max_tokens} tokens each, greedy")
    print("| concurrency | tokens | s | tok/s total | vs concurrency 1 | mean latency s | tau | verified / accepted token | rejected share of verified | draft + observe s | verify s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in levels:
        before = scrape(f"{args.url}/metrics")
        level = run_level(client, args.model, prompts, c, args.max_tokens)
        level["speculation"] = speculation(before, scrape(f"{args.url}/metrics"))
        results.append(level)
        s = level["speculation"]
        spec = (
            f"{s['tau']:.2f} | {s['verified_per_accepted_token']:.2f} | {100 * s['rejected_share_of_verified']:.0f} % | "
            f"{s['draft_seconds']:.1f} + {s['observe_seconds']:.1f} | {s['verify_seconds']:.1f}"
            if s
            else "– | – | – | – | –"
        )
        print(
            f"| {c} | {level['tokens']} | {level['seconds']:.1f} | {level['tokens_per_second']:.2f} | "
            f"{level['tokens_per_second'] / results[0]['tokens_per_second']:.2f}× | {level['mean_latency_s']:.1f} | {spec} |",
            flush=True,
        )
    report[args.label] = {"max_tokens": args.max_tokens, "prompts": len(prompts), "levels": results}
    # Written before comparing, so a mistaken --compare never loses the run.
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"report written to {args.out}")
    if args.compare:
        if args.compare not in report:
            sys.exit(f"--compare {args.compare}: no such label in {args.out}")
        reference = {l["concurrency"]: l["texts"] for l in report[args.compare]["levels"]}
        for level in results:
            ref = reference.get(level["concurrency"])
            if ref is not None:
                same = sum(a == b for a, b in zip(level["texts"], ref))
                print(f"concurrency {level['concurrency']}: {same}/{len(ref)} answers identical to {args.compare}")


if __name__ == "__main__":
    main()
