"""A tiny HF checkpoint written as a GGUF file the way llama.cpp's converter writes one: float32 tensors under
llama.cpp's names, Llama-architecture q/k rows permuted for its rotary, and a MoE layer's experts stacked into one
3-D tensor each (ffn_gate_exps / ffn_up_exps / ffn_down_exps, router ffn_gate_inp, expert_count metadata). Mixtral is
written as llama.cpp writes it: architecture "llama" with experts; Phi-3 as "phi3", with its fused attn_qkv and
ffn_up, its rotary width, and LongRoPE's factors as tensors."""
from __future__ import annotations

import json
import os
import re
from typing import Callable, Optional, Union

import torch

from . import kquant_blocks

LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}
PHI3_FUSED = {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}
EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
EXPERT_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave the two rotary halves of each head's rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_dir: str, out: str, arch: str, quant: Union[None, str, Callable[[str], str]] = None) -> None:
    """arch: llama.cpp's architecture name ("llama", "qwen2", "qwen3", "qwen3moe"; "llama" for Mixtral).
    quant: a block type ("Q4_0", "Q4_1", "Q8_0") for the 2-D matrices (projections, embedding, head), quantised by
    gguf's own quantiser as llama.cpp's quantize tool would, or a function of the GGUF tensor name giving each one's
    type (Q5_0, Q5_1, Q4_K, Q5_K and Q6_K too: kquant_blocks.py's quantiser); None: every tensor float32."""
    import numpy as np
    from gguf import GGUFWriter
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize
    from safetensors.torch import load_file
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = GGUFWriter(out, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    if arch == "phi3":
        _phi3_metadata(w, cfg)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    stacked = {}  # (layer, kind) -> {expert: tensor}

    def add(gguf_name: str, t: torch.Tensor) -> None:
        data = np.ascontiguousarray(t.float().numpy())
        if quant is None or data.ndim != 2:
            w.add_tensor(gguf_name, data)
            return
        name = quant(gguf_name) if callable(quant) else quant
        kind = GGMLQuantizationType[name]
        raw = kquant_blocks.quantize(data, name) if name in kquant_blocks.BLOCK else quantize(data, kind)
        w.add_tensor(gguf_name, raw, raw_dtype=kind)

    for name, t in tensors.items():
        if name in top:
            add(top[name], t)
            continue
        parts = name.split(".")
        rest = ".".join(parts[3:])
        expert = EXPERT.match(rest)
        if expert:
            stacked.setdefault((parts[2], EXPERT_KIND[expert.group(2)]), {})[int(expert.group(1))] = t
            continue
        if arch == "llama" and rest == "self_attn.q_proj.weight":
            t = llama_cpp_permute(t, cfg["num_attention_heads"])
        elif arch == "llama" and rest == "self_attn.k_proj.weight":
            t = llama_cpp_permute(t, cfg["num_key_value_heads"])
        add(f"blk.{parts[2]}.{LAYER_NAMES.get(rest) or PHI3_FUSED[rest]}", t)
    for (layer, kind), by_expert in sorted(stacked.items()):
        t = torch.stack([by_expert[e] for e in range(len(by_expert))])
        w.add_tensor(f"blk.{layer}.ffn_{kind}_exps.weight", np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _phi3_metadata(w, cfg: dict) -> None:
    """What convert_hf_to_gguf.py's Phi3MiniModel writes beyond the common keys."""
    import math

    import numpy as np
    rope = cfg["rope_parameters"]
    original = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
    w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg["hidden_size"])
                               // cfg["num_attention_heads"])
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
