"""Writes the FP8 block-scaled checkpoint the tests import, from transformers' own code.

deepseek-v3-fp8-tiny/ is deepseek-v3-tiny/ as DeepSeek-V3 and Qwen3 publish their FP8
releases: every linear projection that tiles by the block (`*_proj.weight`: all the MLPs', the
experts' and the shared experts', and most attention projections) stored as float8_e4m3fn with a float32 `*.weight_scale_inv` per block, quantised by
transformers' `Fp8Quantize` (integrations/finegrained_fp8.py); the router, norms, embeddings
and head unquantised; `quantization_config` in config.json. The blocks are 8 x 16 rather than
128 x 128 so that the tiny matrices have several blocks each.

deepseek-v3-fp8-tiny.requantized-x4.safetensors holds transformers' `Fp8Quantize` of layer 1's
MoE weights (experts and shared experts) dequantised and multiplied by 4: what exporting that
layer, so changed, into the FP8 checkpoint must write.

deepseek-v3-fp8-tiny.dequantized.safetensors holds, under the checkpoint's names, every
quantised weight dequantised to float32 by transformers' `Fp8Dequantize` (what
`from_pretrained(..., quantization_config=FineGrainedFP8Config(dequantize=True))` applies on
load), and one matrix whose shape is not a multiple of the block (`partial.weight`, with its
`partial.weight_scale_inv` and the float32 result of transformers' `_dequantize_fp8_weight`,
which pads the last blocks as DeepSeek's own kernel does), and `e4m3.table`: the float32
value torch gives each of the 256 float8_e4m3fn bit patterns.

These files are the project's own (the folder above is a copy of the checkpoints the tests
are given); run: python make_fp8.py (torch and transformers 5.x).
"""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import (
    Fp8Dequantize,
    Fp8Quantize,
    _dequantize_fp8_weight,
)

BLOCK = (8, 16)
HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent / "deepseek-v3-tiny"
OUT = HERE / "deepseek-v3-fp8-tiny"

config = FineGrainedFP8Config(weight_block_size=BLOCK)
quantizer = SimpleNamespace(quantization_config=config)
quantize = Fp8Quantize(quantizer)
dequantize = Fp8Dequantize(quantizer)

if OUT.exists():
    shutil.rmtree(OUT)
OUT.mkdir()
index = json.loads((SOURCE / "model.safetensors.index.json").read_text())
weight_map = {}
expected = {}
for shard in sorted(set(index["weight_map"].values())):
    tensors = load_file(SOURCE / shard)
    out = {}
    for name, value in tensors.items():
        if name.endswith("_proj.weight") and value.ndim == 2:
            pair = quantize.convert({name: value})
            scale_name = name.rsplit(".", 1)[0] + ".weight_scale_inv"
            out.update(pair)
            if scale_name not in pair:
                # transformers leaves a matrix that does not tile unquantised (two attention
                # projections here); every MLP projection tiles.
                assert ".mlp." not in name, f"{name} {tuple(value.shape)} does not tile by {BLOCK}"
                continue
            expected[name] = dequantize._dequantize_one(
                pair[name], pair[scale_name], output_dtype=torch.float32
            )
        else:
            out[name] = value
    for name in out:
        weight_map[name] = shard
    save_file(out, OUT / shard, metadata={"format": "pt"})

config_json = json.loads((SOURCE / "config.json").read_text())
config_json["quantization_config"] = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(BLOCK),
}
(OUT / "config.json").write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
index["weight_map"] = dict(sorted(weight_map.items()))
(OUT / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

# A matrix of 20 x 40 in 8 x 16 blocks: the last row and column blocks are partial.
generator = torch.Generator().manual_seed(7)
partial = (torch.randn(20, 40, generator=generator) * 0.2).to(torch.bfloat16)
scales = torch.rand(3, 3, generator=generator) * 0.01 + 0.001
q = (partial.to(torch.float32) / scales.repeat_interleave(8, 0)[:20].repeat_interleave(16, 1)[:, :40]).to(
    torch.float8_e4m3fn
)
expected["partial.weight"] = _dequantize_fp8_weight(q.clone(), scales, list(BLOCK), torch.float32)
save_file(
    {
        **expected,
        "partial.weight_fp8": q,
        "partial.weight_scale_inv": scales,
        # Every float8_e4m3fn bit pattern 0..=255 as torch decodes it to float32.
        "e4m3.table": torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32),
    },
    HERE / "deepseek-v3-fp8-tiny.dequantized.safetensors",
    metadata={"transformers": transformers.__version__, "torch": torch.__version__},
)
# An export into the FP8 checkpoint writes FP8 again. A layer whose MoE weights were all
# multiplied by 4 no longer fits any block's stored scale, so each block is quantised afresh:
# this is transformers' Fp8Quantize of the dequantised weights times 4 (exact in f32).
requantized = {}
for name, value in expected.items():
    if name.startswith("model.layers.1.mlp."):
        requantized.update(quantize.convert({name: value * 4}))
save_file(
    requantized,
    HERE / "deepseek-v3-fp8-tiny.requantized-x4.safetensors",
    metadata={"transformers": transformers.__version__, "torch": torch.__version__},
)

print(f"wrote {OUT.name}/ ({len(expected) - 1} quantised weights) with transformers {transformers.__version__}")
