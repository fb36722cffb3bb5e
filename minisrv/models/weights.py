"""Checkpoint tensors (under HF names) into our parameters: which tensor goes where, and the checks that every
expected tensor comes exactly once, with the shape the config implies.

Our model fuses q/k/v and gate/up into one projection each, pads the vocabulary for tensor parallelism and holds
one rank's shard: the expected-tensor map says, for each HF name, which rows of which parameter it fills and which
slice of it this rank reads. A missing, extra, repeated or mis-shaped tensor is an error that names it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from .checkpoint import StoredTensor, WeightLoadError
from .fp8 import Fp8Linear
from .layers import ModelArgs
from .sharding import ShardPlan, Slice

FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

VOCAB_SPLIT = ("model.embed_tokens.weight", "lm_head.weight")  # split by vocabulary rows, padded


@dataclass
class Target:
    """Where a checkpoint tensor goes: rows [row, row + piece's length) of `param` (a fused projection holds
    several), taken from `piece` of a tensor of shape `full`; through `fp8` (quantised as it is written) when the
    param is an FP8 layer's weight."""

    param: torch.Tensor
    row: int
    full: Tuple[int, ...]
    piece: Optional[Slice]
    fp8: Optional[Fp8Linear] = None


def expected_tensors(model: nn.Module, args: ModelArgs, plan: ShardPlan) -> Dict[str, Target]:
    """HF name -> where its (slice of the) checkpoint tensor goes in our parameters."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv,
            "gate_proj": args.intermediate_size, "up_proj": args.intermediate_size}
    out: Dict[str, Target] = {}
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        fp8 = module if isinstance(module, Fp8Linear) and leaf == "weight" else None
        if isinstance(module, Fp8Linear) and leaf == "weight_scale":
            continue  # written with its weight's rows
        parts = name.split(".")
        fused = next((f for f in FUSED if f in parts), None)
        if fused is None:
            full = (args.vocab_size,) + tuple(p.shape[1:]) if name in VOCAB_SPLIT else \
                _unsharded_shape(name, tuple(p.shape), args)
            out[name] = Target(p, 0, full, plan.slice_for(name), fp8)
            continue
        off = 0
        for sub in FUSED[fused]:
            hf = name.replace(fused, sub)
            full = (rows[sub],) + tuple(p.shape[1:])
            piece = plan.slice_for(hf)
            out[hf] = Target(p, off, full, piece, fp8)
            off += piece.length if piece is not None else rows[sub]
    return out


def _unsharded_shape(name: str, shape: Tuple[int, ...], args: ModelArgs) -> Tuple[int, ...]:
    """The checkpoint shape of a parameter that is not fused (row-parallel ones are split by columns)."""
    if name.endswith("o_proj.weight"):
        return (shape[0], args.num_heads * args.head_dim)
    if name.endswith("down_proj.weight"):
        return (shape[0], args.intermediate_size)
    return shape


def load_weights(model: nn.Module, tensors: Iterator[Tuple[str, StoredTensor]], args: ModelArgs,
                 plan: Optional[ShardPlan] = None) -> None:
    """Fill the model's parameters (this rank's shard under `plan`) from (HF name, stored tensor) pairs."""
    plan = plan or ShardPlan.of(args)
    expected = expected_tensors(model, args, plan)
    seen = set()
    for name, stored in tensors:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and args.tie_word_embeddings:
            continue  # some checkpoints store the tied head too
        shape = tuple(stored.shape)
        if name not in expected:
            raise WeightLoadError(f"unexpected tensor {name!r} (shape {shape}) in the checkpoint")
        t = expected[name]
        if shape != t.full:
            raise WeightLoadError(f"tensor {name!r} has shape {shape}, expected {t.full}")
        if name in seen:
            raise WeightLoadError(f"tensor {name!r} appears twice in the checkpoint")
        w = stored.read(t.piece)
        with torch.no_grad():
            if t.fp8 is not None:
                t.fp8.load_rows(t.row, w)
                seen.add(name)
                continue
            t.param.data[t.row:t.row + w.shape[0]].copy_(w.to(t.param.dtype))
            if name in VOCAB_SPLIT:
                t.param.data[w.shape[0]:].zero_()  # the vocabulary's padding rows (on the last rank)
        seen.add(name)
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise WeightLoadError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}{more}")
