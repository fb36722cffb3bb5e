#!/usr/bin/env python
"""A random-weight checkpoint of a released model's shape, in the layout its hub repository has, for benchmarks:
  gpt-oss-20b  openai/gpt-oss-20b's config.json as published (24 layers, every other one windowed over 128 tokens,
               attention sinks, YaRN x32 over 4096, 32 experts top-4, quantization_config mxfp4) and its tensors:
               the experts as MXFP4 `*_blocks` [E, N, K/32, 16] and `*_scales` [E, N, K/32] uint8 (random bytes,
               exponents 2^-6..2^-3), their biases and everything else bf16;
  gemma-3-12b  google/gemma-3-12b-it's language model as a Gemma3ForCausalLM (48 layers, 5 windowed over 1024 : 1
               global, rope bases 1e4 / 1e6 with linear x8 on the global ones), bf16.
Tensors are drawn in row chunks (on the GPU where there is one) and written straight to safetensors shards of about
4 GB with an index: no model is built. A byte-level BPE tokenizer of the vocabulary's size (the 256 byte symbols,
the model's special tokens at their ids, filler tokens) comes with it, so the server starts on the folder alone;
gpt-oss's config says model_type gpt_oss, which selects the harmony chat format.

  python scripts/make_hub_checkpoint.py gpt-oss-20b /tmp/gpt-oss-20b
  python scripts/make_hub_checkpoint.py gemma-3-12b /tmp/gemma3-12b [--tiny]   # --tiny: the same layout, CPU-test size
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, Iterator, Tuple

import torch

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4, "num_experts_per_tok": 4,
    "num_local_experts": 32, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 24,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "output_router_logits": False,
    "quantization_config": {"quant_method": "mxfp4",
                            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"]},
    "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088,
}
GEMMA_3_12B = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attention_dropout": 0.0, "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3840, "intermediate_size": 15360,
    "initializer_range": 0.02, "max_position_embeddings": 131072, "num_attention_heads": 16, "num_hidden_layers": 48,
    "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rope_theta": 1000000.0, "sliding_window": 1024,
    "sliding_window_pattern": 6, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 8,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 262208,
}
# the same layouts at a size the CPU tests run (windows short enough that their prompts cross them)
TINY = {
    "gpt-oss-20b": dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                        num_local_experts=4, experts_per_token=2, num_experts_per_tok=2, vocab_size=512,
                        sliding_window=8,
                        rope_scaling=dict(GPT_OSS_20B["rope_scaling"], original_max_position_embeddings=64)),
    "gemma-3-12b": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, query_pre_attn_scalar=16, num_hidden_layers=6, sliding_window=8,
                        layer_types=["sliding_attention"] * 5 + ["full_attention"], vocab_size=512),
}
SHAPES = {"gpt-oss-20b": GPT_OSS_20B, "gemma-3-12b": GEMMA_3_12B}
# special tokens at their ids in the real vocabularies (o200k_harmony's; Gemma 3's)
SPECIALS = {
    "gpt-oss-20b": {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
                    200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
                    200012: "<|call|>"},
    "gemma-3-12b": {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 105: "<start_of_turn>", 106: "<end_of_turn>"},
}
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                  "else 'user' }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
SHARD_BYTES = 4 << 30
STD = 0.02

Spec = Tuple[str, Tuple[int, ...], str]  # name, shape, how it is filled: normal | ones | zeros | bytes | exponents


def gpt_oss_tensors(c: Dict) -> Iterator[Spec]:
    """gpt-oss's tensors as the hub's checkpoint names and shapes them."""
    h, v, d = c["hidden_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    e, i = c["num_local_experts"], c["intermediate_size"]
    yield "model.embed_tokens.weight", (v, h), "normal"
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield p + "input_layernorm.weight", (h,), "ones"
        yield p + "post_attention_layernorm.weight", (h,), "ones"
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{proj}.weight", (rows, h), "normal"
            yield p + f"self_attn.{proj}.bias", (rows,), "normal"
        yield p + "self_attn.o_proj.weight", (h, q), "normal"
        yield p + "self_attn.o_proj.bias", (h,), "normal"
        yield p + "self_attn.sinks", (c["num_attention_heads"],), "normal"
        yield p + "mlp.router.weight", (e, h), "normal"
        yield p + "mlp.router.bias", (e,), "normal"
        for proj, n_out, k in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            yield p + f"mlp.experts.{proj}_blocks", (e, n_out, k // 32, 16), "bytes"
            yield p + f"mlp.experts.{proj}_scales", (e, n_out, k // 32), "exponents"
            yield p + f"mlp.experts.{proj}_bias", (e, n_out), "normal"
    yield "model.norm.weight", (h,), "ones"
    yield "lm_head.weight", (v, h), "normal"


def gemma3_tensors(c: Dict) -> Iterator[Spec]:
    """Gemma3ForCausalLM's tensors (its norms scale by 1 + weight: zeros are the identity; the head is tied)."""
    h, v, d, i = c["hidden_size"], c["vocab_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (v, h), "normal"
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            yield p + f"{norm}.weight", (h,), "zeros"
        for proj, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, q))):
            yield p + f"self_attn.{proj}.weight", shape, "normal"
        yield p + "self_attn.q_norm.weight", (d,), "zeros"
        yield p + "self_attn.k_norm.weight", (d,), "zeros"
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            yield p + f"mlp.{proj}.weight", shape, "normal"
    yield "model.norm.weight", (h,), "zeros"


