"""A tokenizer for the tiny models, trained with Hugging Face's `tokenizers` package.

    /work/pyenv/bin/python make_tokenizer.py      # tokenizers 0.23, from this folder

The tiny models have 96 token ids (0 <pad>, 1 <s>, 2 </s>, as their configs say), so the
tokenizer is a lower-cased BPE over the Metaspace pre-tokenizer (as Llama's and Mistral's
sentencepiece tokenizers split words) with 96 ids, trained on docs/architecture.md. It is
written as `tokenizer.json` (with the `tokenizer_config.json` transformers reads beside it)
into the Qwen3-MoE and Mixtral folders, and `tokenizer.expected.json` keeps, for a few texts,
the ids and the decoded text that `tokenizers` itself gives, for the Rust side to match.
"""

import json
import os

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
FOLDERS = ["qwen3-moe-tiny", "mixtral-tiny"]


def main():
    corpus = os.path.join(HERE, "../../../docs/architecture.md")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=96, special_tokens=SPECIAL, limit_alphabet=48, show_progress=False)
    tokenizer.train([corpus], trainer)
    assert tokenizer.get_vocab_size() <= 96, tokenizer.get_vocab_size()
    for i, token in enumerate(SPECIAL):
        assert tokenizer.token_to_id(token) == i, token
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
    }
    for folder in FOLDERS:
        tokenizer.save(os.path.join(HERE, folder, "tokenizer.json"))
        with open(os.path.join(HERE, folder, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
    texts = [
        "The layer routes every token to its top experts.",
        "Expert parallelism: experts sharded over ranks, tokens exchanged by an all-to-all!",
        "Ünïcode façade — and digits 0123456789 {braces} <s> tabs\tnewlines\n",
        "",
    ]
    cases = []
    for text in texts:
        encoding = tokenizer.encode(text, add_special_tokens=False)
        cases.append({"text": text, "ids": encoding.ids, "decoded": tokenizer.decode(encoding.ids)})
    with open(os.path.join(HERE, "tokenizer.expected.json"), "w") as f:
        json.dump({"vocab_size": tokenizer.get_vocab_size(), "cases": cases}, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
