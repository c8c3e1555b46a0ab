"""Writes tests/data/models/lora/: a LoRA adapter for every tiny model of this folder, written
by peft itself, and what peft computes with it.

For each family, `lora/<folder>/` is `PeftModel.save_pretrained`'s folder
(`adapter_config.json`, `adapter_model.safetensors` in float32) for a `LoraConfig` on the
attention projections the family has (`target_modules`) and on the stacked experts
(`target_parameters=["experts.gate_up_proj", "experts.down_proj"]`: one adapter per expert,
peft's layout for transformers 5's MoE layers). The adapters' values are random (peft starts
`lora_B` at zero, which would hide a wrong scale or a misplaced expert) and rounded to float32
before saving, so the file holds exactly the values the oracle runs.

`lora/<folder>.expected.safetensors` holds, with the base model and the adapter loaded back by
`PeftModel.from_pretrained` in float64:

- `ids` `[B, T]` (int64): a batch of token ids;
- `logits` `[B, T, vocab]` and `loss` `[1]` (labels = ids, transformers' causal-LM loss);
- `grad.<key>`: torch autograd's gradient of `loss` for every adapter tensor, under the key
  the adapter file stores it by.

The families differ in rank and scale: rank 2 with `lora_alpha=3` (scale 1.5), OLMoE with
rsLoRA (`use_rslora=True`: 3 / sqrt(2)), Llama 4 rank 3 with alpha 4. GPT-OSS targets only
the experts' `down_proj`, Qwen2-MoE only the attention.

Run with transformers 5.24, torch 2.15 and peft 0.21 after `make_models.py`:
`python make_lora.py` (a few seconds).
"""

import json
import os
import shutil

import peft
import torch
import transformers
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "lora")
B, T = 2, 10
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]

# folder: (rank, alpha, rslora, attention targets, expert targets)
FAMILIES = {
    "mixtral-tiny": (2, 3, False, ["q_proj", "k_proj", "v_proj", "o_proj"], EXPERTS),
    "qwen2-moe-tiny": (2, 3, False, ["q_proj", "v_proj"], []),
    "qwen3-moe-tiny": (2, 3, False, ["q_proj", "k_proj", "v_proj", "o_proj"], EXPERTS),
    "olmoe-tiny": (2, 3, True, ["q_proj", "k_proj", "v_proj", "o_proj"], EXPERTS),
    "deepseek-v3-tiny": (2, 3, False, ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"], EXPERTS),
    "gpt-oss-tiny": (2, 3, False, ["q_proj", "o_proj"], ["experts.down_proj"]),
    "llama4-tiny": (3, 4, False, ["q_proj", "k_proj", "v_proj", "o_proj"], EXPERTS),
}


def load(folder, dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(HERE, folder), dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    for seed, (folder, (r, alpha, rslora, attention, experts)) in enumerate(FAMILIES.items()):
        torch.manual_seed(3000 + seed)
        config = peft.LoraConfig(
            r=r,
            lora_alpha=alpha,
            use_rslora=rslora,
            target_modules=attention,
            target_parameters=experts or None,
        )
        model = peft.get_peft_model(load(folder, torch.float32), config)
        g = torch.Generator().manual_seed(4000 + seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        adapter = os.path.join(OUT, folder)
        model.save_pretrained(adapter)
        # The model card peft writes beside the adapter is for the Hub; the tests read the two
        # adapter files alone.
        os.remove(os.path.join(adapter, "README.md"))

        # The oracle: the base in float64 with the saved adapter loaded back by peft.
        ref = peft.PeftModel.from_pretrained(load(folder, torch.float64), adapter, is_trainable=True).double()
        ids = torch.randint(3, ref.config.vocab_size, (B, T), generator=g)
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
        tensors = {"ids": ids, "logits": out.logits.detach().float(), "loss": out.loss.detach().float().reshape(1)}
        saved = set(peft.get_peft_model_state_dict(ref))
        for name, p in ref.named_parameters():
            if p.requires_grad:
                key = name.replace(".default", "")
                if key not in saved:
                    raise SystemExit(f"{folder}: trainable {name} is not in the adapter file")
                tensors[f"grad.{key}"] = p.grad.detach().float().contiguous()
            elif p.grad is not None:
                raise SystemExit(f"{folder}: frozen {name} has a gradient")
        if len(tensors) - 3 != len(saved):
            raise SystemExit(f"{folder}: {len(saved)} adapter tensors, {len(tensors) - 3} gradients")
        meta = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0], "peft": peft.__version__}
        save_file(tensors, os.path.join(OUT, f"{folder}.expected.safetensors"), metadata={"meta": json.dumps(meta)})
        print(f"{folder}: {len(saved)} adapter tensors, loss {out.loss.item():.6f}")


if __name__ == "__main__":
    main()
