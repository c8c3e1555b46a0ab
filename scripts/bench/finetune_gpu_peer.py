#!/usr/bin/env python3
"""Whole-model fine-tuning on one GPU beside transformers, at the same precision.

The 163 M Qwen3-MoE of `models_peer.py` (written there by transformers, seed 0, if it is not
yet in target/bench/qwen3-moe-163m) fine-tuned by `mpipemoe finetune --backend cuda` and by
transformers with torch eager on the same GPU, the same batches (the Rust side's window draw,
repeated in `models_peer.py`), AdamW (lr 1e-4, no weight decay), float32 weights, in separate
processes alternating round by round. Per side: the median step after two warm-up steps
(a step ends when its loss is read, a host wait on both sides), and the process's peak GPU
memory, measured alike on both sides: its used memory as `nvidia-smi` reports it, sampled
every 100 ms (each side's CUDA context included). torch's own allocator peaks are printed
beside it.

The precisions, named for each side:
- `tf32`: ours, the experts' GEMMs on cuBLAS in TF32 (`--gemm-precision tf32`), and so are
  the router's, attention's and the head's (`DenseProducts`; the attention scores stay on
  cubecl's kernels, f32 operands in TF32 on CUDA); torch,
  `allow_tf32 = True` (every f32 product in TF32).
- `bf16`: ours, the experts' GEMMs on bf16 copies of their operands with f32 accumulation
  (`--gemm-precision bf16`), the dense products' too, activations f32; torch, autocast to
  bf16 (every linear layer's operands and outputs bf16, f32 accumulation) and TF32 for what
  stays f32. torch lowers more of its step than ours does, so for speed it is the stricter
  comparator.

With `--lora R`, the fine-tuning is LoRA's (issue 58's pair on CUDA): ours with
`--lora-rank R --lora-alpha 2R` on q/k/v/o and the experts, against PEFT's `LoraConfig` of the
same rank, alpha and targets (`target_parameters` for the stacked experts), and our own full
fine-tuning beside them for the memory a LoRA run saves. The cuBLAS path's whole-partition
calls take no adapters (`Library::find`), so with `--lora` our experts run on the primitives,
each step's products of every expert one cuBLAS section at the precision asked
(`exchange/products.rs`, `ExpertPath::matmuls`), and the report says so.

    python3 scripts/bench/finetune_gpu_peer.py --binary .gpu/bin/mpipemoe [--precision tf32 bf16]
        [--rounds 2] [--steps 8] [--batch 16] [--seq-len 256] [--backend cuda|cuda-fusion]
        [--threads 8] [--lora R] [--json OUT.json]

Needs a CUDA build of `mpipemoe` (scripts/gpu/build.sh), an NVIDIA GPU with `nvidia-smi`, and
PyTorch with CUDA, transformers and tokenizers.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models_peer  # noqa: E402  (the model, the corpus and torch's side)


def gpu_used_mib(pid):
    """The GPU memory `nvidia-smi` reports for process `pid` (0 when it has none yet)."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    used = 0
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            used += int(fields[1])
    return used


