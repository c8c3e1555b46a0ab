#!/usr/bin/env python3
"""BENCHMARKS.md's GPU tables from one call's `gpu_bench.json` and `torch_gpu_peer.json`.

    python3 scripts/bench/gpu_table.py GPU_BENCH_JSON TORCH_PEER_JSON

Prints two markdown tables: the layer (ours with cuBLAS at each precision, without the batched
calls beside it, with the router's products on cubecl's kernels, in bf16 with the weights'
copies made once a step, and the cubecl twin) beside PyTorch eager and PyTorch's grouped-GEMM layer at
the same precision, with both ratios; and the experts' products (ours: the default path, without
the batched calls, looped, and on skewed rows) beside cuBLAS's dense rate on the same rows
through PyTorch (`torch.mm`), the GEMM efficiency. Every ratio names its comparator in the
column header. Rows a file lacks print as "-" (older files have no unbatched or skewed rows).
Where it has the pipeline's rows (`gpu_bench --pipeline`), a table of the layer with the
emulated exchange at each n and executor against `max(compute, exchange)`, compute being the
layer without an exchange at TF32 and exchange the four round trips alone (the goal: at most
1.10), the rows uploaded from page-locked memory as a CUDA rank without device paths does, or
through burn's pageable upload (`pageable` rows, each against the pageable exchange). Where the file has a timed path's pieces (`experts piece`, `layer piece`), a third table says
where the experts' and the layer's section time goes: each piece's device ms a step, its share,
and the host ms its calls took. Where the layer rows carry the CUPTI census's counts (host
waits, frees, launches through the driver and the runtime, per step, and the ms each thread
spent inside the driver's waits and inside all its calls), a last table lists them beside the goal of at
most two host waits per step at one rank. Where it has the router's
choice rows (`what` = `choice`), a table of the choice made on the device against the host's;
where it has the shared expert's layer rows, a table of the layer with it after the combine and
overlapped with the routing read; where it has the rows run beside a helper that keeps the
device runners from sleeping (`cublas kept busy`), a table of each against the same step
without it, raw and under fusion.
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

    keys = sorted({(r["shape"], r["tokens"], r["top_k"]) for r in ours if r["what"] != "choice"},
                  key=lambda k: (["GPT3-S", "BERT-L", "GPT3-XL"].index(k[0]), k[1], k[2]))
    cell = lambda v: f"{v:.2f}" if v else "-"
    ratio = lambda a, b: f"{a / b:.2f}×" if a and b else "-"
    print("| shape | k | precision | ours ms | ours unbatched ms | PyTorch eager ms | ours / eager | PyTorch grouped ms | ours / grouped |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, tokens, k in keys:
        for p in ["f32", "tf32", "bf16"]:
            o = mine(shape, tokens, k, "layer", "cublas", p)
            u = mine(shape, tokens, k, "layer", "cublas unbatched", p)
            e = theirs.get((shape, tokens, k, "eager", p))
            g = theirs.get((shape, tokens, k, "grouped", p))
            print(f"| {shape} | {k} | {p} | {cell(o)} | {cell(u)} | {cell(e)} | {ratio(o, e)} | {cell(g)} | {ratio(o, g)} |")
        o = mine(shape, tokens, k, "layer", "cubecl", "tf32")
        e = theirs.get((shape, tokens, k, "eager", "tf32"))
        print(f"| {shape} | {k} | cubecl (tf32) | {cell(o)} | | {cell(e)} | {ratio(o, e)} | | |")
        # The router's products on cubecl's kernels, the experts on cuBLAS: two sections a step
        # fewer (TF32 on both sides of that trade).
        o = mine(shape, tokens, k, "layer", "cublas experts only", "tf32")
        if o:
            g = theirs.get((shape, tokens, k, "grouped", "tf32"))
            print(f"| {shape} | {k} | router on cubecl (tf32) | {cell(o)} | | {cell(e)} | {ratio(o, e)} | {cell(g)} | {ratio(o, g)} |")
        # bf16 with the weights' copies made once a step and kept for the backward, as the
        # PyTorch side's autocast keeps its casts (the default path makes them once a pass).
        o = mine(shape, tokens, k, "layer", "cublas weights per step", "bf16")
        if o:
            e = theirs.get((shape, tokens, k, "eager", "bf16"))
            g = theirs.get((shape, tokens, k, "grouped", "bf16"))
            print(f"| {shape} | {k} | bf16, weights once a step | {cell(o)} | | {cell(e)} | {ratio(o, e)} | {cell(g)} | {ratio(o, g)} |")
        # LoRA rank 16 on the experts, base frozen: no PyTorch peer of its own here (the
        # whole-model pair against PEFT is finetune_gpu_peer.py's).
        o = mine(shape, tokens, k, "layer", "cublas lora16", "tf32")
        if o:
            print(f"| {shape} | {k} | LoRA 16 (tf32) | {cell(o)} | | | | | |")
    print()
    # The path's default (batched where experts have equal rows: every expert here) is the
    # figure; the other columns are what it replaced, in the same call, and the default on
    # skewed rows (nothing batches), the routing of a real step.
    print("| shape | k | precision | experts ms (default) | unbatched (grouped) | looped | skewed rows | cuBLAS dense ms (torch.mm) | efficiency (dense / default) | efficiency, skewed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, tokens, k in keys:
        for p in ["f32", "tf32", "bf16"]:
            default = mine(shape, tokens, k, "experts", "cublas", p)
            unbatched = mine(shape, tokens, k, "experts", "cublas unbatched", p)
            looped = mine(shape, tokens, k, "experts", "cublas looped", p)
            skewed = mine(shape, tokens, k, "experts", "cublas skewed", p)
            dense = theirs.get((shape, tokens, k, "dense", p))
            eff = lambda v: f"{dense / v:.2f}" if dense and v else "-"
            print(f"| {shape} | {k} | {p} | {cell(default)} | {cell(unbatched)} | {cell(looped)} | {cell(skewed)} | {cell(dense)} | {eff(default)} | {eff(skewed)} |")

    pipeline(ours, keys)
    shared(ours, keys)
    kept(ours, keys)
    pieces(ours, keys)
    calls(ours, keys)
    choices(ours)


def shared(ours, keys):
    """The layer with a shared expert, issued after the combine and while the routing read is in
    flight (`shared_expert_overlap`), TF32, in the same call."""
    rows = [r for r in ours if r["what"] == "layer" and r["path"] in ("cublas shared", "cublas shared overlap")]
    if not rows:
        return
    print()
    print("| shape | k | with a shared expert, after the combine ms | overlapped with the routing read ms | overlapped / after |")
    print("|---|---|---|---|---|")
    for shape, tokens, k in keys:
        side = lambda path: next((r["median_ms"] for r in rows if (r["shape"], r["tokens"], r["top_k"], r["path"]) == (shape, tokens, k, path)), None)
        after, overlap = side("cublas shared"), side("cublas shared overlap")
        if after or overlap:
            cell = lambda v: f"{v:.2f}" if v else "-"
            ratio = f"{overlap / after:.2f}×" if after and overlap else "-"
            print(f"| {shape} | {k} | {cell(after)} | {cell(overlap)} | {ratio} |")


def kept(ours, keys):
    """The layer at TF32, raw and under fusion, with and without a helper that keeps cubecl's
    and fusion's runner threads from sleeping between the step's blocking calls (`gpu_bench`'s
    `cublas kept busy` rows, same call): below 1.00× the runners' sleep costs the step time."""
    paths = ("cublas", "cublas kept busy", "cublas fusion", "cublas fusion kept busy")
    rows = [r for r in ours if r["what"] == "layer" and r["precision"] == "tf32" and r["path"] in paths]
    if not any(r["path"].endswith("kept busy") for r in rows):
        return
    print()
    print("| shape | k | raw ms | raw, runners kept busy ms | kept / raw | fusion ms | fusion, kept busy ms | kept / fusion |")
    print("|---|---|---|---|---|---|---|---|")
    cell = lambda v: f"{v:.2f}" if v else "-"
    ratio = lambda a, b: f"{a / b:.2f}×" if a and b else "-"
    for shape, tokens, k in keys:
        side = lambda path: next((r["median_ms"] for r in rows if (r["shape"], r["tokens"], r["top_k"], r["path"]) == (shape, tokens, k, path)), None)
        raw, raw_kept, fused, fused_kept = (side(p) for p in paths)
        if raw_kept or fused_kept:
            print(f"| {shape} | {k} | {cell(raw)} | {cell(raw_kept)} | {ratio(raw_kept, raw)} | {cell(fused)} | {cell(fused_kept)} | {ratio(fused_kept, fused)} |")


