"""Writes tests/data/models/batched.expected.json: transformers' batched greedy generation on
every tiny model of this folder, for `MoeCausalLm::generate_batch` and `mpipemoe generate
--ids-file`.

For each family, four prompts of different lengths (9, 3, 6 and 1 ids, so that the pads run
past the sliding windows of 5 and 6 and Llama 4's chunks of 4) are left-padded to the longest
with the pad id and an attention mask of zeros over the pads, as a tokenizer with
`padding_side="left"` pads them, and run through `generate(input_ids, attention_mask=mask,
do_sample=False, max_new_tokens=NEW, pad_token_id=PAD)` in float32 with transformers' KV cache.
Each row's new ids are kept up to and including its first end-of-sequence id (transformers
fills the rest of a finished row with the pad id). The script checks that each row's ids are
those of its prompt generated alone in float64, so that no near tie decides the reference,
and prefers a set of prompts where some row stops at its end-of-sequence id before the
others. (Batched generation itself is not run in float64: in transformers 5.24 a float64
batch with left padding generates other ids than each prompt alone does, while float32 gives
each prompt's own.)

The pad id is the model's first `eos_token_id` (the crate pads with it; transformers would
too, with a warning, when no `pad_token_id` is set). Which id pads changes no real token's
logits: the mask hides the pads.

Run with transformers 5.24 and torch 2.15 after `make_models.py`: `python make_batched.py`
(about half a minute on a CPU).
"""

import json
import os
import re

import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
FOLDERS = [
    "mixtral-tiny",
    "qwen2-moe-tiny",
    "qwen3-moe-tiny",
    "olmoe-tiny",
    "deepseek-v3-tiny",
    "gpt-oss-tiny",
    "llama4-tiny",
]
LENGTHS = [9, 3, 6, 1]
NEW = 12


def first_eos(config):
    eos = config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


def batched(model, prompts, pad):
    """Each prompt's new greedy ids from one left-padded batched `generate`."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=pad)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for row in out[:, width:].tolist():
        kept = []
        for token in row:
            kept.append(token)
            if token in eos:
                break
        rows.append(kept)
    return rows


def alone(model, prompt, pad):
    """The prompt's new greedy ids generated without a batch."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, pad_token_id=pad)
    return out[0, len(prompt):].tolist()


def main():
    expected = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0], "new": NEW}
    for seed, folder in enumerate(FOLDERS):
        path = os.path.join(HERE, folder)
        models = [
            transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
            )
            for dtype in (torch.float32, torch.float64)
        ]
        config = models[0].config
        pad = first_eos(config)
        g = torch.Generator().manual_seed(100 + seed)
        chosen = None
        for _ in range(50):
            prompts = [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
            rows = batched(models[0], prompts, pad)
            if rows != [alone(models[1], p, pad) for p in prompts]:
                continue
            early = any(len(r) < NEW for r in rows) and any(len(r) == NEW for r in rows)
            if chosen is None or early:
                chosen = (prompts, rows)
            if early:
                break
        if chosen is None:
            raise SystemExit(f"{folder}: the batch and float64 alone differ on 50 prompt sets: near ties")
        prompts, rows = chosen
        expected[folder] = {"pad_token_id": pad, "prompts": prompts, "new_ids": rows}
        print(f"{folder}: new ids per row {[len(r) for r in rows]}")
    # One line per list of ids.
    text = json.dumps(expected, indent=1)
    text = re.sub(r"\[\s+([\d,\s]+?)\s+\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
    with open(os.path.join(HERE, "batched.expected.json"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
