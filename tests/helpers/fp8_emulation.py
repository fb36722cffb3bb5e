"""The model-level reference for FP8 weights: HF transformers in float64 with each projection's weight rounded to
e4m3 per row and its input rounded per token (an emulation), with ties between two e4m3 neighbours settled by the
engine's own activation.

Why ties need settling: the engine computes activations in float32, the emulation in float64. A value within float32
accuracy of the midpoint between two e4m3 neighbours may round to either, and both are right; but the element then
moves by a whole e4m3 step (up to 2^-3 of itself), and through attention every later position of its sequence moves
with it (a random tiny Qwen3 holds such a value, 272.00001 in units of its token's scale, the midpoint of 256 and
288, and its logits moved by 1e-2). So where the emulation's value lies within TIE_BAND (relative) of the midpoint
between its rounding and the engine's, and only there, it takes the engine's; everywhere else it rounds on its own.
The engine's activation is rounded here by the spec written out (`round_rows`), not by minisrv's quantiser.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

FP8 = torch.float8_e4m3fn
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ROW_PARALLEL = ("o_proj", "down_proj")  # split by input columns under tensor parallelism
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}  # HF's projection -> the engine's layer that takes the same input
# float32 activations agree with float64 ones to ~1e-6 (relative); an engine activation off by more than 1e-4 still
# fails, since beyond the band the emulation rounds on its own, and 1e-4 is what the logits are held to
TIE_BAND = 1e-4

EngineInputs = Dict[Tuple[str, str, int], torch.Tensor]  # (engine layer name, request id, position) -> input row


def round_rows(w: torch.Tensor):
    """The spec, written out: float32 scale max|row| / 448, then e4m3 of w / scale. Returns (values, scale)."""
    w32 = w.float()
    scale = (w32.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    q = (w32 / scale).clamp(-448.0, 448.0).to(FP8)
    return q, scale


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    q, s = round_rows(x.reshape(-1, x.shape[-1]))
    return (q.double() * s.double()).reshape(x.shape).to(x.dtype)


def record_engine_inputs(engine, watch) -> EngineInputs:
    """Wraps each of the engine's FP8 layers to record the float32 input row of every token a step feeds it (the
    rows of a step are its requests' tokens in order; `watch` knows the step's batch)."""
    from minisrv.models.fp8 import Fp8Linear
    rows: EngineInputs = {}

    def recording(name, forward):
        def recorded(x):
            sb = watch.batch
            flat = x.reshape(-1, x.shape[-1])
            assert flat.shape[0] == sum(sb.extend_lens), "an FP8 layer's rows are not the step's tokens"
            i = 0
            for r, n in zip(sb.reqs, sb.extend_lens):
                for k in range(n):
                    rows[(name, r.rid, r.num_cached + k)] = flat[i + k].detach().clone()
                i += n
            return forward(x)
        return recorded

    for name, mod in engine.runner.model.named_modules():
        if isinstance(mod, Fp8Linear):
            mod.forward = recording(name, mod.forward)  # forward_silu_mul calls self.forward too
    return rows


def _settled(x: torch.Tensor, engine_rows: List[Optional[torch.Tensor]]) -> torch.Tensor:
    """x [T, K] rounded per token, each tie within TIE_BAND settled by engine_rows[t] (None: no engine row)."""
    q, s = round_rows(x)
    q = q.double()
    v = x.double() / s.double()  # the values being rounded, in units of each token's scale
    for t, row in enumerate(engine_rows):
        if row is None:
            continue
        theirs = round_rows(row[None])[0][0].double()
        tie = (theirs != q[t]) & ((v[t] - (theirs + q[t]) / 2).abs() <= TIE_BAND * v[t].abs())
        q[t] = torch.where(tie, theirs, q[t])
    return q * s.double()


def emulated_hf(path: str, ranks: int = 1, engine_rows: Optional[EngineInputs] = None):
    """HF in float64 with every projection's weight e4m3-rounded per row and its input rounded per token. With
    `ranks`, the row-parallel projections are rounded as each rank rounds its own columns (weight rows and input
    tokens over 1/ranks of the width), and their partial products summed, as the all-reduce does. With
    `engine_rows` (from record_engine_inputs; one rank only), call the model's `follow(request)` before each
    request's forward: its ties are then settled by that request's activations in the engine."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    assert engine_rows is None or ranks == 1
    following = {"rid": None}
    m.follow = lambda req: following.update(rid=req.rid)
    for name, mod in m.named_modules():
        prefix, _, short = name.rpartition(".")
        if short not in PROJECTIONS:
            continue
        parts = ranks if short in ROW_PARALLEL else 1
        cols = mod.weight.shape[1] // parts
        with torch.no_grad():
            mod.weight.copy_(torch.cat([fake_quant(mod.weight[:, i * cols:(i + 1) * cols]) for i in range(parts)], 1))
        engine_name = f"{prefix}.{FUSED.get(short, short)}"

        def rounded_input(_m, args, parts=parts, cols=cols, engine_name=engine_name):
            x = args[0]
            if engine_rows is None:
                return (torch.cat([fake_quant(x[..., i * cols:(i + 1) * cols]) for i in range(parts)], dim=-1),)
            flat = x.reshape(-1, x.shape[-1])  # one sequence, positions 0..T-1
            found = [engine_rows.get((engine_name, following["rid"], pos)) for pos in range(flat.shape[0])]
            return (_settled(flat, found).reshape(x.shape),)

        mod.register_forward_pre_hook(rounded_input)
    return m
