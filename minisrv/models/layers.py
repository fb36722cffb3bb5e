"""Layers shared by every decoder model (the norms are in norms.py): projections, rotary embedding, gated MLP,
GQA attention, the vocabulary embedding. Under tensor parallelism (`tp`) each holds its rank's shard (sharding.py)
and combines partial results with one all-reduce; with one rank they call no collective. Their elementwise ops go
through the model's one LayerOps (layer_ops.py)."""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from minisrv.distributed import TensorParallel
from minisrv.kernels.cpu_gemv import linear

from .args import ModelArgs
from .block_layers import BlockLinear, block_kernels
from .fp8 import Fp8Linear
from .layer_ops import LayerOps
from .planes_layers import PlanesLinear
from .w4a16 import Int4Scheme, W4A16Linear
from .norms import GemmaRMSNorm, make_norm


def make_linear(in_features: int, out_features: int, bias: bool, quantization: Optional[Any],
                ops: LayerOps) -> nn.Module:
    """A projection layer for `quantization` (see LlamaForCausalLM); unquantised, a CpuLinear on the CPU with its
    compiled ops, else nn.Linear."""
    if isinstance(quantization, Int4Scheme):
        return W4A16Linear(in_features, out_features, bias, quantization)
    if quantization == "fp8":
        return Fp8Linear(in_features, out_features, bias)
    if quantization == "gguf":
        return BlockLinear(in_features, out_features, bias, block_kernels(ops))
    if quantization == "gguf-planes":
        return PlanesLinear(in_features, out_features, bias)
    if quantization is not None:
        raise ValueError(f"unsupported quantization {quantization!r}")
    small = ops.small_batch_linear
    if small is not None:
        return CpuLinear(in_features, out_features, bias, small)
    return nn.Linear(in_features, out_features, bias=bias)


class CpuLinear(nn.Linear):
    """nn.Linear whose projections of a few rows (decode steps) go through the CPU's small-batch kernel
    (kernels/cpu_gemv.py); the same parameters, so it loads and shards as nn.Linear does."""

    def __init__(self, in_features: int, out_features: int, bias: bool, small: Any) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.small = small

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.small)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: Optional[Dict[str, Any]],
                  max_positions: int) -> Tuple[torch.Tensor, float]:
    """The rotary's inverse frequencies and the factor its cos and sin are scaled by (1 but for LongRoPE).

    LongRoPE has two sets of per-frequency factors: transformers takes the long ones for a forward pass over more
    than original_max_position_embeddings positions, else the short ones, and keeps the keys it cached with the
    other set when a sequence crosses that length. Here the set is chosen once, by the context served
    (`max_positions`), as vLLM does: long where the context reaches past the original length, so that every
    prompt longer than it gets transformers' numbers and a sequence's cached keys never mix the two sets."""
    # on the CPU whatever the default device (see RotaryEmbedding.reset_buffers)
    powers = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim)
    inv_freq = 1.0 / powers
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "longrope":
        original = scaling["original_max_position_embeddings"]
        factors = scaling["long_factor" if max_positions > original else "short_factor"]
        factor, attention = scaling["factor"], scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * powers), attention
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(rotary_dim, theta, scaling, powers)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3, longrope, yarn")


