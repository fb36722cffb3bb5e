"""4-bit weights with 16-bit activations (W4A16): AWQ, GPTQ and compressed-tensors pack-quantized checkpoints,
served without widening their weights.

Why: decode reads every weight once per step, so a quarter of bf16's bytes is the other way past the bf16 floor
(after speculation). The three formats differ only in how they pack the same thing (4-bit integers, a scale and a
zero point per group of K), so the loader repacks each into one layout (kernels/w4a16_gemm.py describes it;
checkpoints/int4_formats.py reads the formats) and one layer and one kernel serve them all: W4A16Linear for the
projections, W4A16Experts for a mixture of experts' experts (stacked, kernels/moe_w4a16.py's layout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
from torch import nn

from minisrv.kernels.fused_moe import fused_experts
from minisrv.kernels.moe_align import Aligned
from minisrv.kernels.moe_w4a16 import PackedExperts
from minisrv.kernels.w4a16_gemm import dequantized_matmul, w4a16_gemm


@dataclass(frozen=True)
class Int4Scheme:
    """A 4-bit checkpoint's quantisation: its format (`method`), the group size along K (0: one group per output
    channel), whether its zero points are stored (asymmetric) or 8, the GPTQ zero-point convention (stored + 1 in
    the classic format), whether rows of K come in activation order (GPTQ's desc_act: permuted at load), and the
    dtype its scales are kept in (AWQ and GPTQ store float16; None: the model's, as compressed-tensors stores
    them)."""

    method: str
    group_size: int
    symmetric: bool
    zero_plus_one: bool = False
    act_order: bool = False
    scale_dtype: Optional[torch.dtype] = torch.float16

    def __str__(self) -> str:
        return f"{self.method} 4-bit"


def int4_scheme(config: Optional[Dict[str, Any]]) -> Optional[Int4Scheme]:
    """The scheme of a checkpoint's `quantization_config`, None where it is not a 4-bit format; a format minisrv
    does not serve (3- or 8-bit GPTQ, AWQ's GEMV layouts, compressed-tensors schemes other than 4-bit integer
    weights with unquantised activations) is a ValueError naming it."""
    method = (config or {}).get("quant_method")
    if method == "awq":
        bits = config.get("bits", config.get("w_bit", 4))
        version = str(config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise ValueError(f"unsupported AWQ checkpoint ({bits}-bit, {version} layout): minisrv serves 4-bit "
                             "AWQ in the GEMM layout")
        if not config.get("zero_point", True):
            raise ValueError("unsupported AWQ checkpoint without zero points: minisrv serves AWQ with zero points")
        return Int4Scheme("awq", _group(config.get("group_size", config.get("q_group_size", 128))), False)
    if method == "gptq":
        bits, fmt = config.get("bits", 4), config.get("checkpoint_format", "gptq")
        if bits != 4 or fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"unsupported GPTQ checkpoint ({bits}-bit, checkpoint_format {fmt}): minisrv serves "
                             "4-bit GPTQ (gptq or gptq_v2)")
        if config.get("dynamic"):
            raise ValueError("unsupported GPTQ checkpoint with per-module `dynamic` settings")
        return Int4Scheme("gptq", _group(config.get("group_size", 128)), bool(config.get("sym", True)),
                          zero_plus_one=fmt == "gptq", act_order=bool(config.get("desc_act", False)))
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config)
    return None


def _group(size: Any) -> int:
    size = int(size if size is not None else -1)
    return 0 if size <= 0 else size


def _compressed_tensors_scheme(config: Dict[str, Any]) -> Int4Scheme:
    groups = list((config.get("config_groups") or {}).values())
    formats = {g.get("format") or config.get("format") for g in groups}
    weights = [g.get("weights") or {} for g in groups]
    int4 = all(w.get("num_bits") == 4 and w.get("type") == "int" and w.get("strategy") in ("group", "channel")
               for w in weights)
    one_scheme = len({(w.get("strategy"), w.get("group_size"), w.get("symmetric")) for w in weights}) == 1
    if not (groups and formats == {"pack-quantized"} and int4 and one_scheme) or \
            any(g.get("input_activations") for g in groups):
        what = ", ".join(f"{g.get('format') or config.get('format')} {g.get('weights')} activations "
                         f"{g.get('input_activations')}" for g in groups)
        raise ValueError(f"unsupported compressed-tensors checkpoint ({what or 'no config_groups'}): minisrv serves "
                         "pack-quantized 4-bit integer weights (group or channel scales) with 16-bit activations")
    w = weights[0]
    group = _group(w.get("group_size")) if w["strategy"] == "group" else 0
    return Int4Scheme("compressed-tensors", group, bool(w.get("symmetric", True)),
                      act_order=w.get("actorder") == "group", scale_dtype=None)


class Int4Weight(NamedTuple):
    """A checkpoint matrix (or one rank's slice of it) in the layer's layout: qweight int32 [K/8, n], scales
    [K/G, n], zeros uint8 [K/G, n], and perm int64 [K] (activation order: the layer's input column each row of K
    reads) or None."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: Optional[torch.Tensor] = None


def hold_int4(module: nn.Module, prefix: str, lead: Tuple[int, ...], k: int, n: int, scheme: Int4Scheme,
              named: Tuple[str, str]) -> int:
    """Registers a [K, n] matrix's 4-bit parameters on `module`, each with the `lead` dims before its own:
    `prefix`qweight int32 [K/8, n], scales [K/G, n], zeros uint8 [K/G, n] and, with an activation order, perm int64
    [K] (else None). Returns the group size G. A K (this rank's share) not whole groups of G is a ValueError that
    names the layer as `named` (its article, its noun)."""
    group = scheme.group_size or k
    if k % group or group % 16:
        raise ValueError(f"{named[0]} {k}-wide input (this rank's share) is not whole groups of {group}: choose a "
                         f"tp size that splits the {scheme} {named[1]} at group boundaries")

    def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
        return nn.Parameter(torch.empty(*lead, *shape, dtype=dtype), requires_grad=False)
    module.register_parameter(prefix + "qweight", param(k // 8, n, dtype=torch.int32))
    module.register_parameter(prefix + "scales", param(k // group, n, dtype=scheme.scale_dtype or
                                                       torch.get_default_dtype()))
    module.register_parameter(prefix + "zeros", param(k // group, n, dtype=torch.uint8))
    module.register_parameter(prefix + "perm", param(k, dtype=torch.int64) if scheme.act_order else None)
    return group


class W4A16Linear(nn.Module):
    """y = x W (+ b) with W [K, N] in 4 bits (the layout of kernels/w4a16_gemm.py). Built empty on the meta device
    and filled column block by column block (a fused projection's parts) by `load_rows`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: Int4Scheme) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group = hold_int4(self, "", (), in_features, out_features, scheme, ("a", "layers"))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.scheme = scheme
        self.perm_loaded = False

    def load_rows(self, row: int, w: Any) -> None:
        """Output columns [row, row + n) (rows of the checkpoint's [N, K] matrix) from an Int4Weight."""
        held = Int4Weight(self.qweight, self.scales, self.zeros, self.perm)
        load_columns(held, row, w, self.scheme, self.perm_loaded)
        self.perm_loaded = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2 = x.shape[:-1], x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2[:, self.perm]
        run = w4a16_gemm() if x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16) else None
        if run is not None and x2.shape[0] > 0:
            y = run(x2 if x2.stride(1) == 1 else x2.contiguous(), self.qweight, self.scales, self.zeros)
        else:
            y = dequantized_matmul(x2, self.qweight, self.scales, self.zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme} groups of "
                f"{self.group}")


@torch.no_grad()
def load_columns(held: Int4Weight, row: int, w: Any, scheme: Int4Scheme, perm_loaded: bool) -> None:
    """Columns [row, row + n) of a held 4-bit matrix (a layer's parameters, or one expert's views of them) from an
    Int4Weight w of n columns; perm_loaded: whether a part of it was loaded before (a fused projection's parts must
    share their activation order)."""
    if not isinstance(w, Int4Weight):
        raise ValueError(f"a {scheme} layer is loaded from 4-bit tensors only, got {type(w).__name__}")
    n = w.qweight.shape[1]
    if w.qweight.shape[0] != held.qweight.shape[0] or w.scales.shape[0] != held.scales.shape[0]:
        raise ValueError(f"4-bit weight of {w.qweight.shape[0] * 8} rows in {w.scales.shape[0]} groups for a "
                         f"layer of {held.qweight.shape[0] * 8} in {held.scales.shape[0]}")
    held.qweight[:, row:row + n] = w.qweight.to(held.qweight.device)
    held.scales[:, row:row + n] = w.scales.to(held.scales.device, held.scales.dtype)
    held.zeros[:, row:row + n] = w.zeros.to(held.zeros.device)
    if (w.perm is None) != (held.perm is None):
        raise ValueError(f"{scheme} weight {'with' if w.perm is not None else 'without'} an activation order, for "
                         "a layer " + ("with one" if held.perm is not None else "without one"))
    if w.perm is not None:
        if perm_loaded and not torch.equal(held.perm.cpu(), w.perm.cpu()):
            raise ValueError("the parts of a fused 4-bit projection (q/k/v or gate/up) have different activation "
                             "orders (g_idx)")
        held.perm.copy_(w.perm)


class W4A16Experts(nn.Module):
    """A mixture of experts' E experts in 4 bits, stacked as the fused experts take them (kernels/moe_w4a16.py):
    w13 of [H, 2I] matrices (each expert's gate columns, then its up columns) and w2 of [I, H], each as qweight,
    scales, zeros (and perm, with an activation order: one per expert and matrix). Filled one expert's
    checkpoint tensor at a time (load_rows), as moe.Experts is; each rank holds every expert's share of I."""

    fp8 = False

    def __init__(self, num_experts: int, hidden: int, inter: int, scheme: Int4Scheme) -> None:
        super().__init__()
        self.scheme = scheme
        for which, k, n in (("w13", hidden, 2 * inter), ("w2", inter, hidden)):
            hold_int4(self, which + "_", (num_experts,), k, n, scheme, ("the experts'", "experts"))
        self.perm_loaded = set()  # (which, expert) whose activation order is loaded

    def stacks(self) -> Tuple[PackedExperts, PackedExperts]:
        """w13 and w2 as the fused experts take them (as Experts.stacks)."""
        return self.packed("w13"), self.packed("w2")

    def packed(self, which: str) -> PackedExperts:
        return PackedExperts(*(getattr(self, f"{which}_{part}") for part in ("qweight", "scales", "zeros", "perm")))

    def load_rows(self, which: str, expert: int, row: int, w: Any) -> None:
        """Checkpoint rows [row, row + n) of one expert's `which` ("w13" or "w2"): its columns, from an
        Int4Weight."""
        held = Int4Weight(*(t[expert] if t is not None else None for t in self.packed(which)))
        load_columns(held, row, w, self.scheme, (which, expert) in self.perm_loaded)
        self.perm_loaded.add((which, expert))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                aligned: Optional[Aligned] = None) -> torch.Tensor:
        return fused_experts(x, *self.stacks(), topk_weights, topk_ids, aligned=aligned)

    def extra_repr(self) -> str:
        w13 = self.packed("w13")
        e, h, n = w13.num_experts, w13.k, w13.n
        return f"experts={e}, hidden={h}, inter={n // 2}, {self.scheme} groups of {self.scheme.group_size or 'K'}"
