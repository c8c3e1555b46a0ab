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
        [--compare OTHER_PEER_BINARY] [--system-heap]

The GELU rows are measured on two inputs: uniform on [-4, 4] (half the elements in the tails,
where an exact GELU costs most) and standard normal (the scale of a layer's pre-activations).
`--compare` times a second build of `peer` (another commit) in the same rounds, so a before /
after ratio is measured side by side; `--system-heap` adds a column with glibc's default heap.

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


GELU_INPUTS = ["uniform", "normal"]


def torch_gelu_ns(elements, input_kind, cache):
    key = "gelu-" + input_kind
    if key not in cache:
        g = torch.Generator().manual_seed(1)
        if input_kind == "uniform":
            x = torch.rand(elements, generator=g) * 8 - 4
        else:
            x = torch.randn(elements, generator=g)
        cache[key] = (x, torch.rand(elements, generator=g) * 2 - 1)
    x, grad = cache[key]
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
    parser.add_argument("--compare", help="a second peer binary (another build), timed in the same rounds")
    parser.add_argument("--system-heap", action="store_true", help="also time ours with glibc's default heap")
    args = parser.parse_args()
    for binary in [args.binary] + ([args.compare] if args.compare else []):
        if not os.path.exists(binary):
            sys.exit(f"{binary} is missing: run `cargo build --release --example peer` first")
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    cache = {}
    sides = ["ours"] + (["compare"] if args.compare else [])
    binaries = {"ours": args.binary, "compare": args.compare}
    samples = {}
    for kind in GELU_INPUTS:
        samples["gelu-" + kind] = {f"{side}_{d}": [] for side in ["torch", *sides, "before", "flex"]
                                   for d in ["fwd", "bwd"]}
    for shape in SHAPES:
        samples[shape[0]] = {side: [] for side in ["torch", *sides]}
        if args.system_heap:
            samples[shape[0]]["ours_system_heap"] = []
    for r in range(args.rounds):
        for kind in GELU_INPUTS:
            # GELU: one PyTorch round (after a warm-up call), then one round of each build.
            col = samples["gelu-" + kind]
            torch_gelu_ns(args.elements, kind, cache)
            fwd, bwd = torch_gelu_ns(args.elements, kind, cache)
            col["torch_fwd"].append(fwd)
            col["torch_bwd"].append(bwd)
            for side in sides:
                row = ours(binaries[side], ["gelu", "--elements", str(args.elements), "--rounds", "3",
                                            "--input", kind])
                col[f"{side}_fwd"].append(row["ours_forward_ns"])
                col[f"{side}_bwd"].append(row["ours_backward_ns"])
                if side == "ours":
                    for other in ["before", "flex"]:
                        col[f"{other}_fwd"].append(row[f"{other}_forward_ns"])
                        col[f"{other}_bwd"].append(row[f"{other}_backward_ns"])
        for shape in SHAPES:
            name, m, h, tokens, e, k = shape
            samples[name]["torch"].append(torch_layer_ms(shape, args.iters, cache))
            layer_args = ["layer", "--d-model", str(m), "--d-hidden", str(h), "--tokens", str(tokens),
                          "--experts", str(e), "--top-k", str(k), "--iters", str(args.iters)]
            for side in sides:
                samples[name][side].append(ours(binaries[side], layer_args)["median_ms"])
            if args.system_heap:
                row = ours(args.binary, [*layer_args, "--heap", "system"])
                samples[name]["ours_system_heap"].append(row["median_ms"])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    med = {what: {k: statistics.median(v) for k, v in cols.items()} for what, cols in samples.items()}
    print(f"PyTorch {torch.__version__}, {threads} threads; {args.rounds} alternating rounds, medians")
    labels = [("ours", "mpipemoe (this build)"), ("compare", f"mpipemoe ({args.compare})"),
              ("before", "mpipemoe before issue 22 (libm erff, every core)"),
              ("flex", "burn Flex's own kernels"), ("torch", "PyTorch eager")]
    print("| GELU, ns per element | uniform [-4, 4]: forward | backward | standard normal: forward | backward |")
    print("|---|---|---|---|---|")
    for side, label in labels:
        if side == "compare" and not args.compare:
            continue
        u, n = med["gelu-uniform"], med["gelu-normal"]
        print(f"| {label} | {u[side + '_fwd']:.2f} | {u[side + '_bwd']:.2f} "
              f"| {n[side + '_fwd']:.2f} | {n[side + '_bwd']:.2f} |")
    print("| layer fwd+bwd | tokens | top-k | PyTorch ms | ours ms | ours / PyTorch | other columns |")
    print("|---|---|---|---|---|---|---|")
    for name, m, h, tokens, e, k in SHAPES:
        t, o = med[name]["torch"], med[name]["ours"]
        extra = []
        if args.compare:
            c = med[name]["compare"]
            extra.append(f"compare {c:.1f} ms ({c / t:.2f} of PyTorch; ours / compare {o / c:.3f})")
        if args.system_heap:
            d = med[name]["ours_system_heap"]
            extra.append(f"glibc heap {d:.1f} ms ({d / t:.2f})")
        print(f"| {name} ({m}/{h}, {e} experts) | {tokens} | {k} | {t:.1f} | {o:.1f} | {o / t:.2f} "
              f"| {'; '.join(extra)} |")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"torch": torch.__version__, "threads": threads, "rounds": args.rounds,
                       "binary": args.binary, "compare": args.compare,
                       "iters": args.iters, "samples": samples, "medians": med}, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
