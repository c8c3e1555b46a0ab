#!/usr/bin/env python3
"""The whole models of tests/data/models on CUDA through the `mpipemoe` CLI, against the logits
and greedy ids that transformers wrote for them (make_models.py).

Run on the GPU machine from the working-tree root, after `. .gpu/device-env.sh`:

    python3 .gpu/models.py BIN_DIR OUT_DIR [--jobs 8] [--backend cuda]

For every family: `mpipemoe logits` of the first stored sequence at one rank and at two thread
ranks (n = 3, S4), and `mpipemoe generate` of the stored prompt (32 new tokens). Every process
compiles its kernels afresh with NVRTC (one CPU core each), so they run side by side. The
logits are held to 5e-3 of the largest reference value where the GPU's f32 products are TF32
(gpu_check measures that and says so; the CPU tests hold 1e-4), and greedy ids are reported
equal or not, with the first position that differs: with TF32 a near tie between two logits can
flip a token (and every later one with it), so a difference is reported rather than failed.
Exit status 1 if a logits check fails or a process fails.
"""

import argparse
import concurrent.futures as futures
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from safetensors.numpy import load_file

TOLERANCE = 5e-3


def run(cmd, timeout):
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout, done.stderr[-1500:], time.monotonic() - start
    except subprocess.TimeoutExpired:
        return 124, "", "timed out", time.monotonic() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("bin")
    parser.add_argument("out")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--timeout", type=int, default=150)
    parser.add_argument("--data", default="tests/data/models")
    args = parser.parse_args()
    cli = os.path.join(args.bin, "mpipemoe")
    families = sorted(
        name for name in os.listdir(args.data) if os.path.isfile(os.path.join(args.data, name, "config.json"))
    )
    # The logits files stay in a temporary folder: only the summary goes to OUT_DIR (a lent
    # machine returns a limited count of files).
    scratch = tempfile.mkdtemp()
    jobs = []
    for family in families:
        expected = load_file(os.path.join(args.data, f"{family}.expected.safetensors"))
        ids = ",".join(str(int(i)) for i in expected["ids"][0])
        prompt = ",".join(str(int(i)) for i in expected["prompt"])
        folder = os.path.join(args.data, family)
        for ranks, extra in [(1, []), (2, ["--partitions", "3", "--strategy", "s4"])]:
            out = os.path.join(scratch, f"logits-{family}-{ranks}.safetensors")
            cmd = [cli, "logits", folder, "--ids", ids, "--out", out, "--overwrite", "--backend", args.backend,
                   "--ranks", str(ranks)] + extra
            jobs.append(("logits", family, ranks, cmd, out, expected))
        cmd = [cli, "generate", folder, "--ids", prompt, "--max-new-tokens", "32", "--backend", args.backend]
        jobs.append(("generate", family, 1, cmd, None, expected))
    failed = False
    rows = []
    with futures.ThreadPoolExecutor(args.jobs) as pool:
        results = pool.map(lambda job: (job, run(job[3], args.timeout)), jobs)
        for (kind, family, ranks, cmd, out, expected), (code, stdout, stderr, seconds) in results:
            row = {"kind": kind, "family": family, "ranks": ranks, "exit": code, "seconds": round(seconds, 1)}
            if code != 0:
                failed = True
                row["error"] = stderr
            elif kind == "logits":
                ours = load_file(out)["logits"]
                ref = expected["logits"][0]
                error = float(np.abs(ours - ref).max() / np.abs(ref).max())
                row["error"] = error
                row["ok"] = error <= TOLERANCE
                failed |= not row["ok"]
            else:
                ours = [int(t) for t in stdout.splitlines()[0].split(",") if t]
                want = [int(t) for t in expected["greedy"]]
                same = next((i for i, (a, b) in enumerate(zip(ours, want)) if a != b), min(len(ours), len(want)))
                row["equal"] = ours == want
                row["first_difference"] = None if ours == want else same
            rows.append(row)
    with open(os.path.join(args.out, "models.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for row in rows:
        if row["exit"] != 0:
            print(f"{row['kind']:8} {row['family']:16} ranks {row['ranks']}: exit {row['exit']} "
                  f"({row['seconds']} s) FAIL\n{row['error']}")
        elif row["kind"] == "logits":
            print(f"logits   {row['family']:16} ranks {row['ranks']}: {row['error']:.2e} "
                  f"({row['seconds']} s) {'ok' if row['ok'] else 'FAIL'}")
        else:
            status = "equal" if row["equal"] else f"differs from token {row['first_difference']}"
            print(f"generate {row['family']:16} ranks 1: 32 greedy ids {status} ({row['seconds']} s)")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
