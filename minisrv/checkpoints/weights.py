"""Checkpoint tensors (under HF names) into our parameters: which tensor goes where, each expected exactly once with
the shape the config implies (a missing, extra, repeated or mis-shaped tensor is an error naming it).

Our model fuses q/k/v and gate/up, stacks a layer's experts, pads the vocabulary for tensor parallelism and holds one
rank's shard; Mixtral's names are read as the Qwen-MoE names they stand for, a vision-language checkpoint's language
model (Gemma3ForConditionalGeneration: `language_model.model.*`, or `model.language_model.*`) as a causal LM's (its
vision tower and projector are not read), and a checkpoint's own fused qkv_proj and gate_up_proj (Phi-3's) as the
q/k/v and gate/up tensors they join (split_fused); gpt-oss's stacked experts come per expert (gpt_oss_experts.py)."""
from __future__ import annotations

import re
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from minisrv.models.args import VISION_LANGUAGE, ModelArgs
from minisrv.models.block_layers import BlockLinear
from .checkpoint import StoredTensor, WeightLoadError
from minisrv.models.fp8 import Fp8Linear
from minisrv.models.moe import Experts
from minisrv.models.planes_layers import PlanesLinear
from minisrv.models.w4a16 import W4A16Experts, W4A16Linear
from minisrv.models.sharding import ShardPlan, Slice

FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

# layers that hold their matrix in a form of their own (FP8 rows and scales, blocks, planes, 4 bits) and write its
# rows themselves (their load_rows), under the name of the weight it replaces
ROW_WRITERS = (Fp8Linear, BlockLinear, PlanesLinear, W4A16Linear)
VOCAB_SPLIT = ("model.embed_tokens.weight", "lm_head.weight")  # split by vocabulary rows, padded

