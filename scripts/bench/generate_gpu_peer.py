#!/usr/bin/env python3
"""Whole-model generation on one GPU beside transformers, at the same precision.

The 163 M Qwen3-MoE of `models_peer.py` (written there by transformers, seed 0, if it is not
yet in target/bench/qwen3-moe-163m), greedy, 64 new tokens, two workloads:

- one prompt of 64 tokens (a decode step is one row: each product is a few-row GEMV);
- a batch of 8 prompts of 64 down to 15 tokens, left-padded, as `models_peer.py` sends them.

Three sides, separate processes, alternating from round to round:

- `ours cuBLAS`: `mpipemoe generate --backend cuda --gemm cublas --gemm-precision P`; the MoE
  layers' products and the model's dense products (attention's projections, the head) on
  cuBLAS, one section a product (`DenseProducts`), the attention scores on cubecl's kernels;
- `ours cubecl`: the same with `--gemm cubecl`: every product on cubecl's kernels, which
  multiply f32 in TF32 whatever is asked, so this side is shown at `tf32` only. Beside the
  cuBLAS side it says what a cuBLAS section costs a decode step against a cubecl launch;
- `transformers`: `generate(do_sample=False)` with torch eager on the same GPU, TF32 on
  (`allow_tf32`) for `tf32`, autocast to bf16 for `bf16`.

Each process generates `--repeats` times (ours: `generate --repeats`); the first run also
compiles and tunes kernels (NVRTC and cubecl's autotuning on ours, cuBLAS's heuristics and
torch's lazy init on theirs), so a side's figure is the median new tokens/s of the later runs,
prefill included (the batch's prefill is a real share of its call on both sides). Ours stops
at an end-of-sequence id where one comes, transformers does not (`eos_token_id=None`): tokens/s
counts the tokens each side made. Peak GPU memory: the process's used memory as `nvidia-smi`
reports it, sampled every 100 ms (each side's CUDA context included). The ids are compared with
transformers' and the equal prefix printed: under TF32 both sides round differently, and a near
tie may part them (design notes, "Whole models on CUDA").

    python3 scripts/bench/generate_gpu_peer.py --binary .gpu/bin/mpipemoe [--precision tf32 bf16]
        [--rounds 2] [--repeats 4] [--new-tokens 64] [--threads 8] [--json OUT.json]

Needs a CUDA build of `mpipemoe` (scripts/gpu/build.sh), an NVIDIA GPU with `nvidia-smi`, and
PyTorch with CUDA, transformers and tokenizers.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models_peer  # noqa: E402  (the model, the corpus and the prompts)
from finetune_gpu_peer import prepare, sampled  # noqa: E402  (GPU memory sampled as the fine-tuning pair samples it)

PROMPT_LEN = 64


def prompts(workload):
    """The workload's prompts as token-id lists: one of PROMPT_LEN, or the batch of eight."""
    if workload == "batch":
        return models_peer.batch_prompts()
    from tokenizers import Tokenizer

    tokens = Tokenizer.from_file(os.path.join(models_peer.MODEL, "tokenizer.json")).encode(
        open(models_peer.CORPUS).read(), add_special_tokens=False).ids
    return [tokens[:PROMPT_LEN]]