def sampled(cmd, env):
    """Runs `cmd`, sampling its GPU memory every 100 ms: (stdout, stderr, peak MiB); exits with
    its standard error's tail where it fails."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, gpu_used_mib(proc.pid))
        time.sleep(0.1)
    out, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])}: exit {proc.returncode}\n{err[-3000:]}")
    return out, err, peak


def run_sampled(cmd, env):
    """Runs `cmd` as `sampled` does; returns its stdout's last line as JSON, with the peak (MiB)
    and the wall time."""
    start = time.perf_counter()
    out, err, peak = sampled(cmd, env)
    lines = out.strip().splitlines()
    if not lines:
        sys.exit(f"{' '.join(cmd[:3])}: no summary on stdout\n{err[-3000:]}")
    summary = json.loads(lines[-1])
    summary["gpu_peak_mib"] = peak
    summary["wall_s"] = time.perf_counter() - start
    return summary


def prepare(binary, threads):
    """The checks before a GPU pair runs, the model written where it is not yet: the binary's
    absolute path, and the environment both sides run in (`threads` CPU threads each)."""
    if shutil.which("nvidia-smi") is None:
        sys.exit("nvidia-smi is not on PATH: this benchmark runs on an NVIDIA GPU")
    binary = os.path.abspath(binary)
    if not os.access(binary, os.X_OK):
        sys.exit(f"{binary} is missing: scripts/gpu/build.sh")
    models_peer.make_model()
    return binary, dict(os.environ, RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", required=True, help="a CUDA build of mpipemoe")
    parser.add_argument("--precision", nargs="+", choices=["tf32", "bf16"], default=["tf32", "bf16"])
    parser.add_argument("--backend", choices=["cuda", "cuda-fusion"], default="cuda")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=8, help="CPU threads of each side (torch's and rayon's)")
    parser.add_argument("--lora", type=int, help="LoRA of this rank on both sides (and our full fine-tuning beside)")
    parser.add_argument("--json")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 3:
        sys.exit("--steps must be at least 3 (two warm-up steps and one timed)")
    if args.lora is not None and not 1 <= args.lora <= 1024:
        sys.exit(f"--lora {args.lora}: expected a rank from 1 to 1024")
    if args.side:
        print(json.dumps(models_peer.torch_finetune(args.steps, args.threads, lora=args.lora, device="cuda",
                                                    precision=args.side, batch=args.batch, seq=args.seq_len)))
        return
    binary, env = prepare(args.binary, args.threads)
    out_dir = os.path.join(models_peer.BENCH, "qwen3-moe-163m-tuned-gpu")
    sides_of = ["ours", "torch"] + (["ours_full"] if args.lora else [])
    rows = {p: {side: [] for side in sides_of} for p in args.precision}
    lora = []
    if args.lora:
        lora = ["--lora-rank", str(args.lora), "--lora-alpha", str(2 * args.lora), "--lora-targets",
                "q_proj,k_proj,v_proj,o_proj,experts"]
    for round_ in range(args.rounds):
        for precision in args.precision:
            full_cmd = [binary, "--heap", "keep", "finetune", models_peer.MODEL, "--data", models_peer.CORPUS,
                        "--steps", str(args.steps), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
                        "--lr", str(models_peer.LR), "--seed", str(models_peer.SEED), "--out", out_dir,
                        "--overwrite", "--json", "--backend", args.backend, "--gemm-precision", precision]
            torch_cmd = [sys.executable, __file__, "--binary", binary, "--side", precision, "--steps",
                         str(args.steps), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
                         "--threads", str(args.threads)] + (["--lora", str(args.lora)] if args.lora else [])
            # The sides alternate which goes first from round to round.
            sides = [("ours", full_cmd + lora), ("torch", torch_cmd)]
            if args.lora:
                sides.append(("ours_full", full_cmd))
            for side, cmd in sides if round_ % 2 == 0 else sides[::-1]:
                rows[precision][side].append(run_sampled(cmd, env))
            ours, theirs = rows[precision]["ours"][-1], rows[precision]["torch"][-1]
            if ours["data_tokens"] != theirs["data_tokens"]:
                sys.exit(f"the sides tokenised the data differently: {ours['data_tokens']} vs {theirs['data_tokens']}")
            print(f"round {round_ + 1}, {precision}: step ours "
                  f"{models_peer.median_after_warm_up(ours['step_seconds']):.4f} s, torch "
                  f"{models_peer.median_after_warm_up(theirs['step_seconds']):.4f} s", file=sys.stderr)
    tokens = args.batch * args.seq_len
    what = f"LoRA rank {args.lora} (alpha {2 * args.lora}) on q/k/v/o and the experts, torch with PEFT" \
        if args.lora else "full fine-tuning"
    print(f"{args.batch} × {args.seq_len} tokens a step, {args.steps} steps, {args.rounds} rounds (medians); "
          f"ours --backend {args.backend}; {what}")
    if args.lora:
        print("  ours with adapters: the experts on the primitives, each step's products one cuBLAS section "
              "at the precision asked (the cuBLAS path's whole-partition calls take no adapters)")
    print(f"{'precision':10} {'ours tok/s':>11} {'torch tok/s':>12} {'ours/torch':>11} "
          f"{'ours GPU MiB':>13} {'torch GPU MiB':>14} {'ours/torch':>11} {'torch alloc/reserved MiB':>25}")
    for precision, sides in rows.items():
        step = {s: statistics.median(models_peer.median_after_warm_up(r["step_seconds"]) for r in v)
                for s, v in sides.items()}
        peak = {s: statistics.median(r["gpu_peak_mib"] for r in v) for s, v in sides.items()}
        alloc = statistics.median(r["max_allocated_mib"] for r in sides["torch"])
        reserved = statistics.median(r["max_reserved_mib"] for r in sides["torch"])
        # nvidia-smi lists a process once its context exists; a side it never saw has no peak.
        memory = f"{peak['ours'] / peak['torch']:11.2f}" if min(peak.values()) > 0 else f"{'n/a':>11}"
        print(f"{precision:10} {tokens / step['ours']:11.0f} {tokens / step['torch']:12.0f} "
              f"{step['torch'] / step['ours']:11.2f} {peak['ours']:13.0f} {peak['torch']:14.0f} "
              f"{memory} {alloc:12.0f} / {reserved:.0f}")
        first = (sides["ours"][0]["losses"][0], sides["torch"][0]["losses"][0])
        print(f"  first step's loss: ours {first[0]:.5f}, torch {first[1]:.5f}")
        if args.lora:
            full_step = statistics.median(models_peer.median_after_warm_up(r["step_seconds"])
                                          for r in sides["ours_full"])
            full_peak = statistics.median(r["gpu_peak_mib"] for r in sides["ours_full"])
            share = f"{peak['ours'] / full_peak:.2f}" if full_peak > 0 else "n/a"
            print(f"  ours, full fine-tuning: {tokens / full_step:.0f} tokens/s, {full_peak:.0f} GPU MiB; "
                  f"ours LoRA / ours full GPU memory: {share}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batch": args.batch, "seq": args.seq_len, "steps": args.steps, "backend": args.backend,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
