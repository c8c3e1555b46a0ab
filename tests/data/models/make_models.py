"""Writes the tiny whole-model checkpoints of tests/data/models with transformers' own code.

For each family: a folder written by `save_pretrained` (float32, two shards with an index, as
the Hub's releases are sharded), and `<folder>.expected.safetensors` with what transformers
computes on it:

- `ids` `[B, T]` (int64): a batch of token ids;
- `logits` `[B, T, vocab]`: `AutoModelForCausalLM` on `ids`, computed in float64 from the
  stored float32 weights and rounded to float32;
- `loss` `[1]`: the causal-LM loss of `ids` (labels = ids, shifted inside, mean over the
  B·(T−1) predicted tokens), float64 → float32; without the router's auxiliary loss;
- `grad.<parameter name>`: torch autograd's gradient of `loss` for every parameter, in float64
  → float32, under the checkpoint's tensor names (per-expert names, as stored);
- `prompt` `[P]` (int64) and `greedy` `[N]` (int64): `generate(prompt, do_sample=False,
  max_new_tokens=32)` in float32 with transformers' KV cache (the new ids only; fewer than 32
  if the end-of-sequence id came). The script checks that float64 generation gives the same
  ids, so that no near-tie decides the reference.

Run with transformers 5.24 and torch 2.15: `python make_models.py` (about a minute on a CPU).
Each configuration switches on the rules its family has: grouped-query attention (4 query
heads share 2 key/value heads), sliding windows shorter than the sequence, dense and MoE
layers mixed, biases on q/k/v, per-head or whole-projection q/k norms, clipped q/k/v,
renormalised or plain top-k, a gated shared expert, and each rotary rule (Mixtral linear
scaling, Qwen2-MoE none, Qwen3-MoE YaRN, OLMoE Llama 3's); DeepSeek-V3 with multi-head latent
attention (q and kv low-rank projections, interleaved rotary dimensions, YaRN with `mscale` in
the softmax scale), a dense first layer, sigmoid group-limited routing with a score bias and a
shared expert; GPT-OSS with attention sinks, sliding and full layers alternating, YaRN without
truncation, biases everywhere and its clamped SwiGLU experts; Llama 4 (text) with chunked
attention shorter than the sequence, a NoPE layer with attention temperature tuning, L2 q/k
norms, interleaved rotary pairs, MoE and dense layers alternating, top-1 routing with the
weight on the expert's input and a shared expert.
"""

import json
import os
import shutil

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
B, T = 2, 12
PROMPT = 8
NEW = 32

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def families():
    """(folder, config) of every family, in the order the issue lists them."""
    return [
        (
            "mixtral-tiny",
            transformers.MixtralConfig(
                **COMMON,
                intermediate_size=24,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=5,
                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            ),
        ),
        (
            "qwen2-moe-tiny",
            transformers.Qwen2MoeConfig(
                **COMMON,
                intermediate_size=40,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=20,
                num_experts=6,
                num_experts_per_tok=3,
                norm_topk_prob=False,
                decoder_sparse_step=1,
                mlp_only_layers=[1],
                use_sliding_window=True,
                sliding_window=5,
                max_window_layers=1,
                qkv_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            ),
        ),
        (
            "qwen3-moe-tiny",
            transformers.Qwen3MoeConfig(
                **COMMON,
                head_dim=12,
                intermediate_size=40,
                moe_intermediate_size=16,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[0],
                use_sliding_window=True,
                sliding_window=6,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 1000000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            ),
        ),
        (
            "olmoe-tiny",
            transformers.OlmoeConfig(
                **COMMON,
                intermediate_size=16,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=False,
                clip_qkv=1.5,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            ),
        ),
        (
            "deepseek-v3-tiny",
            transformers.DeepseekV3Config(
                # Every head has its own keys and values, as DeepSeek-V3's attention expects.
                **{**COMMON, "num_key_value_heads": 4},
                intermediate_size=40,
                moe_intermediate_size=12,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_group=2,
                topk_group=1,
                n_shared_experts=1,
                routed_scaling_factor=2.5,
                norm_topk_prob=True,
                first_k_dense_replace=1,
                q_lora_rank=16,
                kv_lora_rank=12,
                qk_nope_head_dim=8,
                qk_rope_head_dim=4,
                v_head_dim=6,
                rope_interleave=True,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                },
            ),
        ),
        (
            "gpt-oss-tiny",
            transformers.GptOssConfig(
                **COMMON,
                head_dim=8,
                intermediate_size=16,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=5,
                attention_bias=True,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                },
            ),
        ),
        (
            "llama4-tiny",
            transformers.Llama4TextConfig(
                **{**COMMON, "num_hidden_layers": 4},
                head_dim=8,
                intermediate_size=16,
                intermediate_size_mlp=40,
                num_local_experts=4,
                num_experts_per_tok=1,
                interleave_moe_layer_step=2,
                attention_chunk_size=4,
                use_qk_norm=True,
                attn_temperature_tuning=True,
                floor_scale=4,
                attn_scale=0.1,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            ),
        ),
    ]