def _yarn(dim: int, theta: float, scaling: Dict[str, Any], powers: torch.Tensor) -> Tuple[torch.Tensor, float]:
    """YaRN (gpt-oss), as transformers computes it: frequencies turning fewer than beta_slow times over the original
    context are interpolated (divided by `factor`), those turning more than beta_fast times kept, a linear ramp
    between (its ends floored and ceiled with `truncate`, transformers' default); cos and sin scaled by the attention
    factor, the config's or 0.1 ln(factor) + 1 (the mscale ratio where mscale and mscale_all_dim are given)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale()

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low if high != low else 0.001)
    extrapolation = 1 - ramp.clamp(0, 1)
    return (1.0 / (factor * powers)) * (1 - extrapolation) + (1.0 / powers) * extrapolation, float(attention)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary (rotate halves) of each head's first `rotary_dim` dims (all of them unless the model's
    rotary is partial), with a cos/sin cache over every position of the context."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[Dict[str, Any]],
                 ops: Optional[LayerOps] = None, rotary_dim: Optional[int] = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.rotary_dim = rotary_dim or head_dim
        self.ops = ops if ops is not None else LayerOps()
        self.reset_buffers()

    def reset_buffers(self, device: Optional[torch.device] = None) -> None:
        """(Re)compute the float32 cos/sin cache (after meta-device construction, or a dtype cast)."""
        inv_freq, scale = rope_inv_freq(self.rotary_dim, self.theta, self.scaling, self.max_positions)
        target = device if device is not None else torch.empty(0).device  # None: the default device
        # a model built on the meta device gets CPU-computed placeholders: meta's arange goes through torch's
        # Python references, whose first use imports torch._dynamo (seconds); the loader recomputes them anyway
        t = torch.arange(self.max_positions, dtype=torch.float32, device="cpu" if target.type == "meta" else target)
        freqs = torch.outer(t, inv_freq.to(t.device))
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        # [P, rotary_dim] float32: each position's cos, then its sin
        self.register_buffer("cos_sin", (cos_sin * scale if scale != 1.0 else cos_sin).to(target), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D]."""
        return self.ops.rope(positions, q, k, self.cos_sin)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), act SiLU or (act "gelu_tanh", Gemma's) tanh-approximated GELU, with gate and up
    fused into one matmul. `inter`: this rank's share of the width; the down projection's partial sums are
    all-reduced unless `reduce_output` is False (the norm after it then all-reduces them: see reduce_add_norm)."""

    def __init__(self, hidden: int, inter: int, ops: LayerOps, tp: TensorParallel, quantization: Optional[str],
                 reduce_output: bool, act: str = "silu") -> None:
        super().__init__()
        self.ops, self.tp, self.reduce_output = ops, tp, reduce_output
        self.gelu = act == "gelu_tanh"
        self.gate_up_proj = make_linear(hidden, 2 * inter, False, quantization, ops)
        self.down_proj = make_linear(inter, hidden, False, quantization, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gu.chunk(2, dim=-1)
            out = self.down_proj(F.gelu(gate, approximate="tanh") * up)
        elif isinstance(self.down_proj, Fp8Linear):  # its input quantised as it is computed
            out = self.down_proj.forward_silu_mul(gu)
        else:
            out = self.down_proj(self.ops.silu_and_mul(gu))
        return self.tp.all_reduce(out) if self.reduce_output else out


class VocabEmbedding(nn.Module):
    """Token embedding over this rank's rows of the vocabulary [start, start + rows); ids outside it contribute
    zeros, and the all-reduce sums each token's one non-zero row. Its weight doubles as a tied lm_head."""

    def __init__(self, rows: int, hidden: int, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tp.embed_rows(ids, self.start, self.weight.shape[0], lambda i: F.embedding(i, self.weight))


class Attention(nn.Module):
    """Grouped-query attention: fused qkv projection, optional q/k RMSNorm (Qwen3, Gemma 3), rotary, then the
    backend, which knows each layer's window, scale, soft-cap and sinks (attention_options.py)."""

    def __init__(self, args: ModelArgs, layer_id: int, rotary: RotaryEmbedding, ops: LayerOps, num_heads: int,
                 num_kv_heads: int, tp: TensorParallel, quantization: Optional[str], reduce_output: bool) -> None:
        """num_heads / num_kv_heads: this rank's heads; o_proj's partial sums are all-reduced as GatedMLP's are."""
        super().__init__()
        self.ops, self.tp, self.rotary = ops, tp, rotary
        self.layer_id, self.reduce_output = layer_id, reduce_output
        self.hq, self.hkv, self.d = num_heads, num_kv_heads, args.head_dim
        self.q_size, self.kv_size = self.hq * self.d, self.hkv * self.d
        self.qkv_proj = make_linear(args.hidden_size, self.q_size + 2 * self.kv_size, args.attention_bias,
                                    quantization, ops)
        self.o_proj = make_linear(self.q_size, args.hidden_size, args.o_proj_bias, quantization, ops)
        # gpt-oss's sink logit of each of this rank's heads, which the backend reads (attention_options.py)
        self.sinks = nn.Parameter(torch.empty(self.hq), requires_grad=False) if args.attention_sinks else None
        norm = functools.partial(make_norm, self.d, args.rms_norm_eps, ops, plus_one=args.gemma_norms)
        self.q_norm = norm() if args.qk_norm else None
        self.k_norm = norm() if args.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Callable) -> torch.Tensor:
        """attn: the step's attention (an attention.AttentionStep), called as attn(q, k, v, layer_id)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = (x.reshape(t, -1, self.d) for x in qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1))
        # (the fused kernel's q/k norms scale by their weight, not by 1 + weight)
        prep = self.ops.qk_rope_store(qkv, self.rotary.cos_sin, self.d) \
            if not isinstance(self.q_norm, GemmaRMSNorm) else None
        if prep is not None:  # norms and rotary in place and, where the backend lets it, the store: one kernel
            target = attn.kv_store_target(self.layer_id)
            norm = self.q_norm is not None
            prep(qkv, positions, self.rotary.cos_sin, self.hq, self.hkv, self.d,
                 self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                 self.q_norm.eps if norm else 0.0, *(target or ()))
            if target is not None:
                k = v = None
        else:
            if isinstance(self.q_norm, GemmaRMSNorm):
                q, k = self.q_norm(q), self.k_norm(k)
            elif self.q_norm is not None:  # per-head norms, on the strided views of the qkv output
                q = self.ops.rmsnorm_heads(q, self.q_norm.weight, self.q_norm.eps)
                k = self.ops.rmsnorm_heads(k, self.k_norm.weight, self.k_norm.eps)
            q, k = self.rotary(positions, q, k)
        o = attn(q, k, v, self.layer_id)
        out = self.o_proj(o.reshape(t, self.q_size))
        return self.tp.all_reduce(out) if self.reduce_output else out
