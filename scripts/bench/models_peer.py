#!/usr/bin/env python3
"""Whole-model fine-tuning and generation beside transformers, on the same CPU, model and data.

The model is a Qwen3-MoE of 163 M parameters (4 layers, d_model 512, 32 experts of width 768,
top-4, 8 query / 4 key-value heads, 8,192 token ids), written by transformers with random
weights (seed 0) into target/bench/qwen3-moe-163m with a tokenizer trained by Hugging Face's
`tokenizers` on the repository's docs (the text both sides train on). Each round runs, as
separate processes measured alike (peak resident memory from the kernel's rusage):

- `mpipemoe finetune` (target/release/mpipemoe, `cargo build --release --bin mpipemoe`) and
  transformers' model trained with torch eager: float32, AdamW (lr 1e-4, no weight decay), the
  same batch of windows drawn from the same tokens (this file repeats the Rust side's
  SplitMix64 window draw), loss = the cross-entropy alone on both sides (the config's
  `output_router_logits` is false, transformers' default, so it adds no auxiliary loss; ours
  has no coefficient set); the median step time after two warm-up steps;
- `mpipemoe generate` and transformers' `generate(do_sample=False)`: a 64-token prompt, 64 new
  tokens (no end-of-sequence stop on the torch side; ours stops at one, which is reported);
- llama.cpp, where the `llama_cpp` module (llama-cpp-python) imports and `--llama-src` names
  llama.cpp's source tree (see `llama_convert.py`): the same model converted once by
  llama.cpp's own `convert_hf_to_gguf.py` to f32 (target/bench/llama/), run with an f32 KV
  cache and flash attention off, the same prompt, greedy (the argmax of each step's logits);
  its ids must equal transformers' before its time counts;
- with `--lora R`, LoRA fine-tuning alone: `mpipemoe finetune --lora-rank R` against PEFT's
  `LoraConfig` of the same rank, alpha 2R and targets (q/k/v/o and both of the experts' stacked
  weights, `target_parameters`), and our own full fine-tuning, with the same batches;
- batched generation: 8 prompts of 64, 57, ..., 15 tokens, left-padded (transformers with an
  attention mask, ours with `generate --ids-file`), 64 new tokens each; new tokens/s over the
  whole call, prefill included, and each row's ids checked against transformers'.

Both sides run with the same heap setting, named in the output: `--heap keep` (default) keeps
freed memory in the process (the `mpipemoe` binary's `mallopt`; the PyTorch process gets the
same settings through GLIBC_TUNABLES), `--heap system` gives both glibc's defaults.
PyTorch runs with `torch.set_num_threads(THREADS)`, ours with burn's thread pool of the same size
(RAYON_NUM_THREADS). `--huge-pages` runs our single-prompt generation with `generate
--huge-pages` (our weights on transparent huge pages; llama.cpp maps its GGUF file as the page
cache holds it, transformers keeps PyTorch's allocations).

    python3 scripts/bench/models_peer.py [--rounds 3] [--steps 8] [--threads 2] [--heap keep|system]
        [--json docs/benchmarks/models_peer.json] [--baseline OTHER_MPIPEMOE]
        [--finetune-only | --generate-only | --batch-only | --lora R] [--llama-src LLAMA_CPP_DIR]
        [--binary OUR_MPIPEMOE] [--huge-pages]

Needs PyTorch, transformers and tokenizers; nothing in the build or the tests needs Python.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
BENCH = os.path.join(ROOT, "target/bench")
MODEL = os.path.join(BENCH, "qwen3-moe-163m")
CORPUS = os.path.join(BENCH, "models-corpus.txt")
BINARY = os.path.join(ROOT, "target/release/mpipemoe")
BATCH, SEQ, LR, SEED = 4, 128, 1e-4, 0
# glibc's tunables for what `mpipemoe_tools::heap::keep_freed_memory` sets with mallopt.
KEEP_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=18446744073709551615:glibc.malloc.top_pad=67108864:glibc.malloc.arena_max=1:glibc.malloc.mxfast=160"


def make_model():
    if os.path.isfile(os.path.join(MODEL, "tokenizer.json")):
        return
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.makedirs(MODEL, exist_ok=True)
    with open(CORPUS, "w") as out:
        for name in ["docs/design-notes.md", "docs/architecture.md", "README.md", "BENCHMARKS.md"]:
            with open(os.path.join(ROOT, name)) as f:
                out.write(f.read())
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train([CORPUS], trainers.BpeTrainer(vocab_size=8192, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                                  show_progress=False))
    tokenizer.save(os.path.join(MODEL, "tokenizer.json"))
    config = Qwen3MoeConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=768,
                            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                            num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], max_position_embeddings=1024, tie_word_embeddings=False,
                            router_aux_loss_coef=0.001, output_router_logits=False, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).float()
    model.save_pretrained(MODEL, max_shard_size="200MB")
    print(f"wrote {MODEL}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters", file=sys.stderr)


def window_starts(seed, step, batch, span):
    """models/src/finetune.rs `window_starts`: SplitMix64 of the seed, the step and the row."""
    mask = (1 << 64) - 1
    out = []
    for row in range(batch):
        z = (seed + step * 0x9E3779B97F4A7C15 + (row + 1) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out.append(z % span)
    return out


def torch_finetune(steps, threads, lora=None, device="cpu", precision=None, batch=BATCH, seq=SEQ):
    """transformers' model trained with torch eager; with `lora` a rank, PEFT's LoRA of that
    rank (alpha 2·rank) on q/k/v/o and both of the experts' stacked weights
    (`target_parameters`), the base frozen: what `mpipemoe finetune --lora-rank` sets up.
    On `device` "cuda", at `precision` "tf32" (every f32 product on the tensor cores in TF32)
    or "bf16" (autocast to bf16, TF32 for what stays f32), with the device's own peaks
    (finetune_gpu_peer.py)."""
    import contextlib
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    cuda = device == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = precision in ("tf32", "bf16")
        torch.backends.cudnn.allow_tf32 = precision in ("tf32", "bf16")

    def autocast():
        if cuda and precision == "bf16":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    tokens = Tokenizer.from_file(os.path.join(MODEL, "tokenizer.json")).encode(
        open(CORPUS).read(), add_special_tokens=False).ids
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).to(device)
    if lora:
        import peft
        config = peft.LoraConfig(r=lora, lora_alpha=2 * lora, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                 target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        model = peft.get_peft_model(model, config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    times, losses = [], []
    for step in range(steps):
        sync()
        start = time.perf_counter()
        starts = window_starts(SEED, step, batch, len(tokens) - seq)
        ids = torch.tensor([tokens[s:s + seq + 1] for s in starts], device=device)
        with autocast():
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # The loss read is the step's end on both devices (a host wait on the GPU).
        losses.append(out.loss.item())
        times.append(time.perf_counter() - start)
    result = {"step_seconds": times, "losses": losses, "data_tokens": len(tokens)}
    if cuda:
        result["max_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        result["max_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    return result


def lora_rounds(args, env, torch_env, heap):
    """LoRA fine-tuning (rank args.lora, attention and experts): ours, PEFT's, and our own full
    fine-tuning, alternating in each round."""
    out_dir = os.path.join(BENCH, "qwen3-moe-163m-lora")
    rows = {"ours_lora": [], "peft_lora": [], "ours_full": []}
    common = ["finetune", MODEL, "--data", CORPUS, "--steps", str(args.steps), "--batch", str(BATCH), "--seq-len",
              str(SEQ), "--lr", str(LR), "--seed", str(SEED), "--overwrite", "--json"]
    lora = ["--lora-rank", str(args.lora), "--lora-alpha", str(2 * args.lora), "--lora-targets",
            "q_proj,k_proj,v_proj,o_proj,experts"]
    for round_ in range(args.rounds):
        for side, extra, out in [("ours_lora", lora, out_dir), ("ours_full", [], out_dir + "-full")]:
            ours = wrapped([BINARY] + heap + common + extra + ["--out", out], env)
            summary = json.loads(ours["out"].strip().splitlines()[-1])
            rows[side].append({"median_step_s": median_after_warm_up(summary["step_seconds"]),
                               "peak_mib": ours["peak_mib"], "losses": summary["losses"]})
        theirs = wrapped([sys.executable, __file__, "--side", "peft-finetune", "--steps", str(args.steps),
                          "--threads", str(args.threads), "--lora", str(args.lora)], torch_env)
        t = json.loads(theirs["out"].strip().splitlines()[-1])
        rows["peft_lora"].append({"median_step_s": median_after_warm_up(t["step_seconds"]),
                                  "peak_mib": theirs["peak_mib"], "losses": t["losses"]})
        print(f"round {round_ + 1}: step ours LoRA {rows['ours_lora'][-1]['median_step_s']:.3f} s, PEFT "
              f"{rows['peft_lora'][-1]['median_step_s']:.3f} s, ours full {rows['ours_full'][-1]['median_step_s']:.3f} s",
              file=sys.stderr)
    med = side_median(rows)
    tokens = BATCH * SEQ
    print(f"heap: {args.heap} on both sides; {args.threads} threads each; {args.rounds} rounds, medians; "
          f"LoRA rank {args.lora}, alpha {2 * args.lora}, q/k/v/o and experts")
    print(f"{'':24} {'tokens/s':>10} {'peak RSS MiB':>13}")
    for side in ["ours_lora", "peft_lora", "ours_full"]:
        print(f"{side:24} {tokens / med(side, 'median_step_s'):10.1f} {med(side, 'peak_mib'):13.0f}")
    print(f"ours LoRA / PEFT tokens/s: {med('peft_lora', 'median_step_s') / med('ours_lora', 'median_step_s'):.2f}; "
          f"ours LoRA / ours full peak RSS: {med('ours_lora', 'peak_mib') / med('ours_full', 'peak_mib'):.2f}")
    print(f"first step's loss: ours LoRA {rows['ours_lora'][0]['losses'][0]:.5f}, PEFT {rows['peft_lora'][0]['losses'][0]:.5f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"heap": args.heap, "threads": args.threads, "batch": BATCH, "seq": SEQ, "lora": args.lora,
                       "rows": rows}, f, indent=1)


def torch_generate(threads, prompt_len, new_tokens):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    tokens = Tokenizer.from_file(os.path.join(MODEL, "tokenizer.json")).encode(
        open(CORPUS).read(), add_special_tokens=False).ids
    prompt = tokens[:prompt_len]
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        start = time.perf_counter()
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        seconds = time.perf_counter() - start
    new = ids[0, prompt_len:].tolist()
    return {"seconds": seconds, "ids": new, "prompt": prompt}


BATCH_LENGTHS = [64, 57, 50, 43, 36, 29, 22, 15]


def batch_prompts():
    """The batched prompts: windows of the corpus's tokens, 100 tokens apart."""
    from tokenizers import Tokenizer

    tokens = Tokenizer.from_file(os.path.join(MODEL, "tokenizer.json")).encode(
        open(CORPUS).read(), add_special_tokens=False).ids
    return [tokens[100 * i:100 * i + n] for i, n in enumerate(BATCH_LENGTHS)]


