#!/usr/bin/env python3
"""PyTorch's MoE layers on the same GPU and shapes as `gpu_bench`, at each precision, and ours / theirs.

Comparators, all forward + backward on one GPU, no communication, 8 experts, balanced routing
(`torch_peer.balanced_tokens`: one-hot router rows, every expert the same rows), so both sides
run the same GEMM shapes:

- `eager`: `torch_peer.FastMoE`, the FastMoE-style layer people write (router, softmax, top-k,
  tokens sorted by expert, one GEMM-GELU-GEMM per expert, weighted `index_add` back);
- `grouped`: the same layer with both expert GEMMs as one grouped GEMM each
  (`torch.nn.functional.grouped_mm`, else `torch._grouped_mm`, with device offsets, no host
  sync): what transformers 5's MoE models run by default (`experts_implementation="grouped_mm"`).
  The strictest comparator; where PyTorch refuses a precision in it, the row says why;
- `dense`: `torch.mm`'s (cuBLAS's) rate on one FFN's six GEMMs over the same rows: the ceiling.

Each at three precisions, the ones `gpu_bench` runs: IEEE f32 (`allow_tf32 = False`, PyTorch's
default), TF32 (`allow_tf32 = True`) and bf16 (`torch.autocast(dtype=torch.bfloat16)`, f32
parameters). Every figure is the median of `--repeats` steps timed with CUDA events after three
warm-up steps. With `--ours gpu_bench.json` it prints ours / theirs for every row it can pair
(same shape, tokens, top-k and precision), naming the comparator; with `--before FILE` (this
script's JSON from before `gpu_bench` ran) each PyTorch figure is the mean of the two runs, and
their spread is printed, so the two sides are measured alternately.

    python3 torch_gpu_peer.py [--quick] [--repeats 20] [--json FILE] [--ours gpu_bench.json] [--before FILE]

Needs PyTorch with CUDA; prints a line and exits 0 when there is none, so the GPU run goes on.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = [("GPT3-S", 768, 3072), ("BERT-L", 1024, 4096), ("GPT3-XL", 2048, 8192)]
EXPERTS = 8
PRECISIONS = ["f32", "tf32", "bf16"]


def precision_context(torch, precision):
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    if precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def grouped_mm_fn(torch):
    f = getattr(torch.nn.functional, "grouped_mm", None)
    return f if f is not None else getattr(torch, "_grouped_mm", None)


def autocast_on(torch):
    try:
        return torch.is_autocast_enabled("cuda")
    except TypeError:
        return torch.is_autocast_enabled()


def make_grouped(torch, FastMoE):
    F = torch.nn.functional
    grouped_mm = grouped_mm_fn(torch)

    class GroupedMoE(FastMoE):
        """FastMoE's parameters and routing, each expert GEMM one grouped GEMM over all experts."""

        def forward(self, x):
            n_experts = self.w_in.shape[0]
            probs = (x @ self.router.t()).softmax(dim=-1)
            weights, experts = probs.topk(self.top_k, dim=-1)
            flat = experts.reshape(-1)
            order = flat.argsort(stable=True)
            token = order // self.top_k
            offs = torch.cumsum(torch.bincount(flat, minlength=n_experts), 0, dtype=torch.int32)
            rows = x.index_select(0, token)
            w_in, w_out = self.w_in, self.w_out
            if autocast_on(torch):
                rows, w_in, w_out = rows.bfloat16(), w_in.bfloat16(), w_out.bfloat16()
            hidden = F.gelu(grouped_mm(rows, w_in, offs=offs))
            ys = grouped_mm(hidden, w_out, offs=offs)
            ys = ys.to(x.dtype) * weights.reshape(-1)[order].unsqueeze(1)
            return torch.zeros_like(x).index_add(0, token, ys)

    return GroupedMoE


def timed(torch, step, repeats):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def layer_ms(torch, cls, balanced_tokens, m, h, tokens, top_k, precision, repeats):
    device = torch.device("cuda")
    layer = cls(m, h, EXPERTS, top_k).to(device)
    x = balanced_tokens(tokens, m, EXPERTS, top_k).to(device).requires_grad_()

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with precision_context(torch, precision):
            out = layer(x)
        out.float().sum().backward()

    return timed(torch, step, repeats)


