"""Writes a tiny GPT-OSS checkpoint with its experts in MXFP4, as the Hub's GPT-OSS releases
store them, and the expected case of one MoE layer, read by transformers' own loader.

gpt-oss-mxfp4-tiny/ starts as `GptOssForCausalLM(tiny_config(64, 32)).save_pretrained(...)` in
bfloat16 (make_gpt_oss.py's configuration with wider layers: MXFP4 packs the input dimension
of each expert matrix in blocks of 32). Then every layer's `mlp.experts.gate_up_proj` and
`mlp.experts.down_proj` are replaced by the packed form transformers reads
(`integrations/mxfp4.py`):

- `<name>_blocks`, uint8 `[E, out, in / 32, 16]`: two float4 e2m1 codes per byte, the low
  nibble first;
- `<name>_scales`, uint8 `[E, out, in / 32]`: one e8m0 exponent per block of 32 (bias 127);

and config.json gets GPT-OSS's `quantization_config` (`quant_method: "mxfp4"`). The codes are
random bytes, so every one of the 16 codes (-0 included) occurs; the exponents are random in
119..=123, with one block at exponent 0 (2^-127: subnormal values) and one at 127. transformers
cannot write MXFP4 without its GPU kernels, so the script writes the bytes; everything after
that is transformers' own: `from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))`
dequantises them (`convert_moe_packed_tensors`) to bfloat16.

gpt-oss-mxfp4-tiny.requantized-x1.3.safetensors holds layer 1's experts, dequantised, times
1.3 and rounded to bfloat16, quantised again by the quantiser transformers' `Mxfp4Quantize`
calls, triton_kernels' `downcast_to_mxfp_torch` (default `ROUND_UP` scales), along the input
dimension: what exporting that layer, so changed, must write. The triton_kernels package is
not on PyPI; this script takes the copy vLLM ships (`pip download vllm==0.33.0 --no-deps`, then
`vllm/third_party/triton_kernels` on PYTHONPATH as `triton_kernels`). That copy rounds a value
exactly halfway between two e2m1 values up, where triton's current one and the OCP MX spec
round to even; the script checks that no value of the data is halfway, so both agree.

gpt-oss-mxfp4-tiny.layer1.safetensors is the case of MoE layer 1 of that loaded model, as in
make_gpt_oss.py. gpt-oss-mxfp4-tiny.dequantized.safetensors holds the expert tensors of every
layer as transformers dequantised them (bfloat16, under the names transformers' loaded model
and its `save_pretrained` give them): what an import must reproduce bit for bit, and what an
export writes for a model so loaded.

These files are the project's own; run: python make_mxfp4.py (torch and transformers 5.x).
"""

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import GptOssForCausalLM, Mxfp4Config

from make_gpt_oss import save_tiny, tiny_config, write_case

try:
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp_torch
except ImportError as e:
    raise SystemExit(f"needs triton_kernels on PYTHONPATH (see the docstring): {e}")

HERE = Path(__file__).resolve().parent
OUT = HERE / "gpt-oss-mxfp4-tiny"
LAYER = 1
M, H, T = 64, 32, 40
PROJECTIONS = ("gate_up_proj", "down_proj")


def pack(generator, experts, out_dim, in_dim):
    """Random MXFP4 blocks and exponents for an `[E, in, out]` weight (stored transposed)."""
    blocks = torch.randint(0, 256, (experts, out_dim, in_dim // 32, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(119, 124, (experts, out_dim, in_dim // 32), generator=generator, dtype=torch.uint8)
    return blocks, scales


def main():
    torch.manual_seed(2028)
    config = tiny_config(M, H)
    save_tiny(config, OUT, "40KB")

    generator = torch.Generator().manual_seed(2029)
    index_path = OUT / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(OUT / shard)
        out = {}
        for name, value in tensors.items():
            if name.rsplit(".", 1)[-1] in PROJECTIONS:
                e, in_dim, out_dim = value.shape
                blocks, scales = pack(generator, e, out_dim, in_dim)
                if name == f"model.layers.{LAYER}.mlp.experts.gate_up_proj":
                    scales[0, 0, 0] = 0
                    scales[1, 3, 1] = 127
                out[f"{name}_blocks"] = blocks
                out[f"{name}_scales"] = scales
            else:
                out[name] = value
        for name in out:
            weight_map[name] = shard
        save_file(out, OUT / shard, metadata={"format": "pt"})
    index["weight_map"] = dict(sorted(weight_map.items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    config_path = OUT / "config.json"
    config_json = json.loads(config_path.read_text())
    # As in openai/gpt-oss-20b's config.json.
    config_json["quantization_config"] = {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    }
    config_path.write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")

    loaded, info = GptOssForCausalLM.from_pretrained(
        OUT,
        quantization_config=Mxfp4Config(dequantize=True),
        experts_implementation="eager",
        output_loading_info=True,
    )
    assert not any(info.values()), f"transformers did not load every tensor: {info}"
    experts = {
        name: p.detach().contiguous()
        for name, p in loaded.named_parameters()
        if name.rsplit(".", 1)[-1] in PROJECTIONS
    }
    assert len(experts) == 2 * config.num_hidden_layers and all(
        v.dtype == torch.bfloat16 for v in experts.values()
    ), {k: v.dtype for k, v in experts.items()}
    tiny = experts[f"model.layers.{LAYER}.mlp.experts.gate_up_proj"][0, :32, 0]
    assert 0 < tiny.abs().max().item() < 1e-37, "the exponent-0 block is not subnormal"
    save_file(
        experts,
        HERE / "gpt-oss-mxfp4-tiny.dequantized.safetensors",
        metadata={"transformers": transformers.__version__, "torch": torch.__version__},
    )
    # The export reference: layer 1's experts times 1.3, quantised as transformers does.
    requantized = {}
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    for proj in PROJECTIONS:
        name = f"model.layers.{LAYER}.mlp.experts.{proj}"
        w = (experts[name].float() * torch.tensor(1.3)).to(torch.bfloat16)
        # [E, in, out] -> [E, out, in], quantised along `in` as the checkpoint stores it.
        blocks, scales = downcast_to_mxfp_torch(w.transpose(1, 2).contiguous(), torch.uint8, axis=-1)
        # 2^(scale - 127) from its float32 bits (every scale here is at least 1).
        scale = (scales.to(torch.int32) << 23).view(torch.float32)
        q = w.transpose(1, 2).float() / scale.repeat_interleave(32, dim=-1)
        assert not torch.isin(q.abs(), midpoints).any(), f"{name}: a value is halfway between two codes"
        requantized[f"{name}_blocks"] = blocks.reshape(*scales.shape, 16).contiguous()
        requantized[f"{name}_scales"] = scales.contiguous()
    save_file(
        requantized,
        HERE / "gpt-oss-mxfp4-tiny.requantized-x1.3.safetensors",
        metadata={"transformers": transformers.__version__, "torch": torch.__version__},
    )

    clamped = write_case(
        loaded,
        config,
        LAYER,
        HERE / f"gpt-oss-mxfp4-tiny.layer{LAYER}.safetensors",
        T,
        # What the importer reports as the layer's stored dtype.
        {"hf_dtype": "bfloat16 + mxfp4 experts (e2m1, an e8m0 scale per 32)"},
    )
    print("wrote", OUT, "and the case of layer", LAYER, f"({clamped} gate/up values clamped)")


if __name__ == "__main__":
    main()