def torch_generate_batch(threads, new_tokens):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    prompts = batch_prompts()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "rows": out[:, width:].tolist(), "prompts": prompts}


def ours_generate_batch(env, heap, theirs, binary=BINARY):
    """`mpipemoe generate --ids-file` on transformers' prompts, checked row by row."""
    path = os.path.join(BENCH, "batch-prompts.txt")
    with open(path, "w") as f:
        f.write("".join(",".join(map(str, p)) + "\n" for p in theirs["prompts"]))
    ours = wrapped([binary] + heap + ["generate", MODEL, "--ids-file", path, "--max-new-tokens", "64", "--greedy"],
                   env)
    rows = [json.loads(line)["ids"] for line in ours["out"].splitlines() if line.startswith("{")]
    line = [l for l in ours["err"].splitlines() if l.startswith("generated ")][-1]
    seconds = float(line.split(" in ")[1].split(" s ")[0])
    new = sum(len(r) for r in rows)
    equal = [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), min(len(r), len(t)))
             for r, t in zip(rows, theirs["rows"])]
    return {"tokens_per_s": new / seconds, "peak_mib": ours["peak_mib"], "new_tokens": new, "equal_prefix": equal}


GGUF = os.path.join(BENCH, "llama", "qwen3-moe-163m-f32.gguf")


