"""4-bit copies of a tiny float checkpoint, written from the formats' documented packing (AWQ's GEMM layout and
GPTQ, as AutoAWQ and AutoGPTQ pack them) or by the format's own library (compressed-tensors' pack-quantized
compressor); and, for each, the float64 weights an independent reading of the format's specification gives, and a
float copy of the checkpoint holding them (what HF transformers runs as the reference where it cannot load the 4-bit
file itself).

Every projection (q, k, v, o, gate, up, down; a mixture of experts' experts, Mixtral's w1/w3/w2 included) is
quantised; the embedding, norms, routers and lm_head stay as they were."""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Dict, Optional, Tuple

import torch

PROJECTION = re.compile(r"^(.*(?:_proj|\.experts\.\d+\.w[123]))\.weight$")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantise(w: torch.Tensor, group: int, symmetric: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantisation of w [N, K] in groups of `group` along K (0: per channel): (q [N, K]
    int64 in 0..15, scales [N, K/G] float16, zeros [N, K/G] int64) with w ~ (q - zero) * scale."""
    n, k = w.shape
    g = group or k
    wg = w.double().reshape(n, k // g, g)
    if symmetric:
        scales = (wg.abs().amax(-1) / 7.5).clamp_min(1e-8).half()
        zeros = torch.full(scales.shape, 8, dtype=torch.int64, device=w.device)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp_min(1e-8).half()
        zeros = torch.round(-lo / scales.double()).clamp(1, 15).long()  # (GPTQ's classic format cannot store 0)
    q = torch.round(wg / scales.double()[..., None]) + zeros[..., None]
    return q.clamp(0, 15).long().reshape(n, k), scales, zeros


def words(nibbles: torch.Tensor) -> torch.Tensor:
    """int32 words of [..., 8] nibbles, nibble i in bits 4i (the top one wraps into the sign bit)."""
    value = sum(nibbles[..., i].long() << (4 * i) for i in range(8))
    return ((value + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


def pack_awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> Dict[str, torch.Tensor]:
    """AutoAWQ's WQLinear_GEMM: intweight = q^T [K, N]; word j of a row holds columns 8j + AWQ_ORDER[i] in nibble
    i; qzeros alike from zeros^T; scales^T float16."""
    def pack(m):  # [R, C] -> [R, C/8]
        return words(m.reshape(m.shape[0], -1, 8)[..., AWQ_ORDER])
    return {"qweight": pack(q.t()), "qzeros": pack(zeros.t()), "scales": scales.t().contiguous()}


def pack_gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
              v2: bool = False) -> Dict[str, torch.Tensor]:
    """AutoGPTQ's QuantLinear.pack: qweight [K/8, N] with rows 8j + i in nibble i; qzeros [K/G, N/8] with columns
    8j + i in nibble i, each stored minus 1 (gptq_v2: as is); scales [K/G, N] float16; g_idx [K]."""
    qt = q.t()  # [K, N]
    qweight = words(qt.reshape(-1, 8, qt.shape[1]).transpose(1, 2))
    stored = zeros.t() if v2 else (zeros.t() - 1) & 0xF
    qzeros = words(stored.reshape(stored.shape[0], -1, 8))
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}


def spec_dequantised(method: str, t: Dict[str, torch.Tensor], v2: bool = False) -> torch.Tensor:
    """W [N, K] in float64 from one layer's stored tensors, read element by element as the formats' kernels do
    (AutoAWQ's dequantize_gemm, AutoGPTQ's torch QuantLinear, compressed-tensors' decompress)."""
    def nibble(word, i):
        return (word.long() >> (4 * i)) & 0xF
    if method == "awq":
        qw, qz, s = t["qweight"], t["qzeros"], t["scales"].double()
        k, n = qw.shape[0], qw.shape[1] * 8
        g = k // s.shape[0]
        col = torch.arange(n)
        nib = torch.tensor([AWQ_ORDER.index(c % 8) for c in range(n)])  # the nibble holding column c
        q = nibble(qw[:, col // 8], nib[None, :])
        z = nibble(qz[:, col // 8], nib[None, :])
        rows = torch.arange(k) // g
        return ((q - z[rows]) * s[rows]).t()
    if method == "gptq":
        qw, qz, s, g_idx = t["qweight"], t["qzeros"], t["scales"].double(), t["g_idx"].long()
        k, n = qw.shape[0] * 8, qw.shape[1]
        row, col = torch.arange(k), torch.arange(n)
        q = nibble(qw[row // 8], (row % 8)[:, None])
        z = nibble(qz[g_idx][:, col // 8], (col % 8)[None, :]) + (0 if v2 else 1)
        return ((q - z) * s[g_idx]).t()
    packed, s = t["weight_packed"], t["weight_scale"].double()  # compressed-tensors
    n, k = packed.shape[0], packed.shape[1] * 8
    col = torch.arange(k)
    q = nibble(packed[:, col // 8], (col % 8)[None, :]) - 8  # signed
    g = k // s.shape[1]
    z = torch.zeros(n, s.shape[1], dtype=torch.long)
    if "weight_zero_point" in t:
        zp, row = t["weight_zero_point"], torch.arange(n)
        z = nibble(zp[row // 8], (row % 8)[:, None]) - 8
    return (q - z[:, col // g]) * s[:, col // g]


def int4_parts(w: torch.Tensor, method: str, group: int, symmetric: bool, perm: Optional[torch.Tensor] = None,
               v2: bool = False) -> Dict[str, torch.Tensor]:
    """The stored tensors (by leaf name) of w [N, K] in `method`'s format. perm (GPTQ's act order): the order in
    which rows of K are quantised, groups of `group` consecutive in it."""
    if method == "compressed-tensors":
        return _compressed_tensors_parts(w, group, symmetric)
    k = w.shape[1]
    perm = torch.arange(k, device=w.device) if perm is None else perm.to(w.device)
    q, scales, zeros = quantise(w[:, perm], group, symmetric)  # groups of rows in quantisation order
    g_idx = torch.empty(k, dtype=torch.long, device=w.device)
    g_idx[perm] = torch.arange(k, device=w.device) // (group or k)
    q_rows = torch.empty_like(q)
    q_rows[:, perm] = q
    return pack_awq(q_rows, scales, zeros) if method == "awq" else pack_gptq(q_rows, scales, zeros, g_idx, v2)


def same_input(prefix: str) -> str:
    """The name of the input a projection reads: q/k/v share one, and gate/up (Mixtral's w1/w3) one, so that an
    activation order is drawn once for each."""
    return re.sub(r"\.(q|k|v)_proj$", ".qkv", re.sub(r"\.(gate_proj|up_proj|w1|w3)$", ".gate_up", prefix))


def write_int4_checkpoint(src: str, dst: str, method: str, group: int, symmetric: bool = False,
                          act_order: bool = False, v2: bool = False, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A 4-bit copy of the float checkpoint `src` at `dst` in `method`'s format; returns each projection's
    float64 weight by the specification's reading (spec_dequantised), by HF name."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    state = load_file(file)
    out, weights, orders = {}, {}, {}
    gen = torch.Generator().manual_seed(seed)
    for name, w in state.items():
        m = PROJECTION.match(name)
        if not m or not name.startswith("model.layers."):
            out[name] = w
            continue
        prefix = m.group(1)
        perm = orders.setdefault(same_input(prefix), torch.randperm(w.shape[1], generator=gen)) if act_order else None
        parts = int4_parts(w, method, group, symmetric, perm, v2)
        for leaf, t in parts.items():
            out[f"{prefix}.{leaf}"] = t.contiguous()
        weights[name] = spec_dequantised(method, parts, v2)
    save_file(out, file)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quantization_config(method, group, symmetric, act_order, v2)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return weights


def quantization_config(method: str, group: int, symmetric: bool, act_order: bool, v2: bool) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group or -1, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group or -1, "desc_act": act_order,
                "sym": symmetric, "checkpoint_format": "gptq_v2" if v2 else "gptq", "true_sequential": True}
    from compressed_tensors.quantization import QuantizationConfig
    cfg = QuantizationConfig(config_groups={"group_0": _ct_scheme(group, symmetric)}, format="pack-quantized",
                             ignore=["lm_head"], quantization_status="compressed").model_dump()
    return json.loads(json.dumps(cfg, default=str))


def _ct_scheme(group: int, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group" if group else "channel",
                            group_size=group or None)
    return QuantizationScheme(targets=["Linear"], weights=args)


def _compressed_tensors_parts(w: torch.Tensor, group: int, symmetric: bool) -> Dict[str, torch.Tensor]:
    """The library's own quantisation parameters and pack-quantized compressor."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams
    scheme = _ct_scheme(group, symmetric)
    n, k = w.shape
    wg = w.reshape(n, k // (group or k), group or k)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), scheme.weights)
    state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zp}
    return dict(PackedQuantizationCompressor.compress(state, scheme))


def write_dequantised_checkpoint(src: str, dst: str, weights: Dict[str, torch.Tensor],
                                 dtype: Optional[torch.dtype] = torch.float32) -> None:
    """A float copy of the unquantised checkpoint `src` with each projection replaced by `weights`' (the 4-bit
    model's values), and no quantization_config."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    state = load_file(file)
    state.update({name: w.to(dtype).contiguous() for name, w in weights.items()})
    save_file(state, file)
