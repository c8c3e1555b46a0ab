#!/usr/bin/env python3
"""PyTorch eager beside mpipemoe on the same CPU, shapes and routing, measured alternately.

The PyTorch layer is the FastMoE-style layer written the way PyTorch users write it: a linear
router, softmax, top-k, tokens sorted by expert (`argsort`, `index_select`), one GEMM-GELU-GEMM
per expert over its rows, weighted `index_add` back into token order; dropless, no biases, the
exact (erf) GELU, experts stored as stacked `[n_experts, d_model, d_hidden]` weights. Its router
and tokens follow `mpipemoe_tools::inputs` (one-hot router rows, tokens that send every expert
the same rows), so both sides run the same GEMM shapes.

Each round runs PyTorch here, then this crate's `peer` example as a subprocess
(`target/release/examples/peer`, built by `cargo build --release --example peer`), so drift of
the machine hits both sides alike. Medians over rounds are reported; ratios are ours / PyTorch
(below 1: ours is faster).

    python3 scripts/bench/torch_peer.py [--rounds 5] [--iters 3] [--json docs/benchmarks/peer.json]

Needs PyTorch (CPU is enough); nothing in the build or the tests needs Python.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = [
    # name, d_model, d_hidden, tokens, experts, top_k
    ("GPT3-S", 768, 3072, 4096, 8, 1),
    ("BERT-L", 1024, 4096, 4096, 8, 2),
]


class FastMoE(torch.nn.Module):
    def __init__(self, d_model, d_hidden, n_experts, top_k):
        super().__init__()
        self.top_k = top_k
        router = torch.zeros(n_experts, d_model)
        router[:, :n_experts] = torch.eye(n_experts)
        self.router = torch.nn.Parameter(router)
        bound_in, bound_out = (1 / d_model) ** 0.5, (1 / d_hidden) ** 0.5
        self.w_in = torch.nn.Parameter(torch.empty(n_experts, d_model, d_hidden).uniform_(-bound_in, bound_in))
        self.w_out = torch.nn.Parameter(torch.empty(n_experts, d_hidden, d_model).uniform_(-bound_out, bound_out))

    def forward(self, x):
        n_experts = self.w_in.shape[0]
        probs = (x @ self.router.t()).softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=n_experts).tolist()
        rows = x.index_select(0, token)
        outs = [
            F.gelu(part @ self.w_in[e]) @ self.w_out[e]
            for e, part in enumerate(rows.split(counts))
        ]
        ys = torch.cat(outs) * weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add(0, token, ys)


def balanced_tokens(tokens, d_model, n_experts, top_k):
    """The token scheme of mpipemoe_tools::inputs::balanced_tokens (other values differ)."""
    g = torch.Generator().manual_seed(5)
    x = torch.rand(tokens, d_model, generator=g) * 2 - 1
    x[:, :n_experts] = 0
    for j in range(top_k):
        cols = (torch.arange(tokens) * top_k + j) % n_experts
        x[torch.arange(tokens), cols] = float(4 + top_k - j)
    return x


def torch_layer_ms(shape, iters, cache):
    name, m, h, tokens, e, k = shape
    if name not in cache:
        layer = FastMoE(m, h, e, k)
        x = balanced_tokens(tokens, m, e, k).requires_grad_()
        cache[name] = (layer, x)
        layer(x).sum().backward()  # warm-up
    layer, x = cache[name]
    times = []
    for _ in range(iters):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        start = time.perf_counter()
        layer(x).sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def torch_gelu_ns(elements, cache):
    if "gelu" not in cache:
        g = torch.Generator().manual_seed(1)
        cache["gelu"] = (torch.rand(elements, generator=g) * 8 - 4, torch.rand(elements, generator=g) * 2 - 1)
    x, grad = cache["gelu"]
    start = time.perf_counter()
    F.gelu(x)
    forward = time.perf_counter() - start
    start = time.perf_counter()
    torch.ops.aten.gelu_backward(grad, x)
    backward = time.perf_counter() - start
    return forward * 1e9 / elements, backward * 1e9 / elements


def ours(binary, args):
    out = subprocess.run([binary, *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--elements", type=int, default=4096 * 3072)
    parser.add_argument("--binary", default="target/release/examples/peer")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if not os.path.exists(args.binary):
        sys.exit(f"{args.binary} is missing: run `cargo build --release --example peer` first")
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    cache = {}
    samples = {"gelu": {k: [] for k in ["torch_fwd", "torch_bwd", "ours_fwd", "ours_bwd",
                                        "before_fwd", "before_bwd", "flex_fwd", "flex_bwd"]}}
    for shape in SHAPES:
        samples[shape[0]] = {"torch": [], "ours": [], "ours_system_heap": []}
    for r in range(args.rounds):
        # GELU: one PyTorch round (after a warm-up call), then one round of ours.
        torch_gelu_ns(args.elements, cache)
        fwd, bwd = torch_gelu_ns(args.elements, cache)
        samples["gelu"]["torch_fwd"].append(fwd)
        samples["gelu"]["torch_bwd"].append(bwd)
        row = ours(args.binary, ["gelu", "--elements", str(args.elements), "--rounds", "3"])
        for side in ["ours", "before", "flex"]:
            samples["gelu"][f"{side}_fwd"].append(row[f"{side}_forward_ns"])
            samples["gelu"][f"{side}_bwd"].append(row[f"{side}_backward_ns"])
        for shape in SHAPES:
            name, m, h, tokens, e, k = shape
            samples[name]["torch"].append(torch_layer_ms(shape, args.iters, cache))
            layer_args = ["layer", "--d-model", str(m), "--d-hidden", str(h), "--tokens", str(tokens),
                          "--experts", str(e), "--top-k", str(k), "--iters", str(args.iters)]
            # Ours with the binaries' heap setting (freed memory kept, the default) and with
            # glibc's defaults, alternately, so the setting's share is measured in this run.
            for heap, column in [("keep", "ours"), ("system", "ours_system_heap")]:
                row = ours(args.binary, [*layer_args, "--heap", heap])
                samples[name][column].append(row["median_ms"])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    med = {what: {k: statistics.median(v) for k, v in cols.items()} for what, cols in samples.items()}
    g = med["gelu"]
    print(f"PyTorch {torch.__version__}, {threads} threads; {args.rounds} alternating rounds, medians")
    print("| GELU, ns per element | forward | backward |")
    print("|---|---|---|")
    for side, label in [("ours", "mpipemoe (vectorised, every core)"),
                        ("before", "mpipemoe before (libm erff, every core)"),
                        ("flex", "burn Flex's own kernels"),
                        ("torch", "PyTorch eager")]:
        print(f"| {label} | {g[side + '_fwd']:.2f} | {g[side + '_bwd']:.2f} |")
    print("| layer fwd+bwd | tokens | top-k | PyTorch ms | ours ms | ours / PyTorch "
          "| ours, glibc's default heap, ms | that / PyTorch |")
    print("|---|---|---|---|---|---|---|---|")
    for name, m, h, tokens, e, k in SHAPES:
        t, o, d = med[name]["torch"], med[name]["ours"], med[name]["ours_system_heap"]
        print(f"| {name} ({m}/{h}, {e} experts) | {tokens} | {k} | {t:.1f} | {o:.1f} | {o / t:.2f} "
              f"| {d:.1f} | {d / t:.2f} |")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"torch": torch.__version__, "threads": threads, "rounds": args.rounds,
                       "iters": args.iters, "samples": samples, "medians": med}, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
