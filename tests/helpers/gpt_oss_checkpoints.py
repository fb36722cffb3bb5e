"""A gpt-oss checkpoint with MXFP4 experts in the hub's layout, written from a tiny one in transformers' layout, and its
dequantised twin: the same checkpoint with the experts transformers' own MXFP4 dequantisation makes of the same bytes,
in transformers' layout, which HF runs as the reference."""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Tuple

import torch

from .gpt_oss_interpreted_checks import random_mxfp4

STACKED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
MXFP4_CONFIG = {"quant_method": "mxfp4",  # as gpt-oss-20b's config.json has it
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}


def write_mxfp4_pair(src: str, dst: str, twin: str, seed: int = 0) -> Tuple[str, str]:
    """dst: src with each stacked expert tensor [E, K, N] replaced by random MXFP4 `_blocks` [E, N, K/32, 16] and
    `_scales` [E, N, K/32] (N rows interleaved gate/up, as the hub's) and quantization_config mxfp4; twin: src with
    those experts dequantised by transformers.integrations.mxfp4 (back in [E, K, N]). Returns (dst, twin)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    packed, dense = {}, {}
    for name, t in tensors.items():
        if not STACKED.search(name):
            packed[name] = dense[name] = t
            continue
        e, k, n = t.shape
        w = random_mxfp4(e, n, k, gen)
        blocks = w.blocks.reshape(e, n, k // 32, 16)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, w.scales
        dense[name] = convert_moe_packed_tensors(blocks, w.scales, dtype=torch.float32)
    for path, weights, quantized in ((dst, packed, True), (twin, dense, False)):
        os.makedirs(path, exist_ok=True)
        for f in os.listdir(src):
            if f != "model.safetensors" and os.path.isfile(os.path.join(src, f)):
                shutil.copy(os.path.join(src, f), path)
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        if quantized:
            cfg["quantization_config"] = MXFP4_CONFIG
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"),
                  metadata={"format": "pt"})
    return dst, twin