def make_gguf(src):
    """The model in f32 GGUF, by llama.cpp's converter (once; kept in target/bench/llama)."""
    if os.path.isfile(GGUF):
        return
    os.makedirs(os.path.dirname(GGUF), exist_ok=True)
    partial = GGUF + ".partial"
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "llama_convert.py"), src, MODEL,
                           partial], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"llama.cpp's conversion failed:\n{done.stderr[-3000:]}")
    os.replace(partial, GGUF)


def llama_generate(threads, prompt_len, new_tokens):
    """llama.cpp through llama-cpp-python: prefill, then the argmax of each step's logits."""
    import ctypes

    import llama_cpp
    import numpy as np
    from tokenizers import Tokenizer

    tokens = Tokenizer.from_file(os.path.join(MODEL, "tokenizer.json")).encode(
        open(CORPUS).read(), add_special_tokens=False).ids
    prompt = tokens[:prompt_len]
    # An f32 KV cache (GGML_TYPE_F32 = 0) and no flash attention: the arithmetic of the other sides.
    llm = llama_cpp.Llama(model_path=GGUF, n_ctx=256, n_batch=256, n_threads=threads, n_threads_batch=threads,
                          flash_attn=False, type_k=0, type_v=0, verbose=False)
    n_vocab = llm.n_vocab()

    def last_logits():
        pointer = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))

    start = time.perf_counter()
    llm.eval(prompt)
    new = []
    for _ in range(new_tokens):
        new.append(int(np.argmax(last_logits())))
        if len(new) < new_tokens:
            llm.eval([new[-1]])
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "ids": new, "prompt": prompt}


