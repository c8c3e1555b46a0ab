"""Writes tests/data/models/aux.expected.json: transformers' router load-balancing loss of a
whole model, computed across its MoE layers, for each tiny folder whose family has one.

transformers adds it at the model level (`load_balancing_loss_func`, used by Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE and GPT-OSS when `output_router_logits` is set): the router
logits of every MoE layer concatenated, a softmax over all experts, and
`num_experts · Σ_e tokens_per_expert[e] · router_prob_per_expert[e]` with both means taken over
all layers' rows at once; the loss is `cross_entropy + router_aux_loss_coef · aux_loss`. That
is not the sum of each layer's own loss. For each family: the ids of its
`<folder>.expected.safetensors`, the aux loss (unscaled) and the total loss with
`router_aux_loss_coef` = 0.01, and the gradient of that total loss for every router parameter
(`router_grads`, by the checkpoint's names), in float64 from the stored float32 weights.

Run with transformers 5.24 and torch 2.15 after make_models.py: `python make_aux.py` (seconds).
"""

import json
import os

import torch
import transformers
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ["mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny", "olmoe-tiny", "gpt-oss-tiny"]
COEF = 0.01


def stored(name, stored_names, folder):
    """The checkpoint's name of parameter `name`: transformers 5 names Mixtral's router
    `mlp.gate` in the module and `block_sparse_moe.gate` on disk."""
    for candidate in (name, name.replace(".mlp.gate.", ".block_sparse_moe.gate.")):
        if candidate in stored_names:
            return candidate
    raise SystemExit(f"{folder}: {name} is not in the checkpoint")


def main():
    out = {"coef": COEF, "families": {}}
    for folder in FAMILIES:
        path = os.path.join(HERE, folder)
        ids = load_file(path + ".expected.safetensors")["ids"]
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch.float64,
            attn_implementation="eager",
            experts_implementation="eager",
            output_router_logits=True,
            router_aux_loss_coef=COEF,
        )
        res = model(input_ids=ids, labels=ids, output_router_logits=True)
        if res.aux_loss is None:
            raise SystemExit(f"{folder}: transformers computed no aux loss")
        res.loss.backward()
        # The routers' gradients of the total loss (the aux loss reaches them directly), in the
        # stored layout, float64 -> float32 precision as the other references.
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            stored_names = set(json.load(f)["weight_map"])
        router_grads = {
            stored(name, stored_names, folder): [float(v) for v in p.grad.detach().float().reshape(-1)]
            for name, p in model.named_parameters()
            if name.endswith((".gate.weight", ".router.weight", ".router.bias"))
        }
        if not router_grads:
            raise SystemExit(f"{folder}: no router parameter found")
        out["families"][folder] = {
            "aux_loss": float(res.aux_loss),
            "loss": float(res.loss),
            "moe_layers": len(res.router_logits),
            "router_grads": router_grads,
        }
    with open(os.path.join(HERE, "aux.expected.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
