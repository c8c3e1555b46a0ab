"""Writes tests/data/models/sampling.expected.json: what transformers' own sampling processors
make of stored logits, for the filtered distributions that `mpipemoe generate --temperature
--top-k --top-p` samples from.

`generate(do_sample=True)` applies, in this order, `TemperatureLogitsWarper`,
`TopKLogitsWarper` and `TopPLogitsWarper` (`GenerationMixin._get_logits_processor`) to the
last position's float32 logits, then samples from their softmax with `torch.multinomial`. The
sample itself cannot match another generator; the filtered logits (removed entries at -inf)
and their softmax can. A row where top-p's cut falls between equal values is marked
`ambiguous` (which of them is kept is torch's sort order, not a rule). Each row of `logits` (seeded normal values, with a few exact ties so
that top-k's "keep every tie of the k-th value" rule is exercised) is run through the
processors of each setting, as transformers builds them from a `GenerationConfig`.

Run with transformers 5.24 and torch 2.15: `python make_sampling.py` (a second).
"""

import json
import os

import torch
from transformers import GenerationConfig
from transformers.generation import LogitsProcessorList
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 96
SETTINGS = [
    {"temperature": 0.7},
    {"top_k": 5},
    {"top_p": 0.9},
    {"temperature": 1.3, "top_k": 20, "top_p": 0.8},
    {"temperature": 0.5, "top_p": 0.3},
    {"top_k": 1},
    {"top_p": 0.05},
    {"temperature": 2.0, "top_k": 96, "top_p": 1.0},
]


def processors(setting):
    """The warpers `_get_logits_processor` appends for `do_sample=True` and this setting."""
    config = GenerationConfig(do_sample=True, **setting)
    out = LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        out.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        out.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    return out


def main():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=generator, dtype=torch.float32) * 3.0
    # Exact ties at the top of a row: top-k keeps every value equal to the k-th.
    logits[1, 10] = logits[1, 11] = logits[1, 12] = logits[1].max() + 1.0
    # A flat row: every value the same.
    logits[2] = 0.25
    cases = []
    for setting in SETTINGS:
        warp = processors(setting)
        ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
        filtered = warp(ids, logits.clone())
        probs = filtered.softmax(dim=-1)
        # Where top-p's cut falls between equal values, which of them torch's (unstable) sort
        # put first decides what is kept: no other implementation can be held to that.
        ambiguous = []
        for before, after in zip(logits, filtered):
            kept = set(float(v) for v, a in zip(before, after) if a > float("-inf"))
            removed = set(float(v) for v, a in zip(before, after) if a == float("-inf"))
            ambiguous.append(bool(kept & removed))
        cases.append(
            {
                "setting": setting,
                "ambiguous": ambiguous,
                "kept": [[int(i) for i in torch.nonzero(row > float("-inf")).flatten()] for row in filtered],
                "filtered": [[float(v) if v > float("-inf") else None for v in row] for row in filtered],
                "probs": probs.tolist(),
            }
        )
    out = {"vocab": VOCAB, "logits": logits.tolist(), "cases": cases}
    with open(os.path.join(HERE, "sampling.expected.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