def dense_ms(torch, rows, m, h, precision, repeats):
    device = torch.device("cuda")
    x = torch.randn(rows, m, device=device)
    w1 = torch.randn(m, h, device=device)
    w2 = torch.randn(h, m, device=device)

    def step():
        with precision_context(torch, precision):
            z = x @ w1
            y = z @ w2
            dz = y @ w2.t()
            _ = z.t() @ y
            _ = dz @ w1.t()
            _ = x.t() @ dz

    return timed(torch, step, repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4096 tokens only")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--ours", help="gpu_bench's JSON, for the ours / theirs columns")
    parser.add_argument("--before", help="this script's JSON from an earlier run in the same call")
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

    GroupedMoE = make_grouped(torch, FastMoE) if grouped_mm_fn(torch) else None
    token_counts = [4096] if args.quick else [4096, 16384]
    gpu = torch.cuda.get_device_name(0)
    rows = []
    for name, m, h in SHAPES:
        for tokens in token_counts:
            for top_k in [1, 2]:
                for precision in PRECISIONS:
                    flops = 12.0 * tokens * top_k * m * h
                    entries = [("dense", lambda: dense_ms(torch, tokens * top_k, m, h, precision, args.repeats)),
                               ("eager", lambda: layer_ms(torch, FastMoE, balanced_tokens, m, h, tokens, top_k,
                                                          precision, args.repeats))]
                    if GroupedMoE is not None:
                        entries.append(("grouped", lambda: layer_ms(torch, GroupedMoE, balanced_tokens, m, h, tokens,
                                                                    top_k, precision, args.repeats)))
                    for what, measure in entries:
                        row = {"shape": name, "tokens": tokens, "top_k": top_k, "what": what,
                               "precision": precision, "torch": torch.__version__, "gpu": gpu}
                        try:
                            row["median_ms"] = measure()
                            row["tflops"] = flops / (row["median_ms"] * 1e-3) / 1e12
                        except Exception as e:  # a precision the grouped GEMM refuses, say
                            row["median_ms"] = None
                            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                        torch.cuda.empty_cache()
                        rows.append(row)
                        print(f"{name} {tokens} top-{top_k} {what} {precision}: "
                              + (f"{row['median_ms']:.3f} ms" if row["median_ms"] else row["error"]),
                              file=sys.stderr, flush=True)
    if GroupedMoE is None:
        print("torch_gpu_peer: this PyTorch has no grouped GEMM (grouped_mm / _grouped_mm); no grouped rows")
    key = lambda r: (r["shape"], r["tokens"], r["top_k"], r["what"], r["precision"])
    if args.before:
        try:
            with open(args.before) as f:
                before = {key(r): r for r in json.load(f)}
        except (OSError, ValueError, KeyError) as e:
            before = {}
            print(f"torch_gpu_peer: cannot read {args.before}: {e}")
        for r in rows:
            b = before.get(key(r), {}).get("median_ms")
            if r["median_ms"] and b:
                r["spread"] = abs(r["median_ms"] - b) / min(r["median_ms"], b)
                r["median_ms"] = (r["median_ms"] + b) / 2
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, args.json)
    print(f"PyTorch {torch.__version__} on {gpu}, forward + backward, 8 experts, medians of {args.repeats}"
          + (" (mean of the runs before and after ours)" if args.before else ""))
    print(f"{'shape':<8} {'tokens':>6} {'k':>2} {'prec':<5} {'dense ms':>9} {'eager ms':>9} {'grouped':>9} {'spread':>7}")
    index = {key(r): r for r in rows}
    for name, m, h in SHAPES:
        for tokens in token_counts:
            for top_k in [1, 2]:
                for p in PRECISIONS:
                    cells = [index.get((name, tokens, top_k, w, p), {}).get("median_ms") for w in ["dense", "eager", "grouped"]]
                    spread = max((index.get((name, tokens, top_k, w, p), {}).get("spread") or 0) for w in ["dense", "eager", "grouped"])
                    text = " ".join(f"{c:9.3f}" if c else f"{'-':>9}" for c in cells)
                    print(f"{name:<8} {tokens:>6} {top_k:>2} {p:<5} {text} {spread:7.1%}")
    if not args.ours:
        return 0
    try:
        with open(args.ours) as f:
            ours = json.load(f)
    except (OSError, ValueError) as e:
        print(f"torch_gpu_peer: cannot read {args.ours}: {e}")
        return 0
    print("\nours / theirs (below 1: ours is faster); comparator and precision named on each line")
    for o in ours:
        theirs = []
        # A layer with a shared expert has no PyTorch peer here (theirs have none).
        if o["what"] == "layer" and "shared" not in o["path"]:
            theirs = ["eager", "grouped"]
        elif o["what"] in ("experts", "dense"):
            theirs = ["dense"]
        precision = o["precision"] if o["precision"] in PRECISIONS else None
        for w in theirs:
            t = index.get((o["shape"], o["tokens"], o["top_k"], w, precision), {}).get("median_ms")
            if t and precision:
                print(f"{o['shape']:<8} {o['tokens']:>6} top-{o['top_k']} ours {o['what']} ({o['path']}, {precision}) "
                      f"{o['median_ms']:8.3f} ms / PyTorch {w} ({precision}) {t:8.3f} ms = {o['median_ms'] / t:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