ALIASES = [  # Mixtral's and vision-language models' tensor names -> the names our expected map uses
    (re.compile(r"^(language_model\.model|model\.language_model)\."), "model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
    (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."),
    (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj."),
    (re.compile(r"\.mlp\.router\."), ".mlp.gate."),  # gpt-oss's
]


VISION_PARTS = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")


def canonical_name(name: str) -> str:
    for pattern, replacement in ALIASES:
        name = pattern.sub(replacement, name)
    return name


@dataclass
class Target:
    """Where a checkpoint tensor goes: rows [row, row + piece's length) of `param`, from `piece` of a tensor of shape
`full`; through load_rows(row, w) instead for an FP8 weight, a block layer's records, a 4-bit layer's (w4a16.py)
or one expert's rows (its experts' load_rows for it)."""

    param: Optional[torch.Tensor]
    row: int
    full: Tuple[int, ...]
    piece: Optional[Slice]
    load_rows: Optional[Callable[[int, Any], None]] = None


def expected_tensors(model: nn.Module, args: ModelArgs, plan: ShardPlan) -> Dict[str, Target]:
    """HF name -> where its (slice of the) checkpoint tensor goes in our parameters."""
    out: Dict[str, Target] = {}
    for owner, module in model.named_modules():
        if isinstance(module, (Experts, W4A16Experts)):  # (scales are written with their rows)
            for which in ("w13", "w2"):
                out.update(_expert_targets(owner, module, which, args, plan))
            continue
        params = [(name, p, tuple(p.shape), None) for name, p in module.named_parameters(owner, recurse=False)]
        if isinstance(module, ROW_WRITERS):  # its matrix, and its bias
            params = [(f"{owner}.weight", None, (module.out_features, module.in_features), module.load_rows)] + \
                [x for x in params if x[0].endswith(".bias")]
        for name, p, shape, writer in params:
            out.update(_targets(name, p, shape, writer, args, plan))
    return out


def _targets(name: str, p: Optional[torch.Tensor], shape: Tuple[int, ...], writer: Optional[Any], args: ModelArgs,
             plan: ShardPlan) -> Dict[str, Target]:
    """The checkpoint tensor(s) of one of our parameters: itself, or the q/k/v or gate/up it fuses."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    fused = next((f for f in FUSED if f in name.split(".")), None)
    if fused is None:
        full = (args.vocab_size,) + shape[1:] if name in VOCAB_SPLIT else _unsharded_shape(name, shape, args)
        return {name: Target(p, 0, full, plan.slice_for(name), writer)}
    width = _mlp_width(name, args)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": width, "up_proj": width}
    out, off = {}, 0
    for sub in FUSED[fused]:
        hf = name.replace(fused, sub)
        piece = plan.slice_for(hf)
        out[hf] = Target(p, off, (rows[sub],) + shape[1:], piece, writer)
        off += piece.length if piece is not None else rows[sub]
    return out


def _expert_targets(owner: str, experts: Any, which: str, args: ModelArgs, plan: ShardPlan) -> Dict[str, Target]:
    """The per-expert checkpoint tensors of a layer's stacked `which` (w13: gate then up rows; w2: down), and their
    biases where the experts have them."""
    h, width = args.hidden_size, args.moe_intermediate_size
    parts = (("gate_proj", (width, h)), ("up_proj", (width, h))) if which == "w13" else (("down_proj", (h, width)),)
    bias = getattr(experts, which + "_bias", None)
    out: Dict[str, Target] = {}
    for e in range(args.num_experts):
        load, row = functools.partial(experts.load_rows, which, e), 0
        for sub, full in parts:
            hf = f"{owner}.{e}.{sub}"
            piece = plan.slice_for(hf + ".weight")
            out[hf + ".weight"] = Target(None, row, full, piece, load)
            if bias is not None:  # (down's is held whole: slice_for gives None)
                out[hf + ".bias"] = Target(bias[e], row, full[:1], plan.slice_for(hf + ".bias"))
            row += piece.length if piece is not None else full[0]
    return out


def _mlp_width(name: str, args: ModelArgs) -> int:
    """The whole width of the MLP a parameter belongs to: the shared expert's or the dense MLP's."""
    return args.shared_expert_intermediate_size if ".shared_expert." in name else args.intermediate_size


def _unsharded_shape(name: str, shape: Tuple[int, ...], args: ModelArgs) -> Tuple[int, ...]:
    """The checkpoint shape of a parameter that is not fused (row-parallel ones are split by columns)."""
    if name.endswith("o_proj.weight"):
        return (shape[0], args.num_heads * args.head_dim)
    if name.endswith(".sinks"):  # (split with the heads)
        return (args.num_heads,)
    if name.endswith("down_proj.weight"):
        return (shape[0], _mlp_width(name, args))
    return shape


def split_fused(tensors: Iterator[Tuple[str, StoredTensor]], args: ModelArgs) -> Iterator[Tuple[str, StoredTensor]]:
    """The checkpoint's tensors with each fused qkv_proj / gate_up_proj one (Phi-3's) as its q, k, v / gate, up row
    ranges under their own names: each tensor-parallel rank then reads only its heads of each and its share of
    gate and of up, as from a checkpoint that stores them apart."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    for name, stored in tensors:
        fused = next((f for f in FUSED if f in name.split(".")), None)
        if fused is None:
            yield name, stored
            continue
        rows = stored.shape[0]
        sizes = (q, kv, kv) if fused == "qkv_proj" else (rows // 2, rows // 2)
        if sum(sizes) != rows:
            raise WeightLoadError(f"tensor {name!r} has shape {tuple(stored.shape)}: {rows} rows, expected "
                                  f"{sum(sizes)}")
        start = 0
        for sub, n in zip(FUSED[fused], sizes):
            yield name.replace(fused, sub), _row_range(stored, start, n)
            start += n


def _row_range(stored: StoredTensor, start: int, rows: int) -> StoredTensor:
    """Rows [start, start + rows) of `stored`, read (or a rank's row slice of them read) from it alone."""
    def read(piece: Optional[Slice]) -> Any:
        if piece is not None and piece.dim != 0:
            raise WeightLoadError(f"a fused tensor's part is split by rows only, not by dim {piece.dim}")
        return stored.read(Slice(0, start + piece.start, piece.length) if piece else Slice(0, start, rows))
    return StoredTensor((rows,) + tuple(stored.shape[1:]), read)


def load_weights(model: nn.Module, tensors: Iterator[Tuple[str, StoredTensor]], args: ModelArgs,
                 plan: Optional[ShardPlan] = None) -> None:
    """Fill the model's parameters (this rank's shard under `plan`) from (HF name, stored tensor) pairs."""
    plan = plan or ShardPlan.of(args)
    expected = expected_tensors(model, args, plan)
    seen = set()
    for name, stored in split_fused(((canonical_name(n), t) for n, t in tensors), args):
        if "rotary_emb.inv_freq" in name or args.architecture in VISION_LANGUAGE and VISION_PARTS.match(name):
            continue
        if name == "lm_head.weight" and "lm_head.weight" not in expected:
            continue  # some checkpoints store the tied head too; an embedding model has none
        if not name.startswith("model.") and "model." + name in expected:
            name = "model." + name  # a bare decoder's checkpoint (Qwen3Model, ...) names its tensors without it
        shape = tuple(stored.shape)
        if name not in expected:
            raise WeightLoadError(f"unexpected tensor {name!r} (shape {shape}) in the checkpoint")
        t = expected[name]
        if shape != t.full:
            raise WeightLoadError(f"tensor {name!r} has shape {shape}, expected {t.full}")
        if name in seen:
            raise WeightLoadError(f"tensor {name!r} appears twice in the checkpoint")
        try:
            w = stored.read(t.piece)
        except ValueError as e:  # a share the format cannot be split into (a GGUF tensor's blocks)
            raise WeightLoadError(f"tensor {name!r}: {e}") from None
        if plan.rank and plan.bias_on_rank_zero(name):
            w = torch.zeros_like(w)
        with torch.no_grad():
            if t.load_rows is not None:
                t.load_rows(t.row, w)
            else:
                t.param.data[t.row:t.row + w.shape[0]].copy_(w.to(t.param.dtype))
                if name in VOCAB_SPLIT:
                    t.param.data[w.shape[0]:].zero_()  # the vocabulary's padding rows (on the last rank)
        seen.add(name)
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise WeightLoadError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}{more}")
