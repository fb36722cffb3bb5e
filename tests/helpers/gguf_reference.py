"""A Llama-architecture GGUF file as an HF checkpoint of its dequantised weights, for the float64 reference: every
matrix read in float64 from ggml's block definitions (kquant_blocks, and Q8_0 here), apart from minisrv's and gguf's
readers; llama.cpp's q/k row order undone; the config is transformers' own reading of the file's metadata."""
from __future__ import annotations

import os

import numpy as np
import torch

from .gguf_writer import LAYER_NAMES
from .kquant_blocks import BLOCK, dequantize_f64

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {g: hf for hf, g in LAYER_NAMES.items() if not hf.startswith("block_sparse_moe")}


def read_f64(raw: np.ndarray, kind: str, rows: int, cols: int) -> np.ndarray:
    """One tensor's values in float64: the k-quant and 5-bit blocks, Q8_0 (a float16 scale times 32 int8), floats."""
    if kind in BLOCK:
        return dequantize_f64(raw, kind, rows, cols)
    if kind == "Q8_0":
        b = np.asarray(raw, dtype=np.uint8).reshape(-1, 34)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float64)
        return (d * b[:, 2:].view(np.int8).astype(np.float64)).reshape(rows, cols)
    assert kind in ("F32", "F16"), kind
    return np.asarray(raw).astype(np.float64).reshape(rows, cols)


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)
    return f"model.layers.{layer}.{_LAYER[rest]}"


def write_dequantised_hf(gguf_path: str, out: str) -> str:
    """out: model.safetensors of the file's values read in float64, each tensor stored in float32 where that is exact
    and in float64 otherwise; and, unless out has a config.json already, transformers' AutoConfig of the GGUF."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import AutoConfig
    if os.path.exists(os.path.join(out, "config.json")):
        cfg = AutoConfig.from_pretrained(out)
    else:
        cfg = AutoConfig.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    heads = {"attn_q.weight": cfg.num_attention_heads, "attn_k.weight": cfg.num_key_value_heads}
    state = {}
    for t in GGUFReader(gguf_path).tensors:
        shape = [int(n) for n in reversed(t.shape)]  # ggml lists the row length first
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        v = torch.from_numpy(read_f64(t.data, t.tensor_type.name, rows, cols)).reshape(shape)
        h = heads.get(t.name.split(".", 2)[-1]) if t.name.startswith("blk.") else None
        if h:  # undo llama.cpp's permutation of q/k rows for its rotary
            v = v.reshape(h, v.shape[0] // h // 2, 2, -1).swapaxes(1, 2).reshape(v.shape)
        state[hf_name(t.name)] = v.float() if torch.equal(v.float().double(), v) else v
    if not os.path.exists(os.path.join(out, "config.json")):
        os.makedirs(out, exist_ok=True)
        cfg.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, "model.safetensors"))
    return out
