#!/usr/bin/env python3
"""Issue 34's measurement: the toy GPT-MoE at 2 ranks with the library's gradient sync against
the host f64 sync it replaced, side by side in one run (interleaved repetitions), same data.

Usage: python3 scripts/bench/grad_sync.py [--reps 3] [--steps 300] [--data FILE]
Needs `cargo build --release -p mpipemoe-tools --example train_gpt_moe` first. Prints each
run, then per variant the median tokens/s and median per-step sync time, and checks that both
variants computed the same losses to f32 rounding (relative 1e-5).
"""
import argparse, hashlib, json, statistics, subprocess, sys

p = argparse.ArgumentParser()
p.add_argument("--reps", type=int, default=3)
p.add_argument("--steps", type=int, default=300)
p.add_argument("--data", default="docs/design-notes.md")
p.add_argument("--bin", default="target/release/examples/train_gpt_moe")
a = p.parse_args()

digest = hashlib.sha256(open(a.data, "rb").read()).hexdigest()[:12]
print(f"data {a.data} (sha256 {digest}), 2 ranks, {a.steps} steps, {a.reps} interleaved repetitions")
runs = {"library": [], "host-f64": []}
for rep in range(a.reps):
    for variant in runs:
        out = subprocess.run(
            [a.bin, "--ranks", "2", "--steps", str(a.steps), "--eval-every", str(a.steps),
             "--data", a.data, "--grad-sync", variant, "--json"],
            check=True, capture_output=True, text=True).stdout
        r = json.loads(out)
        runs[variant].append(r)
        print(f"  rep {rep} {variant:8}: {r['tokens_per_s']:8.0f} tokens/s, sync median "
              f"{r['sync_s_median'] * 1e3:6.2f} ms/step, last loss {r['losses'][-1]:.5f}")
for variant, rs in runs.items():
    print(f"{variant:8}: median {statistics.median(x['tokens_per_s'] for x in rs):8.0f} tokens/s, "
          f"sync {statistics.median(x['sync_s_median'] for x in rs) * 1e3:6.2f} ms/step")
lib, host = runs["library"][0]["losses"], runs["host-f64"][0]["losses"]
worst = max(abs(x - y) / abs(y) for x, y in zip(lib, host))
print(f"largest relative loss difference library vs host-f64 over {len(lib)} steps: {worst:.2e}")
tl = statistics.median(x["tokens_per_s"] for x in runs["library"])
th = statistics.median(x["tokens_per_s"] for x in runs["host-f64"])
sl = statistics.median(x["sync_s_median"] for x in runs["library"])
sh = statistics.median(x["sync_s_median"] for x in runs["host-f64"])
print(f"ratios (library over host-f64): tokens/s {tl / th:.3f}, sync time {sl / sh:.3f}")
sys.exit(0 if worst <= 1e-5 else 1)
