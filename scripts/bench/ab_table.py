#!/usr/bin/env python3
"""The table of `scripts/gpu/run.sh`'s `ab` phase: two builds timed alternately in one call.

    python3 scripts/bench/ab_table.py OUT_DIR

Reads OUT_DIR/ab-bench-{main,alt}-ROUND.json (gpu_bench's rows) and, where they exist,
OUT_DIR/ab-finetune-{main,alt}-ROUND.json (`mpipemoe finetune --json`). For each row that both
sides measured, each side's figure is the median over its rounds of the round's median; the
spread is the smallest and largest of those. The ratio is alt / main: below 1 the alt build is
faster. A side's rounds that differ by more than the two sides do say the difference is noise,
so read the ratio beside both spreads.

Exits 1 when a side has no readable run, or when the sides share no row.
"""

import glob
import json
import os
import re
import statistics
import sys

SIDES = ("main", "alt")


def runs(out, kind):
    """{side: [parsed JSON of each round, in round order]} for ab-KIND-SIDE-ROUND.json."""
    found = {side: [] for side in SIDES}
    pattern = re.compile(rf"ab-{kind}-(main|alt)-(\d+)\.json$")
    for path in sorted(glob.glob(os.path.join(out, f"ab-{kind}-*.json"))):
        m = pattern.search(os.path.basename(path))
        if not m:
            continue
        try:
            with open(path) as f:
                found[m.group(1)].append((int(m.group(2)), json.load(f)))
        except (OSError, ValueError) as e:
            print(f"skipped {path}: {e}", file=sys.stderr)
    return {side: [d for _, d in sorted(rounds, key=lambda r: r[0])] for side, rounds in found.items()}


def bench_rows(rounds):
    """{row key: [median ms of each round]} over gpu_bench's rows."""
    rows = {}
    for data in rounds:
        for r in data:
            key = (r["shape"], r["tokens"], r["top_k"], r["what"], r["path"], r["precision"])
            rows.setdefault(key, []).append(r["median_ms"])
    return rows


def spread(values):
    return f"{min(values):.3f}-{max(values):.3f}"


def line(label, main, alt):
    """One table line: each side's median, alt / main, each side's spread and run count."""
    m, a = statistics.median(main), statistics.median(alt)
    return (
        f"| {label} | {m:.3f} | {a:.3f} | {a / m:.3f} | {spread(main)} | {spread(alt)} | "
        f"{len(main)}/{len(alt)} |"
    )


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    bench = runs(out, "bench")
    if not all(bench[side] for side in SIDES):
        counts = ", ".join(f"{side} {len(bench[side])}" for side in SIDES)
        sys.exit(f"ab_table: a side has no readable gpu_bench run in {out} ({counts})")
    main_rows, alt_rows = bench_rows(bench["main"]), bench_rows(bench["alt"])
    shared = [k for k in main_rows if k in alt_rows]
    if not shared:
        sys.exit("ab_table: the two builds measured no row in common")
    print("gpu_bench, ms a layer step (median of the rounds' medians); ratio alt / main")
    print("| row | main | alt | alt / main | main's rounds | alt's rounds | rounds |")
    print("|---|---|---|---|---|---|---|")
    for key in shared:
        shape, tokens, top_k, what, path, precision = key
        label = f"{shape} {tokens} top-{top_k} {what} {path} {precision}"
        print(line(label, main_rows[key], alt_rows[key]))
    only = sorted(set(main_rows) ^ set(alt_rows))
    if only:
        print(f"rows measured by one side only: {len(only)}")
    tune = runs(out, "finetune")
    if any(tune[side] for side in SIDES):
        if not all(tune[side] for side in SIDES):
            sys.exit("ab_table: fine-tuning ran on one side only")
        print()
        print("mpipemoe finetune (tiny Qwen3-MoE): median step ms of each run; ratio alt / main")
        print("| figure | main | alt | alt / main | main's runs | alt's runs | runs |")
        print("|---|---|---|---|---|---|---|")
        step = {side: [d["median_step_s"] * 1e3 for d in tune[side]] for side in SIDES}
        print(line("median step, ms", step["main"], step["alt"]))
        rate = {side: [d["tokens_per_s"] for d in tune[side]] for side in SIDES}
        print(line("tokens/s", rate["main"], rate["alt"]))
        for side in SIDES:
            losses = [round(d["final_loss"], 4) for d in tune[side]]
            print(f"{side}'s final losses: {losses}")


if __name__ == "__main__":
    main()
