"""Writes a tiny GPT-OSS checkpoint and the expected case of one MoE layer, from transformers'
own modules.

gpt-oss-tiny/ is `GptOssForCausalLM(GptOssConfig(...)).save_pretrained(...)`, stored in bfloat16
with random weights (normal, std 0.2; the expert biases std 0.5). Every layer is a MoE layer.
The experts are stacked as GPT-OSS publishes them (unquantised; the Hub's release stores them
in MXFP4, which this project does not read):

- `mlp.experts.gate_up_proj [E, M, 2H]` with the gate and up columns *interleaved*
  (`gate = gate_up[..., ::2]`, `up = gate_up[..., 1::2]`), applied as `x @ W`;
- `mlp.experts.gate_up_proj_bias [E, 2H]`, interleaved the same way;
- `mlp.experts.down_proj [E, H, M]` and `mlp.experts.down_proj_bias [E, M]`;
- `mlp.router.weight [E, M]` and `mlp.router.bias [E]`.

The router takes the top-k logits and a softmax over those k, which is the softmax over all
experts renormalised over the k chosen. The experts' activation is GPT-OSS's clamped SwiGLU:
`g = min(gate, limit)`, `u = clamp(up, -limit, limit)`, `(u + 1) * g * sigmoid(alpha * g)`,
with `swiglu_alpha` 1.702 and `swiglu_limit` 7.0. The input is scaled up (std 3) so that
some of the gate and up values pass the clamp and the test sees it act.

gpt-oss-tiny.layer1.safetensors is the case of MoE layer 1 in the format of the cases' README:
the weights under the canonical names (`experts.w_in [E, M, 2H]` with the gate half first, then
the up half, its bias `experts.b_in` likewise), an input, the output of transformers'
`GptOssMLP` computed in float64 from the stored weights, and every gradient of
`sum(y * probe)`. The meta says `"activation": "swiglu_clamped"` with `swiglu_alpha` and
`swiglu_limit`.

These files are the project's own; run: python make_gpt_oss.py (torch and transformers 5.x).
"""

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM

HERE = Path(__file__).parent
OUT = HERE / "gpt-oss-tiny"
LAYER = 1
E, M, H, K, T = 8, 32, 16, 2, 40


def halves(interleaved):
    """[..., 2H] interleaved (gate, up, gate, up, ...) -> [..., 2H] as [gate | up]."""
    return torch.cat([interleaved[..., ::2], interleaved[..., 1::2]], dim=-1)


def tiny_config(hidden, intermediate):
    """The tiny GPT-OSS configuration, with hidden size `hidden` and expert width `intermediate`."""
    return GptOssConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=E,
        num_experts_per_tok=K,
        sliding_window=16,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        # transformers' own loop over the experts (GptOssExperts.forward), in any dtype; the
        # grouped-GEMM kernel it picks by default takes no float64.
        experts_implementation="eager",
    )


def save_tiny(config, out, max_shard_size):
    """A `GptOssForCausalLM(config)` with random weights (normal, std 0.2; biases std 0.5,
    drawn from torch's global generator) in bfloat16, saved by transformers into `out`
    (replaced) in shards of at most `max_shard_size`. Returns the model."""
    model = GptOssForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if name.endswith("_bias") else 0.2)
    model = model.to(torch.bfloat16)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return model


def write_case(model, config, layer, path, t, extra_meta):
    """Writes the case of MoE layer `layer` of `model` to `path`: `t` tokens of input drawn from
    torch's global generator, transformers' `GptOssMLP` run in float64, every gradient of
    `sum(y * probe)`. Returns how many gate / up values pass the clamp."""
    block = model.model.layers[layer].mlp
    assert type(block).__name__ == "GptOssMLP", type(block)
    block = block.to(torch.float64)
    params = dict(block.named_parameters())
    x = (3.0 * torch.randn(t, config.hidden_size, dtype=torch.float64)).requires_grad_(True)
    probe = torch.randn(t, config.hidden_size, dtype=torch.float64)
    y = block(x.reshape(1, t, config.hidden_size))
    y = (y[0] if isinstance(y, tuple) else y).reshape(t, config.hidden_size)
    (y * probe).sum().backward()

    # How often the clamps act on this input, so that the test is known to exercise them.
    with torch.no_grad():
        z = torch.einsum("tm,emf->etf", x, params["experts.gate_up_proj"]) + params["experts.gate_up_proj_bias"][:, None]
        clamped = ((z[..., ::2] > config.swiglu_limit).sum() + (z[..., 1::2].abs() > config.swiglu_limit).sum()).item()
    assert clamped > 0, "no value reaches the clamp"

    canonical = {
        "router.weight": params["router.weight"],
        "router.bias": params["router.bias"],
        "experts.w_in": halves(params["experts.gate_up_proj"]),
        "experts.b_in": halves(params["experts.gate_up_proj_bias"]),
        "experts.w_out": params["experts.down_proj"],
        "experts.b_out": params["experts.down_proj_bias"],
    }
    grads = {
        "router.weight": params["router.weight"].grad,
        "router.bias": params["router.bias"].grad,
        "experts.w_in": halves(params["experts.gate_up_proj"].grad),
        "experts.b_in": halves(params["experts.gate_up_proj_bias"].grad),
        "experts.w_out": params["experts.down_proj"].grad,
        "experts.b_out": params["experts.down_proj_bias"].grad,
    }
    tensors = {"x": x, "y": y, "probe": probe, "dx": x.grad}
    tensors.update(canonical)
    tensors.update({f"grad.{k}": v for k, v in grads.items()})
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in tensors.items()}
    meta = {
        "kind": "gpt_oss",
        "top_k": config.num_experts_per_tok,
        "scoring": "softmax",
        "normalize_topk": True,
        "activation": "swiglu_clamped",
        "swiglu_alpha": config.swiglu_alpha,
        "swiglu_limit": config.swiglu_limit,
        "bias": True,
        "capacity": None,
        "E": config.num_local_experts,
        "M": config.hidden_size,
        "H": config.intermediate_size,
        "shared": None,
        "hf_layer": layer,
        "hf_dtype": "bfloat16",
        "transformers_version": transformers.__version__,
        "clamped_values": clamped,
    }
    meta.update(extra_meta)
    save_file(tensors, path, metadata={"meta": json.dumps(meta)})
    return clamped


def main():
    torch.manual_seed(2027)
    config = tiny_config(M, H)
    model = save_tiny(config, OUT, "20KB")

    clamped = write_case(model, config, LAYER, HERE / f"gpt-oss-tiny.layer{LAYER}.safetensors", T, {})
    print("wrote", OUT, "and the case of layer", LAYER, f"({clamped} gate/up values clamped)")


if __name__ == "__main__":
    main()
