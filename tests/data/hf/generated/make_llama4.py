"""Writes a tiny Llama 4 text checkpoint and the expected case of one MoE layer, from
transformers' own modules.

llama4-tiny/ is `Llama4ForCausalLM(Llama4TextConfig(...)).save_pretrained(..., max_shard_size=...)`
stored in bfloat16 with random weights (normal, std 0.2, so that routing is not degenerate).
Layer 0 is a dense MLP and layer 1 a MoE layer (`moe_layers = [1]`). Its experts are stacked, as
Llama 4 publishes them: `feed_forward.experts.gate_up_proj [E, M, 2H]` (the gate half first,
then the up half: `gate_up.chunk(2, dim=-1)`) and `feed_forward.experts.down_proj [E, H, M]`,
applied as `x @ W` (not `[out, in]` as nn.Linear stores); `feed_forward.router.weight [E, M]`;
an always-on `feed_forward.shared_expert` SwiGLU of width H.

Llama 4 routes top-k by the logits and gives each chosen expert `sigmoid(logit)` as its weight,
but multiplies the weight into the expert's *input*, not its output:
`y = shared(x) + sum_j expert_{idx_j}(sigmoid(l_{idx_j}) * x)`. That is not the same function
(the expert is not linear), so the case's meta says `"weights_on_input": true`.

llama4-multimodal-tiny/ is the same text model inside `Llama4ForConditionalGeneration` with a
tiny vision tower, saved the same way: `model_type` "llama4" with the text model's keys under
`text_config`, and its layers named `language_model.model.layers.*`, as the Hub's Llama 4
releases are. Its layer 1 has the same weights, so the same case checks it.

llama4-tiny.layer1.safetensors is the case of MoE layer 1 in the format of the cases' README:
the layer's weights under the canonical names (bf16 -> f32, exact), an input, the output of
transformers' `Llama4TextMoe` for that layer computed in float64 from the stored weights, and
every gradient of `sum(y * probe)`.

These files are the project's own; run: python make_llama4.py (torch and transformers 5.x).
"""

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import (
    Llama4Config,
    Llama4ForCausalLM,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
    Llama4VisionConfig,
)

HERE = Path(__file__).parent
OUT = HERE / "llama4-tiny"
MULTIMODAL = HERE / "llama4-multimodal-tiny"
LAYER = 1
E, M, H, K, T = 8, 32, 16, 1, 40


def main():
    torch.manual_seed(2026)
    config = Llama4TextConfig(
        vocab_size=64,
        hidden_size=M,
        intermediate_size=H,
        intermediate_size_mlp=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=E,
        num_experts_per_tok=K,
        moe_layers=[LAYER],
        hidden_act="silu",
        attention_chunk_size=16,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    model = Llama4ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model = model.to(torch.bfloat16)
    if OUT.exists():
        shutil.rmtree(OUT)
    model.save_pretrained(OUT, max_shard_size="20KB")

    # The multimodal model's own initialisation must not move the draws of the case below.
    rng = torch.get_rng_state()
    vision = Llama4VisionConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=32,
        image_size=28,
        patch_size=14,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    multimodal = Llama4ForConditionalGeneration(
        Llama4Config(text_config=config.to_dict(), vision_config=vision.to_dict())
    ).to(torch.bfloat16)
    multimodal.language_model.load_state_dict(model.state_dict(), strict=True)
    if MULTIMODAL.exists():
        shutil.rmtree(MULTIMODAL)
    multimodal.save_pretrained(MULTIMODAL, max_shard_size="40KB")
    torch.set_rng_state(rng)

    # The case, from the stored (bf16) weights in float64.
    block = model.model.layers[LAYER].feed_forward
    assert type(block).__name__ == "Llama4TextMoe", type(block)
    block = block.to(torch.float64)
    params = dict(block.named_parameters())
    x = (torch.randn(T, M, dtype=torch.float64)).requires_grad_(True)
    probe = torch.randn(T, M, dtype=torch.float64)
    y, _ = block(x)
    (y * probe).sum().backward()

    gate_up = params["experts.gate_up_proj"]  # [E, M, 2H]: gate half, then up half
    canonical = {
        "router.weight": params["router.weight"],
        "experts.w_in": gate_up,
        "experts.w_out": params["experts.down_proj"],
        "shared.w_in": torch.cat(
            [params["shared_expert.gate_proj.weight"].T, params["shared_expert.up_proj.weight"].T], dim=1
        ),
        "shared.w_out": params["shared_expert.down_proj.weight"].T,
    }
    grads = {
        "router.weight": params["router.weight"].grad,
        "experts.w_in": gate_up.grad,
        "experts.w_out": params["experts.down_proj"].grad,
        "shared.w_in": torch.cat(
            [params["shared_expert.gate_proj.weight"].grad.T, params["shared_expert.up_proj.weight"].grad.T],
            dim=1,
        ),
        "shared.w_out": params["shared_expert.down_proj.weight"].grad.T,
    }
    tensors = {"x": x, "y": y, "probe": probe, "dx": x.grad}
    tensors.update(canonical)
    tensors.update({f"grad.{k}": v for k, v in grads.items()})
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in tensors.items()}
    meta = {
        "kind": "llama4_text",
        "top_k": K,
        "scoring": "sigmoid",
        "normalize_topk": False,
        "activation": "swiglu",
        "bias": False,
        "capacity": None,
        "E": E,
        "M": M,
        "H": H,
        "shared": {"H": H, "gate": None},
        "hf_layer": LAYER,
        "hf_dtype": "bfloat16",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "score_bias": False,
        "weights_on_input": True,
        "transformers_version": transformers.__version__,
    }
    save_file(tensors, HERE / f"llama4-tiny.layer{LAYER}.safetensors", metadata={"meta": json.dumps(meta)})
    print("wrote", OUT, "and the case of layer", LAYER)


if __name__ == "__main__":
    main()