def torch_side(precision, workload, repeats, new_tokens, threads):
    """transformers' greedy generation on CUDA, `repeats` times; each run's seconds (synchronised)
    and the last run's new ids of every prompt."""
    import contextlib
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    rows = prompts(workload)
    width = max(len(p) for p in rows)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in rows], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device="cuda")
    model = AutoModelForCausalLM.from_pretrained(models_peer.MODEL, dtype=torch.float32).to("cuda").eval()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    seconds, out = [], None
    with torch.no_grad(), autocast:
        for _ in range(repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
    new = out[:, width:].tolist()
    return {"seconds": seconds, "new_tokens": sum(len(r) for r in new), "rows": new,
            "max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20}


def ours_side(binary, gemm, precision, workload, repeats, new_tokens, env):
    """`mpipemoe generate` on CUDA with `--repeats`: each run's seconds and new tokens (from its
    `generated N tokens ... in S s` line), the new ids of every prompt, the peak GPU memory."""
    rows = prompts(workload)
    cmd = [binary, "generate", models_peer.MODEL, "--max-new-tokens", str(new_tokens), "--greedy",
           "--repeats", str(repeats), "--backend", "cuda", "--gemm", gemm, "--gemm-precision", precision]
    if workload == "batch":
        path = os.path.join(models_peer.BENCH, "gpu-batch-prompts.txt")
        with open(path, "w") as f:
            f.write("".join(",".join(map(str, p)) + "\n" for p in rows))
        cmd += ["--ids-file", path]
    else:
        cmd += ["--ids", ",".join(map(str, rows[0]))]
    out, err, peak = sampled(cmd, env)
    timed = [line for line in err.splitlines() if line.startswith("generated ")]
    if len(timed) != repeats:
        sys.exit(f"ours ({gemm}): expected {repeats} timing lines, found {len(timed)}\n{err[-3000:]}")
    seconds = [float(line.split(" in ")[1].split(" s ")[0]) for line in timed]
    counts = [int(line.split()[1]) for line in timed]
    if workload == "batch":
        new = [json.loads(line)["ids"] for line in out.splitlines() if line.startswith("{")]
    else:
        new = [[int(i) for i in out.splitlines()[0].split(",") if i]]
    return {"seconds": seconds, "counts": counts, "rows": new, "gpu_peak_mib": peak,
            "notes": [line for line in err.splitlines() if line.startswith("note:")]}


def tokens_per_s(row):
    """The median new tokens/s of the runs after the first (the first compiles and tunes)."""
    counts = row.get("counts") or [row["new_tokens"]] * len(row["seconds"])
    rates = [c / s for c, s in zip(counts, row["seconds"])]
    return statistics.median(rates[1:] if len(rates) > 1 else rates)


def equal_prefix(ours, theirs):
    """The shortest equal prefix over the rows, new tokens."""
    return min(next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), min(len(o), len(t)))
               for o, t in zip(ours, theirs))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--binary", required=True, help="a CUDA build of mpipemoe")
    parser.add_argument("--precision", nargs="+", choices=["tf32", "bf16"], default=["tf32"])
    parser.add_argument("--workload", nargs="+", choices=["single", "batch"], default=["single", "batch"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4, help="generations per process; the first is not timed")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=8, help="CPU threads of each side (torch's and rayon's)")
    parser.add_argument("--json")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 2 <= args.repeats <= 100:
        sys.exit(f"--repeats {args.repeats}: expected 2 to 100 (the first run is not timed)")
    if not 1 <= args.new_tokens <= 512:
        sys.exit(f"--new-tokens {args.new_tokens}: expected 1 to 512")
    if args.side:
        precision, workload = args.side.split(":")
        print(json.dumps(torch_side(precision, workload, args.repeats, args.new_tokens, args.threads)))
        return
    binary, env = prepare(args.binary, args.threads)
    rows = {}
    for round_ in range(args.rounds):
        for precision in args.precision:
            for workload in args.workload:
                key = f"{precision}:{workload}"
                sides = [("ours_cublas", lambda: ours_side(binary, "cublas", precision, workload, args.repeats,
                                                           args.new_tokens, env))]
                if precision == "tf32":
                    sides.append(("ours_cubecl", lambda: ours_side(binary, "cubecl", precision, workload,
                                                                   args.repeats, args.new_tokens, env)))

                def torch_run():
                    cmd = [sys.executable, __file__, "--binary", binary, "--side", key, "--repeats",
                           str(args.repeats), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
                    out, err, peak = sampled(cmd, env)
                    result = json.loads(out.strip().splitlines()[-1])
                    result["gpu_peak_mib"] = peak
                    return result

                sides.append(("torch", torch_run))
                # The sides alternate which goes first from round to round.
                for side, run in sides if round_ % 2 == 0 else sides[::-1]:
                    rows.setdefault(key, {}).setdefault(side, []).append(run())
                got = rows[key]
                print(f"round {round_ + 1}, {key}: " + ", ".join(
                    f"{side} {tokens_per_s(v[-1]):.1f} tok/s" for side, v in got.items()), file=sys.stderr)
    print(f"greedy, {args.new_tokens} new tokens, {args.repeats} generations a process (the first not timed), "
          f"{args.rounds} rounds; medians of new tokens/s, prefill included")
    print(f"{'precision:workload':20} {'side':12} {'tok/s':>9} {'/ torch':>8} {'GPU MiB':>8} {'ids = torch':>12}")
    for key, sides in rows.items():
        theirs = statistics.median(tokens_per_s(r) for r in sides["torch"])
        for side, runs in sides.items():
            rate = statistics.median(tokens_per_s(r) for r in runs)
            peak = statistics.median(r["gpu_peak_mib"] for r in runs)
            same = "" if side == "torch" else f"{equal_prefix(runs[0]['rows'], sides['torch'][0]['rows'])} new"
            print(f"{key:20} {side:12} {rate:9.1f} {rate / theirs:8.2f} {peak:8.0f} {same:>12}")
            for note in sorted({n for r in runs for n in r.get("notes", [])}):
                print(f"  {side}: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