def choices(ours):
    """The router's choice made on the device and read, against the values read and chosen on
    the host (what the layer ran before), each router's medians measured alternately."""
    rows = [r for r in ours if r["what"] == "choice"]
    if not rows:
        return
    print()
    print("| router | tokens | device ms (kernel + read of the choice) | host ms (read of the values + choice) | host / device |")
    print("|---|---|---|---|---|")
    for label in dict.fromkeys(r["shape"] for r in rows):
        side = lambda path: next((r["median_ms"] for r in rows if (r["shape"], r["path"]) == (label, path)), None)
        device, host = side("device"), side("host")
        tokens = next(r["tokens"] for r in rows if r["shape"] == label)
        ratio = f"{host / device:.2f}×" if device and host else "-"
        cell = lambda v: f"{v:.3f}" if v else "-"
        print(f"| {label} | {tokens} | {cell(device)} | {cell(host)} | {ratio} |")


def pipeline(ours, keys):
    """The layer with the emulated exchange, each executor and n, against max(compute, exchange)."""
    rows = [r for r in ours if r["what"] == "pipeline"]
    if not rows:
        return
    print()
    print("| shape | k | executor | n | layer with exchange ms | compute ms | exchange ms | / max(compute, exchange) |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, tokens, k in keys:
        at = lambda what, path: next((r["median_ms"] for r in ours if (r["shape"], r["tokens"], r["top_k"], r["what"], r["path"]) == (shape, tokens, k, what, path) and r["precision"] in ("tf32", "-")), None)
        compute = at("layer", "cublas")
        for r in rows:
            if (r["shape"], r["tokens"], r["top_k"]) != (shape, tokens, k):
                continue
            # Each row against the exchange it ran: burn's pageable upload or the page-locked one
            # (files before 2026-12-01 have only "host loopback", which was burn's upload).
            pageable = r["path"].endswith("pageable")
            exchange = at("exchange", "host loopback pageable") if pageable else at("exchange", "host loopback")
            bound = max(compute, exchange) if compute and exchange else None
            ratio = f"{r['median_ms'] / bound:.2f}" if bound else "-"
            c = f"{compute:.2f}" if compute else "-"
            e = f"{exchange:.2f}" if exchange else "-"
            print(f"| {shape} | {k} | {r['path'].replace('cublas ', '')} | {r['n']} | {r['median_ms']:.2f} | {c} | {e} | {ratio} |")


def pieces(ours, keys):
    """The timed path's pieces: one row per piece of each shape, k, what and precision."""
    rows = [r for r in ours if r["what"] in ("experts piece", "layer piece")]
    if not rows:
        return
    print()
    print("| shape | k | what | precision | piece | runs a step | device ms | share of the sections' device ms | host ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, tokens, k in keys:
        for what in ("experts piece", "layer piece"):
            for p in ["f32", "tf32", "bf16"]:
                group = [r for r in rows if (r["shape"], r["tokens"], r["top_k"], r["what"], r["precision"]) == (shape, tokens, k, what, p)]
                total = sum(r["median_ms"] for r in group)
                for r in group:
                    share = f"{100 * r['median_ms'] / total:.0f}%" if total else "-"
                    host = f"{r['host_ms']:.3f}" if r.get("host_ms") is not None else "-"
                    print(f"| {shape} | {k} | {what.split()[0]} | {p} | {r['path']} | {r['n']} | {r['median_ms']:.3f} | {share} | {host} |")
                if group:
                    print(f"| {shape} | {k} | {what.split()[0]} | {p} | **all sections** | | {total:.3f} | 100% | {sum(r.get('host_ms') or 0 for r in group):.3f} |")


def calls(ours, keys):
    """The census's calls per layer step: host waits (goal: at most 2) and the time each thread
    spent in them (the thread that holds the step: `main` is the caller, `DSD-…` cubecl's device
    thread, `DSU-…` fusion's, `unnamed` cubecl's collector of cross-stream events among
    others), frees, launches."""
    rows = [r for r in ours if r.get("host_waits") is not None]
    if not rows:
        return
    print()
    print("| shape | k | what | path | precision | step ms | host ms | host waits a step | by thread | ms in waits a step, by thread | ms in all driver calls a step, by thread | frees | launches (driver) | launches (runtime) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    num = lambda v: f"{v:.2f}".rstrip("0").rstrip(".") if v is not None else "-"
    # Older files have no times; a thread that spent nothing is left out of the file.
    by_thread = lambda m: ", ".join(f"{t} {ms:.3f}" for t, ms in sorted(m.items(), key=lambda x: -x[1])) if m else "-"
    counts = lambda m: ", ".join(f"{t} {num(c)}" for t, c in sorted(m.items(), key=lambda x: -x[1])) if m else "-"
    for shape, tokens, k in keys:
        for r in rows:
            if (r["shape"], r["tokens"], r["top_k"]) != (shape, tokens, k):
                continue
            host = f"{r['host_ms']:.3f}" if r.get("host_ms") is not None else "-"
            print(f"| {shape} | {k} | {r['what']} | {r['path']} | {r['precision']} | {r['median_ms']:.3f} | {host} | {num(r['host_waits'])} | {counts(r.get('waits_by_thread'))} | {by_thread(r.get('wait_ms'))} | {by_thread(r.get('driver_ms'))} | {num(r.get('frees'))} | {num(r.get('driver_launches'))} | {num(r.get('runtime_launches'))} |")


if __name__ == "__main__":
    main()
