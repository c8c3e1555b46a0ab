#!/usr/bin/env python3
"""Converts a Hugging Face folder to an f32 GGUF file with llama.cpp's own converter.

    python3 scripts/bench/llama_convert.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf

LLAMA_CPP_DIR is llama.cpp's source tree: `vendor/llama.cpp` of the llama-cpp-python sdist
(the version that built the `llama_cpp` module the benchmark runs), holding
`convert_hf_to_gguf.py`, `conversion/` and `gguf-py/`. Get it with
`pip download llama-cpp-python==<version> --no-deps --no-binary :all:` (pip unpacks the sdist
under its temporary folder while it prepares the build; copy `vendor/llama.cpp` out of it) or
from the sdist on PyPI.

One thing is patched, in this process only, not in the data: the converter reads the
vocabulary through `AutoTokenizer`, which for a `qwen3_moe` config is transformers'
`Qwen2Tokenizer` around the folder's `tokenizer.json` — one added token past the config's
`vocab_size` for the benchmark model's Metaspace BPE tokenizer, and a pre-tokenizer hash the
converter does not know. The benchmark feeds token ids, so the vocabulary only has to have
the right size: here it is read straight from `tokenizer.json` (every id's string, the added
tokens as control tokens) with the pre-tokenizer recorded as `default`; the merges come from
the same file through the converter's own `gguf.SpecialVocab`.
"""
import json
import os
import sys


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    src, model, out = sys.argv[1:]
    sys.path.insert(0, src)
    sys.path.insert(1, os.path.join(src, "gguf-py"))
    import gguf
    from conversion import base

    def get_vocab_base(self):
        with open(os.path.join(self.dir_model, "tokenizer.json")) as f:
            tokenizer = json.load(f)
        vocab_size = self.hparams["vocab_size"]
        strings = {i: s for s, i in tokenizer["model"]["vocab"].items()}
        control = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
        for t in tokenizer.get("added_tokens", []):
            strings[t["id"]] = t["content"]
        tokens, types = [], []
        for i in range(vocab_size):
            if i in strings:
                tokens.append(strings[i])
                types.append(gguf.TokenType.CONTROL if i in control else gguf.TokenType.NORMAL)
            else:
                tokens.append(f"[PAD{i}]")
                types.append(gguf.TokenType.UNUSED)
        return tokens, types, "default"

    base.TextModel.get_vocab_base = get_vocab_base
    sys.argv = [os.path.join(src, "convert_hf_to_gguf.py"), model, "--outtype", "f32", "--outfile", out]
    import convert_hf_to_gguf

    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