def wrapped(cmd, env):
    """Runs cmd in a fresh Python wrapper that reports the child's own peak resident memory."""
    wrapper = ("import json,os,resource,subprocess,sys,time;"
               "t=time.perf_counter();p=subprocess.run(sys.argv[1:],capture_output=True,text=True);"
               "print(json.dumps({'code':p.returncode,'out':p.stdout,'err':p.stderr[-4000:],"
               "'wall':time.perf_counter()-t,"
               "'peak_mib':resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/1024}))")
    done = subprocess.run([sys.executable, "-c", wrapper] + cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"wrapper failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout)
    if result["code"] != 0:
        sys.exit(f"{' '.join(cmd[:3])}: exit {result['code']}\n{result['err']}")
    return result


def median_after_warm_up(seconds):
    steady = seconds[2:] if len(seconds) > 3 else seconds
    return statistics.median(steady)


def main():
    global BINARY
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--heap", choices=["keep", "system"], default="keep")
    parser.add_argument("--json")
    parser.add_argument("--baseline", help="a second `mpipemoe` binary (e.g. an earlier commit's build), "
                        "fine-tuned and run on the batch in each round beside the other sides "
                        "under the same conditions")
    parser.add_argument("--finetune-only", action="store_true", help="skip generation")
    parser.add_argument("--batch-only", action="store_true", help="batched generation alone")
    parser.add_argument("--generate-only", action="store_true", help="single-prompt generation alone")
    parser.add_argument("--llama-src", help="llama.cpp's source tree (the llama-cpp-python sdist's "
                        "vendor/llama.cpp): adds llama.cpp as a generation comparator")
    parser.add_argument("--lora", type=int, help="LoRA fine-tuning alone at this rank: ours, PEFT's, ours in full")
    parser.add_argument("--huge-pages", action="store_true", help="our generation with `--huge-pages` (the "
                        "weights loaded onto transparent huge pages)")
    parser.add_argument("--binary", default=BINARY, help="our side's mpipemoe binary (default: "
                        "target/release/mpipemoe)")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    BINARY = os.path.abspath(args.binary)
    if args.side == "peft-finetune":
        print(json.dumps(torch_finetune(args.steps, args.threads, args.lora)))
        return
    if args.side == "torch-finetune":
        print(json.dumps(torch_finetune(args.steps, args.threads)))
        return
    if args.side == "torch-generate":
        print(json.dumps(torch_generate(args.threads, 64, 64)))
        return
    if args.side == "llama-generate":
        print(json.dumps(llama_generate(args.threads, 64, 64)))
        return
    if args.side == "torch-generate-batch":
        print(json.dumps(torch_generate_batch(args.threads, 64)))
        return
    if not os.access(BINARY, os.X_OK):
        sys.exit(f"{BINARY} is missing: cargo build --release --bin mpipemoe")
    make_model()
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    torch_env = dict(env)
    if args.heap == "keep":
        torch_env["GLIBC_TUNABLES"] = KEEP_TUNABLES
    heap = ["--heap", args.heap]
    out_dir = os.path.join(BENCH, "qwen3-moe-163m-tuned")
    llama = False
    if args.llama_src:
        import importlib.util
        if importlib.util.find_spec("llama_cpp") is None:
            print("llama_cpp does not import: llama.cpp is left out", file=sys.stderr)
        else:
            make_gguf(args.llama_src)
            llama = True
    rows = {"ours_finetune": [], "torch_finetune": [], "ours_generate": [], "torch_generate": [], "llama_generate": [],
            "baseline_finetune": [], "ours_batch": [], "torch_batch": [], "baseline_batch": []}
    if args.batch_only:
        batch_rounds(args, env, torch_env, heap, rows)
        return
    if args.lora:
        lora_rounds(args, env, torch_env, heap)
        return
    binaries = [("ours_finetune", BINARY)] + ([("baseline_finetune", args.baseline)] if args.baseline else [])
    if args.generate_only:
        generate_rounds(args, env, torch_env, heap, rows, llama)
        return
    for round_ in range(args.rounds):
        # The two builds of ours alternate which goes first from round to round.
        for side, binary in (binaries if round_ % 2 == 0 else binaries[::-1]):
            ours = wrapped([binary] + heap + ["finetune", MODEL, "--data", CORPUS, "--steps", str(args.steps),
                                              "--batch", str(BATCH), "--seq-len", str(SEQ), "--lr", str(LR),
                                              "--seed", str(SEED), "--out", out_dir, "--overwrite", "--json"], env)
            summary = json.loads(ours["out"].strip().splitlines()[-1])
            rows[side].append({"median_step_s": median_after_warm_up(summary["step_seconds"]),
                               "peak_mib": ours["peak_mib"], "losses": summary["losses"]})
        theirs = wrapped([sys.executable, __file__, "--side", "torch-finetune", "--steps", str(args.steps),
                          "--threads", str(args.threads)], torch_env)
        t = json.loads(theirs["out"].strip().splitlines()[-1])
        rows["torch_finetune"].append({"median_step_s": median_after_warm_up(t["step_seconds"]),
                                       "peak_mib": theirs["peak_mib"], "losses": t["losses"]})
        if summary["data_tokens"] != t["data_tokens"]:
            sys.exit(f"the sides tokenised the data differently: {summary['data_tokens']} vs {t['data_tokens']}")
        if args.finetune_only:
            print(f"round {round_ + 1}: finetune step ours {rows['ours_finetune'][-1]['median_step_s']:.3f} s, "
                  f"torch {rows['torch_finetune'][-1]['median_step_s']:.3f} s", file=sys.stderr)
            continue
        generate_round(args, env, torch_env, heap, rows, llama)
        batch_round(args, env, torch_env, heap, rows)
        print(f"round {round_ + 1}: finetune step ours {rows['ours_finetune'][-1]['median_step_s']:.3f} s, "
              f"torch {rows['torch_finetune'][-1]['median_step_s']:.3f} s; generate ours "
              f"{rows['ours_generate'][-1]['tokens_per_s']:.2f} tok/s, torch {rows['torch_generate'][-1]['tokens_per_s']:.2f}",
              file=sys.stderr)

    med = side_median(rows)
    tokens = BATCH * SEQ
    of, tf = med("ours_finetune", "median_step_s"), med("torch_finetune", "median_step_s")
    first = (rows["ours_finetune"][0]["losses"][0], rows["torch_finetune"][0]["losses"][0])
    print(f"heap: {args.heap} on both sides; {args.threads} threads each; {args.rounds} rounds, medians")
    print(f"{'':28} {'ours':>12} {'transformers':>14} {'ours/theirs':>12}")
    print(f"{'finetune tokens/s':28} {tokens / of:12.1f} {tokens / tf:14.1f} {(tokens / of) / (tokens / tf):12.2f}")
    print(f"{'finetune peak RSS (MiB)':28} {med('ours_finetune', 'peak_mib'):12.0f} "
          f"{med('torch_finetune', 'peak_mib'):14.0f} {med('ours_finetune', 'peak_mib') / med('torch_finetune', 'peak_mib'):12.2f}")
    if args.baseline:
        bf = med("baseline_finetune", "median_step_s")
        print(f"{'baseline finetune tokens/s':28} {tokens / bf:12.1f}   (ours / baseline {bf / of:.2f}, "
              f"peak RSS {med('baseline_finetune', 'peak_mib'):.0f} MiB)")
        print(f"losses, ours:     {' '.join(f'{l:.5f}' for l in rows['ours_finetune'][0]['losses'])}")
        print(f"losses, baseline: {' '.join(f'{l:.5f}' for l in rows['baseline_finetune'][0]['losses'])}")
    print(f"first step's loss (cross-entropy, same batch): ours {first[0]:.5f}, transformers {first[1]:.5f}")
    if args.finetune_only:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"heap": args.heap, "threads": args.threads, "batch": BATCH, "seq": SEQ, "rows": rows}, f,
                          indent=1)
        return
    print_generate(rows)
    print_batch(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"heap": args.heap, "threads": args.threads, "batch": BATCH, "seq": SEQ, "rows": rows}, f, indent=1)


