"""Random-weight EAGLE-3 heads in the public layout (config.json + model.safetensors with d2t), for a tiny target."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch


def head_config(target: str, draft_vocab: Optional[int] = None, **overrides) -> dict:
    with open(os.path.join(target, "config.json")) as f:
        t = json.load(f)
    layers = t["num_hidden_layers"]
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": t["hidden_size"],
           "intermediate_size": t["intermediate_size"], "num_attention_heads": t["num_attention_heads"],
           "num_key_value_heads": t["num_key_value_heads"], "head_dim": t.get("head_dim", 16),
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": t["vocab_size"],
           "draft_vocab_size": draft_vocab or t["vocab_size"], "target_hidden_size": t["hidden_size"],
           # the config counts layer outputs: -1, 0, ... reads the inputs of layers 0, 1, ...
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in range(min(3, layers))]}}
    cfg.update(overrides)
    return cfg


def save_eagle3_head(path: str, target: str, seed: int = 0, draft_vocab: Optional[int] = None,
                     **overrides) -> str:
    """A head with random weights for `target`; a draft vocabulary of `draft_vocab` ids maps draft id i to target
    id 3 + i (past the special tokens)."""
    from safetensors.torch import save_file

    from minisrv.models.eagle3 import Eagle3Config, Eagle3Head
    cfg = head_config(target, draft_vocab, **overrides)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.from_hf_config(cfg), 64)
    for p in head.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.2)
    tensors = {k: v.contiguous() for k, v in head.state_dict().items()}
    n = cfg["draft_vocab_size"]
    tensors["d2t"] = torch.full((n,), 3 if n < cfg["vocab_size"] else 0, dtype=torch.int64)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path
