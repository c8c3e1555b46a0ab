#!/usr/bin/env python3
"""Device time per kernel of one layer step, from cubecl's profiling log.

    python3 scripts/bench/cubecl_profile.py LOG [--steps N]

LOG is what cubecl 0.10 writes with `[profiling.logger] level = "basic"` in `cubecl.toml`
(`scripts/gpu/run.sh`, phase "profile"): one line per kernel launch, `| <duration> | <name> |
<runtime>`, each launch waited for and timed on the device (cubecl-runtime `client.rs`,
`launch_inner`). The run has N steps (default 5: two warm-ups and three timed); every step
launches the same kernels, so the last N · (lines // N) lines are the steps (launches before
them, the layer's initialisation, are left out) and the last of them is the step reported. Prints each kernel kind's launches and device time in that step, largest first, and
the sum. Timing every launch adds a host round trip to each, so the sum is an upper bound on
the step's cubecl kernels, and the cuBLAS kernels appear only as the time the hand-over's
`WaitKernel` spins.
"""
import argparse
import collections
import re
import sys

UNITS = {"s": 1e6, "ms": 1e3, "µs": 1.0, "us": 1.0, "ns": 1e-3}
LINE = re.compile(r"\|\s*([\d.]+)\s*(s|ms|µs|us|ns)\s*\|\s*([^|]+?)\s*\|")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    launches = []
    with open(args.log, encoding="utf-8") as f:
        for line in f:
            m = LINE.match(line)
            if m:
                launches.append((float(m.group(1)) * UNITS[m.group(2)], m.group(3)))
    # Launches before the first step (the layer's initialisation) come first in the log, so
    # the steps are its last `steps · per_step` lines.
    per_step = len(launches) // args.steps if args.steps > 0 else 0
    if per_step == 0:
        sys.exit(f"{len(launches)} timed launches are fewer than {args.steps} steps")
    step = launches[-per_step:]
    kinds = collections.defaultdict(lambda: [0, 0.0])
    for us, name in step:
        kinds[name][0] += 1
        kinds[name][1] += us
    total = sum(us for us, _ in step)
    print(f"{per_step} launches per step; last step's device time {total / 1e3:.3f} ms")
    print(f"{'kernel':<28} {'launches':>8} {'us':>9} {'share':>6}")
    for name, (count, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:<28} {count:>8} {us:>9.1f} {us / total:>6.1%}")


if __name__ == "__main__":
    main()