def generate_round(args, env, torch_env, heap, rows, llama):
    """One round of single-prompt generation: transformers, llama.cpp (its ids checked equal to
    transformers' first), ours."""
    theirs = wrapped([sys.executable, __file__, "--side", "torch-generate", "--threads", str(args.threads)],
                     torch_env)
    g = json.loads(theirs["out"].strip().splitlines()[-1])
    rows["torch_generate"].append({"tokens_per_s": len(g["ids"]) / g["seconds"], "peak_mib": theirs["peak_mib"]})
    if llama:
        run = wrapped([sys.executable, __file__, "--side", "llama-generate", "--threads", str(args.threads)],
                      torch_env)
        l = json.loads(run["out"].strip().splitlines()[-1])
        if l["ids"] != g["ids"]:
            first = next(i for i, (a, b) in enumerate(zip(l["ids"], g["ids"])) if a != b)
            sys.exit(f"llama.cpp's greedy ids differ from transformers' at new token {first}: not compared")
        rows["llama_generate"].append({"tokens_per_s": len(l["ids"]) / l["seconds"], "peak_mib": run["peak_mib"]})
    ours = wrapped([BINARY] + heap + ["generate", MODEL, "--ids", ",".join(map(str, g["prompt"])),
                                      "--max-new-tokens", "64", "--greedy"]
                   + (["--huge-pages"] if args.huge_pages else []), env)
    ids = [int(i) for i in ours["out"].splitlines()[0].split(",") if i]
    line = [l for l in ours["err"].splitlines() if l.startswith("generated ")][-1]
    seconds = float(line.split(" in ")[1].split(" s ")[0])
    same = next((i for i, (a, b) in enumerate(zip(ids, g["ids"])) if a != b), min(len(ids), len(g["ids"])))
    rows["ours_generate"].append({"tokens_per_s": len(ids) / seconds, "peak_mib": ours["peak_mib"],
                                  "new_tokens": len(ids), "equal_prefix": same})


