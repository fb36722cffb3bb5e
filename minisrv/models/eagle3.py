"""An EAGLE-3 draft head, in the public layout SGLang and vLLM load (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B,
AngelSlim/Qwen3-8B_eagle3, SpecForge's output; scripts/train_eagle3.py writes it too).

The head predicts the target's next token from the target's own hidden states: `fc` maps three of them (the residual
stream entering three of the target's layers, `aux_layer_ids`) to one; its one decoder layer takes that and the
embedding of the token that followed (each normed, then concatenated: its q/k/v read 2 x hidden), attends over the
head's own keys of the earlier positions, and its norm and `lm_head` give logits over a draft vocabulary, whose ids
map to the target's by `d2t` (target id = draft id + d2t[draft id]). Entry p pairs the target's hidden state at p
with token p + 1 and predicts token p + 2. Chained drafting feeds the head's own pre-norm output back in place of
the target's hidden state (no fc: it is already one hidden state wide). The embedding is the target's.

The attention between `qkv` and `finish` is the caller's: engine/speculative/eagle.py's over its paged cache, and
`forward_dense` (causal over one sequence) for training and tests.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .layers import RotaryEmbedding
from .norms import RMSNorm

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: Optional[Tuple[int, ...]]  # the target layers whose input is read; None: 2, L // 2, L - 3

    @classmethod
    def from_hf_config(cls, cfg: Dict[str, Any]) -> "Eagle3Config":
        archs = cfg.get("architectures") or []
        if archs and not any(a in EAGLE3_ARCHITECTURES for a in archs):
            raise ValueError(f"not an EAGLE-3 head: its config names {archs}, not one of {EAGLE3_ARCHITECTURES}")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        rope = cfg.get("rope_scaling") or None
        if rope and rope.get("rope_type", rope.get("type")) == "default":
            rope = None
        return cls(hidden, cfg["intermediate_size"], heads, cfg.get("num_key_value_heads", heads),
                   cfg.get("head_dim") or hidden // heads, cfg.get("rms_norm_eps", 1e-6),
                   cfg.get("rope_theta", 10000.0), rope, cfg["vocab_size"],
                   cfg.get("draft_vocab_size") or cfg["vocab_size"], cfg.get("target_hidden_size") or hidden,
                   # the config counts a layer's output (its index); the head reads the next layer's input
                   tuple(i + 1 for i in ids) if ids else None)

    def layers_read(self, target_layers: int) -> Tuple[int, ...]:
        return self.aux_layer_ids or (2, target_layers // 2, target_layers - 3)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Head(nn.Module):
    def __init__(self, c: Eagle3Config, max_positions: int) -> None:
        super().__init__()
        self.config = c
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.rotary = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """Entries' queries [T, Hq, D], keys and values [T, Hkv, D] (rotated), and the residual the layer adds
        to. embeds: [T, hidden] of tokens p + 1; hidden: [T, 3 x target hidden] (the target's, fc applied here) or
        [T, hidden] (the head's own pre-norm output, chained)."""
        c, layer = self.config, self.midlayer
        if hidden.shape[-1] != c.hidden_size:
            hidden = self.fc(hidden)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        t = x.shape[0]
        a = layer.self_attn
        q, k, v = (proj(x).view(t, -1, c.head_dim) for proj in (a.q_proj, a.k_proj, a.v_proj))
        q, k = self.rotary(positions, q, k)
        return q, k, v, hidden

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer's rest after attention ([T, Hq, D] in): its pre-norm output [T, hidden]."""
        layer = self.midlayer
        h = layer.self_attn.o_proj(attn_out.reshape(attn_out.shape[0], -1)) + residual
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [T, draft vocab] of pre-norm outputs."""
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward_dense(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The pre-norm outputs [T, hidden] of one sequence's entries, each attending to the entries before it and
        itself (causal): training's first step, and the reference the serving path is tested against."""
        q, k, v, residual = self.qkv(embeds, hidden, positions)
        return self.finish(attend(q, k, v, causal=True), residual)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: Optional[torch.Tensor] = None
           ) -> torch.Tensor:
    """Grouped-query attention of q [T, Hq, D] over k, v [S, Hkv, D]: [T, Hq, D]. causal aligns the queries with
    the last T keys (bottom right); mask: [T, S] bool, True where a query may look."""
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1)
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1)
    if causal and mask is None:
        t, s = q.shape[0], k.shape[0]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    out = F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float(), attn_mask=mask)
    return out.transpose(0, 1).to(q.dtype)


def load_eagle3_head(path: str, max_positions: int, dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    """A head from its directory (config.json, and model.safetensors or pytorch_model.bin): a missing directory,
    file or tensor, or a tensor of the wrong shape, is a clear error."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--speculative-draft-model-path {path!r}: no such directory (an EAGLE-3 head's "
                                f"directory holds config.json and its weights)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json: not an EAGLE-3 head's directory")
    with open(cfg_path) as f:
        config = Eagle3Config.from_hf_config(json.load(f))
    tensors = {k.removeprefix("model."): v for k, v in _read_tensors(path).items()}
    tensors.pop("t2d", None)
    tensors.pop("embed_tokens.weight", None)  # the target's embedding is used
    if "d2t" not in tensors:
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError(f"{path}: a draft vocabulary of {config.draft_vocab_size} tokens needs a d2t tensor")
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.int64)
    with torch.device("meta"):
        head = Eagle3Head(config, max_positions)
    expected = head.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{path}: not an EAGLE-3 head: tensors missing: {', '.join(missing)}")
    for name, t in tensors.items():
        if name in expected and tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{path}: tensor {name} has shape {tuple(t.shape)}; its config says "
                             f"{tuple(expected[name].shape)}")
    head = head.to_empty(device=device)
    head.load_state_dict({k: tensors[k] for k in expected}, strict=True)  # (d2t cast to int64 as it is copied)
    head = head.to(dtype).eval().requires_grad_(False)
    head.rotary.reset_buffers(device)  # float32 whatever the head's dtype
    return head


def _read_tensors(path: str) -> Dict[str, torch.Tensor]:
    st = os.path.join(path, "model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file
        return load_file(st)
    pt = os.path.join(path, "pytorch_model.bin")
    if os.path.isfile(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path}: no model.safetensors or pytorch_model.bin")