def randomise(model, seed):
    """Normal weights of std 0.2 (norm weights 1 ± 0.2, biases std 0.1), so that routing, the
    norms and the biases all matter; transformers' own initialisation leaves norms at 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)
        # DeepSeek-V3's score-correction bias is a buffer (chosen by, never trained by gradient).
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g, dtype=torch.float64))


def stored_names(folder):
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        return set(json.load(f)["weight_map"])


def stored_grads(model, tmp):
    """Every parameter's gradient under the stored tensor names and layout: the model with its
    gradients in place of its weights, written by `save_pretrained` (transformers 5 holds a
    layer's experts stacked and renames some modules, and writes them back as the checkpoint
    had them; its own writer does the same to the gradients)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
        # Buffers (DeepSeek-V3's score-correction bias) take no gradient: zeros.
        for b in model.buffers():
            b.zero_()
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.float32).save_pretrained(tmp)
    out = {}
    for name in os.listdir(tmp):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(tmp, name), "pt") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key)
    shutil.rmtree(tmp)
    return out


def main():
    torch.manual_seed(0)
    for seed, (folder, config) in enumerate(families()):
        path = os.path.join(HERE, folder)
        shutil.rmtree(path, ignore_errors=True)
        config._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomise(model, 1000 + seed)
        model.save_pretrained(path, max_shard_size="60KB")
        stored = stored_names(path)

        # Logits, loss and gradients in float64 from the stored float32 weights.
        g = torch.Generator().manual_seed(2000 + seed)
        ids = torch.randint(3, config.vocab_size, (B, T), generator=g)
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager")
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
        tensors = {
            "ids": ids,
            "logits": out.logits.detach().float(),
            "loss": out.loss.detach().float().reshape(1),
        }
        grads = stored_grads(ref, path + ".grads")
        if set(grads) != stored:
            raise SystemExit(f"{folder}: the gradients' names differ from the checkpoint's")
        for name, grad in grads.items():
            tensors[f"grad.{name}"] = grad.contiguous()

        # Greedy generation in float32, checked against float64.
        # The first prompt whose greedy continuation runs the whole 32 ids (the
        # end-of-sequence id ends some early).
        models = [
            transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
            )
            for dtype in (torch.float32, torch.float64)
        ]
        for _ in range(50):
            prompt = torch.randint(3, config.vocab_size, (1, PROMPT), generator=g)
            ids32 = [m.generate(prompt, do_sample=False, max_new_tokens=NEW, pad_token_id=0)[0, PROMPT:] for m in models]
            if len(ids32[0]) == NEW:
                break
        else:
            raise SystemExit(f"{folder}: no prompt of 50 ran 32 new ids")
        if not torch.equal(ids32[0], ids32[1]):
            raise SystemExit(f"{folder}: float32 and float64 greedy ids differ: a near tie; change the seed")
        tensors["prompt"] = prompt[0].contiguous()
        tensors["greedy"] = ids32[0].contiguous()
        meta = {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0], "model_type": config.model_type}
        save_file(tensors, os.path.join(HERE, f"{folder}.expected.safetensors"), metadata={"meta": json.dumps(meta)})
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        print(f"{folder}: {len(stored)} tensors in {size} bytes, loss {out.loss.item():.6f}, greedy {len(ids32[0])} ids")


if __name__ == "__main__":
    main()