def side_median(rows):
    """`med(side, key)`: the median over rounds of one side's figure."""
    return lambda side, key: statistics.median(r[key] for r in rows[side])


def print_generate(rows):
    med = side_median(rows)
    og, tg = med("ours_generate", "tokens_per_s"), med("torch_generate", "tokens_per_s")
    print(f"{'generate new tokens/s':28} {og:12.2f} {tg:14.2f} {og / tg:12.2f}")
    print(f"{'generate peak RSS (MiB)':28} {med('ours_generate', 'peak_mib'):12.0f} "
          f"{med('torch_generate', 'peak_mib'):14.0f} {med('ours_generate', 'peak_mib') / med('torch_generate', 'peak_mib'):12.2f}")
    if rows["llama_generate"]:
        lg = med("llama_generate", "tokens_per_s")
        print(f"{'llama.cpp f32, new tokens/s':28} {lg:12.2f}   (ours / llama.cpp {og / lg:.2f}; peak RSS "
              f"{med('llama_generate', 'peak_mib'):.0f} MiB; its ids equal transformers')")
    g = rows["ours_generate"][0]
    print(f"greedy ids equal to transformers' for the first {g['equal_prefix']} of {g['new_tokens']} new tokens")


def generate_rounds(args, env, torch_env, heap, rows, llama):
    for round_ in range(args.rounds):
        generate_round(args, env, torch_env, heap, rows, llama)
        extra = f", llama.cpp {rows['llama_generate'][-1]['tokens_per_s']:.2f}" if llama else ""
        print(f"round {round_ + 1}: generate ours {rows['ours_generate'][-1]['tokens_per_s']:.2f} tok/s, "
              f"torch {rows['torch_generate'][-1]['tokens_per_s']:.2f}{extra}", file=sys.stderr)
    print(f"heap: {args.heap} on both sides; {args.threads} threads each; {args.rounds} rounds, medians")
    print(f"{'':28} {'ours':>12} {'transformers':>14} {'ours/theirs':>12}")
    print_generate(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"heap": args.heap, "threads": args.threads, "huge_pages": args.huge_pages, "rows": rows}, f,
                      indent=1)


