#!/usr/bin/env python3
"""BENCHMARKS.md's GPU tables from one call's `gpu_bench.json` and `torch_gpu_peer.json`.

    python3 scripts/bench/gpu_table.py GPU_BENCH_JSON TORCH_PEER_JSON

Prints two markdown tables: the layer (ours with cuBLAS at each precision, and the cubecl twin)
beside PyTorch eager and PyTorch's grouped-GEMM layer at the same precision, with both ratios;
and the experts' products (ours) beside cuBLAS's dense rate on the same rows through PyTorch
(`torch.mm`), the GEMM efficiency. Every ratio names its comparator in the column header.
"""
import json
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        ours = json.load(f)
    with open(sys.argv[2]) as f:
        theirs = {(r["shape"], r["tokens"], r["top_k"], r["what"], r["precision"]): r.get("median_ms") for r in json.load(f)}

    def mine(shape, tokens, k, what, path, precision):
        for r in ours:
            if (r["shape"], r["tokens"], r["top_k"], r["what"], r["path"], r["precision"]) == (shape, tokens, k, what, path, precision):
                return r["median_ms"]
        return None

    keys = sorted({(r["shape"], r["tokens"], r["top_k"]) for r in ours},
                  key=lambda k: (["GPT3-S", "BERT-L", "GPT3-XL"].index(k[0]), k[1], k[2]))
    cell = lambda v: f"{v:.2f}" if v else "-"
    ratio = lambda a, b: f"{a / b:.2f}×" if a and b else "-"
    print("| shape | k | precision | ours ms | PyTorch eager ms | ours / eager | PyTorch grouped ms | ours / grouped |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, tokens, k in keys:
        for p in ["f32", "tf32", "bf16"]:
            o = mine(shape, tokens, k, "layer", "cublas", p)
            e = theirs.get((shape, tokens, k, "eager", p))
            g = theirs.get((shape, tokens, k, "grouped", p))
            print(f"| {shape} | {k} | {p} | {cell(o)} | {cell(e)} | {ratio(o, e)} | {cell(g)} | {ratio(o, g)} |")
        o = mine(shape, tokens, k, "layer", "cubecl", "tf32")
        e = theirs.get((shape, tokens, k, "eager", "tf32"))
        print(f"| {shape} | {k} | cubecl (tf32) | {cell(o)} | {cell(e)} | {ratio(o, e)} | | |")
    print()
    print("| shape | k | precision | experts ms (grouped) | experts ms (looped) | cuBLAS dense ms (torch.mm) | efficiency (dense / best experts) |")
    print("|---|---|---|---|---|---|---|")
    for shape, tokens, k in keys:
        for p in ["f32", "tf32", "bf16"]:
            grouped = mine(shape, tokens, k, "experts", "cublas", p)
            looped = mine(shape, tokens, k, "experts", "cublas looped", p)
            dense = theirs.get((shape, tokens, k, "dense", p))
            best = min(v for v in [grouped, looped] if v) if (grouped or looped) else None
            eff = f"{dense / best:.2f}" if dense and best else "-"
            print(f"| {shape} | {k} | {p} | {cell(grouped)} | {cell(looped)} | {cell(dense)} | {eff} |")


if __name__ == "__main__":
    main()