def fill(shape: Tuple[int, ...], how: str, gen: torch.Generator, device: str) -> torch.Tensor:
    """One tensor on the CPU, drawn on `device` in chunks of rows (a vocabulary's embedding is a few GB)."""
    if how in ("ones", "zeros"):
        return (torch.ones if how == "ones" else torch.zeros)(shape, dtype=torch.bfloat16)
    out = torch.empty(shape, dtype=torch.uint8 if how in ("bytes", "exponents") else torch.bfloat16)
    flat = out.view(shape[0], -1)
    rows = max(1, (64 << 20) // flat.shape[1])
    for r in range(0, shape[0], rows):
        part = (min(rows, shape[0] - r), flat.shape[1])
        if how == "normal":
            t = (torch.randn(part, generator=gen, device=device) * STD).to(torch.bfloat16)
        elif how == "bytes":
            t = torch.randint(0, 256, part, generator=gen, device=device, dtype=torch.uint8)
        else:  # exponents 121..124: the e2m1 values (at most 6) times 2^-6..2^-3
            t = torch.randint(121, 125, part, generator=gen, device=device, dtype=torch.uint8)
        flat[r:r + part[0]] = t.cpu()
    return out


def write_weights(out: str, specs: Iterator[Spec], device: str) -> int:
    """Shards of about SHARD_BYTES and their index; returns the bytes written."""
    from safetensors.torch import save_file
    gen = torch.Generator(device=device).manual_seed(0)
    shard: Dict[str, torch.Tensor] = {}
    weight_map: Dict[str, str] = {}
    files, size, total, t0 = 0, 0, 0, time.time()

    def save() -> None:  # the tensors drawn so far as the next shard
        nonlocal shard, files, size
        files += 1
        name = f"model-{files:05d}.safetensors"
        save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        print(f"{name}: {len(shard)} tensors ({time.time() - t0:.0f}s)", flush=True)
        shard, size = {}, 0

    for name, shape, how in specs:
        shard[name] = t = fill(shape, how, gen, device)
        size += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            save()
    if shard:
        save()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return total


def write_tokenizer(out: str, vocab_size: int, specials: Dict[int, str], cfg: Dict, chat_template: str) -> None:
    """A byte-level BPE of vocab_size tokens: the specials at their ids, the 256 byte symbols, then fillers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    alphabet = iter(sorted(set(bytes_to_unicode().values())))
    vocab = {}
    for i in range(vocab_size):
        vocab[specials.get(i) or next(alphabet, None) or f"<w{i}>"] = i
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, special=True) for s in specials.values()])
    eos = cfg["eos_token_id"]
    names = {k: specials[cfg[k + "_token_id"]] for k in ("bos", "pad") if cfg.get(k + "_token_id") in specials}
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=specials[eos[0] if isinstance(eos, list) else eos],
                                   **{k + "_token": v for k, v in names.items()})
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("out", help="the checkpoint's folder (must not exist, or be empty)")
    p.add_argument("--tiny", action="store_true", help="the same layout and config keys at a CPU-test size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to draw")
    a = p.parse_args()
    if os.path.isdir(a.out) and os.listdir(a.out):
        p.error(f"{a.out} is not empty")
    os.makedirs(a.out, exist_ok=True)
    cfg = dict(SHAPES[a.shape], **(TINY[a.shape] if a.tiny else {}))
    vocab = cfg["vocab_size"]
    past = [i for i in SPECIALS[a.shape] if i >= vocab]  # (in a tiny vocabulary only)

    def token_id(i: int) -> int:  # a special past a tiny vocabulary goes among its last 32 ids
        return vocab - 32 + i - min(past) if i >= vocab else i
    specials = {token_id(i): s for i, s in SPECIALS[a.shape].items()}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in cfg:
            cfg[key] = [token_id(i) for i in cfg[key]] if isinstance(cfg[key], list) else token_id(cfg[key])
    gpt_oss = a.shape == "gpt-oss-20b"
    t0 = time.time()
    total = write_weights(a.out, (gpt_oss_tensors if gpt_oss else gemma3_tensors)(cfg), a.device)
    write_tokenizer(a.out, vocab, specials, cfg, "" if gpt_oss else GEMMA_TEMPLATE)
    with open(os.path.join(a.out, "config.json"), "w") as f:  # last: a folder with a config is complete
        json.dump(cfg, f, indent=2)
    print(f"{a.out}: {a.shape}{' (tiny)' if a.tiny else ''}, {total / 1e9:.2f} GB in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