def batch_round(args, env, torch_env, heap, rows):
    """One round of batched generation, transformers first (its prompts and ids are the check)."""
    theirs = wrapped([sys.executable, __file__, "--side", "torch-generate-batch", "--threads", str(args.threads)],
                     torch_env)
    t = json.loads(theirs["out"].strip().splitlines()[-1])
    rows["torch_batch"].append({"tokens_per_s": sum(len(r) for r in t["rows"]) / t["seconds"],
                                "peak_mib": theirs["peak_mib"]})
    builds = [("ours_batch", BINARY)] + ([("baseline_batch", args.baseline)] if args.baseline else [])
    # The two builds of ours alternate which goes first from round to round.
    for side, binary in (builds if len(rows["ours_batch"]) % 2 == 0 else builds[::-1]):
        rows[side].append(ours_generate_batch(env, heap, t, binary))


def print_batch(rows):
    med = side_median(rows)
    ob, tb = med("ours_batch", "tokens_per_s"), med("torch_batch", "tokens_per_s")
    print(f"{'batch of 8, new tokens/s':28} {ob:12.2f} {tb:14.2f} {ob / tb:12.2f}")
    print(f"{'batch of 8, peak RSS (MiB)':28} {med('ours_batch', 'peak_mib'):12.0f} "
          f"{med('torch_batch', 'peak_mib'):14.0f} {med('ours_batch', 'peak_mib') / med('torch_batch', 'peak_mib'):12.2f}")
    if rows["baseline_batch"]:
        bb = med("baseline_batch", "tokens_per_s")
        print(f"{'baseline batch new tokens/s':28} {bb:12.2f}   (ours / baseline {ob / bb:.2f})")
    b = rows["ours_batch"][0]
    print(f"batched greedy ids equal to transformers' for the first {b['equal_prefix']} new tokens of each row "
          f"({b['new_tokens']} in all)")


def batch_rounds(args, env, torch_env, heap, rows):
    for round_ in range(args.rounds):
        batch_round(args, env, torch_env, heap, rows)
        print(f"round {round_ + 1}: batch of 8 ours {rows['ours_batch'][-1]['tokens_per_s']:.2f} tok/s, "
              f"torch {rows['torch_batch'][-1]['tokens_per_s']:.2f}", file=sys.stderr)
    print(f"heap: {args.heap} on both sides; {args.threads} threads each; {args.rounds} rounds, medians")
    print(f"{'':28} {'ours':>12} {'transformers':>14} {'ours/theirs':>12}")
    print_batch(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"heap": args.heap, "threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
