#!/usr/bin/env python3
"""PyTorch eager's FastMoE-style layer on the same GPU and shapes as `gpu_bench`, and ours / theirs.

The PyTorch layer is `torch_peer.FastMoE` (router, softmax, top-k, tokens sorted by expert, one
GEMM-GELU-GEMM per expert, weighted `index_add` back; dropless, exact GELU), forward + backward,
f32, one GPU, no communication. The comparator on our side is `gpu_bench`'s `compute_only_ms`:
our layer at n = 1 on one rank (no exchange), the same work. Routing differs: PyTorch gets the
balanced tokens of `torch_peer.balanced_tokens` (every expert the same rows), ours a random router
over random tokens, whose busiest expert gets more rows; that only makes ours slower, so the
ratio is conservative for us.

    python3 torch_gpu_peer.py [--quick] [--json FILE] [--ours gpu_bench.json]

Medians of 5 timed passes after 2 warm-up passes, `torch.cuda.synchronize()` around each.
Needs PyTorch with CUDA; prints a line and exits 0 when there is none, so the GPU run goes on.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = [("GPT3-S", 768, 3072), ("BERT-L", 1024, 4096), ("GPT3-XL", 2048, 8192)]
EXPERTS, TOP_K = 8, 1


def layer_ms(torch, FastMoE, balanced_tokens, m, h, tokens):
    device = torch.device("cuda")
    layer = FastMoE(m, h, EXPERTS, TOP_K).to(device)
    x = balanced_tokens(tokens, m, EXPERTS, TOP_K).to(device).requires_grad_()

    def once():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        torch.cuda.synchronize()
        start = time.perf_counter()
        layer(x).sum().backward()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(2):
        once()
    return statistics.median(once() for _ in range(5)) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4096 tokens only")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--ours", help="gpu_bench's JSON, for the ours / theirs column")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("torch_gpu_peer: PyTorch is not installed here; no peer figures")
        return 0
    if not torch.cuda.is_available():
        print("torch_gpu_peer: PyTorch has no CUDA device here; no peer figures")
        return 0
    from torch_peer import FastMoE, balanced_tokens

    ours = {}
    if args.ours:
        try:
            with open(args.ours) as f:
                for row in json.load(f):
                    ours[(row["shape"], row["tokens"])] = row["compute_only_ms"]
        except (OSError, ValueError, KeyError) as e:
            print(f"torch_gpu_peer: cannot read {args.ours}: {e}")
    token_counts = [4096] if args.quick else [4096, 8192, 16384, 32768]
    rows = []
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}, f32, forward + backward")
    print(f"{'shape':<8} {'tokens':>6} {'torch ms':>9} {'ours ms':>9} {'ours/torch':>10}")
    for name, m, h in SHAPES:
        for tokens in token_counts:
            theirs = layer_ms(torch, FastMoE, balanced_tokens, m, h, tokens)
            mine = ours.get((name, tokens))
            ratio = mine / theirs if mine else None
            rows.append(
                {
                    "shape": name,
                    "tokens": tokens,
                    "torch_ms": theirs,
                    "ours_compute_only_ms": mine,
                    "ours_over_torch": ratio,
                    "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(0),
                }
            )
            mine_text = f"{mine:9.2f}" if mine else f"{'-':>9}"
            ratio_text = f"{ratio:10.2f}" if ratio else f"{'-':>10}"
            print(f"{name:<8} {tokens:>6} {theirs:9.2f} {mine_text} {ratio_text}")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
