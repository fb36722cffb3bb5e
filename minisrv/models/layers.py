"""Layers shared by every decoder model: RMSNorm, rotary embedding, gated SiLU MLP, GQA attention, the
vocabulary embedding. Under tensor parallelism (`tp`, see minisrv.distributed) each holds its rank's shard (see
sharding.py) and combines partial results with one all-reduce; with one rank they call no collective.

On CUDA with FlashInfer installed, RMSNorm (with fused residual add), SiLU-and-mul and rotary use its fused
kernels; on the CPU, the same ops compiled for the machine (kernels/cpu_ops.py) where a C compiler is present;
everywhere else, plain torch. All compute the same thing (tests compare against HF transformers). Which one a layer
uses is fixed when it is built (`fused`: the kernel module, or None).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from minisrv.distributed import TensorParallel
from minisrv.utils import cuda_import

from minisrv.kernels.cpu_gemv import linear
from minisrv.kernels.cpu_ops import CpuFusedOps
from minisrv.kernels.fp8_quant import fused_quantisers
from minisrv.kernels.moe_sum_norm import triton_sum_add_rmsnorm
from minisrv.kernels.qk_rope_store import fused_qk_rope_store

from .args import ModelArgs
from .block_layers import BlockLinear, block_kernels
from .fp8 import Fp8Linear

logger = logging.getLogger(__name__)

def make_linear(in_features: int, out_features: int, bias: bool, quantization: Optional[str] = None,
                fused: Optional[Any] = None) -> nn.Module:
    """A projection layer: nn.Linear (F.linear, cuBLAS on CUDA), or with quantization "fp8" an Fp8Linear (weights
    in float8_e4m3fn, quantised by the loader as it reads them; see fp8.py); with "gguf" a BlockLinear (a GGUF
    model's blocks kept on the CPU, block_layers.py). On the CPU with the compiled ops (`fused` from
    fused_ops_for), a CpuLinear."""
    if quantization == "fp8":
        return Fp8Linear(in_features, out_features, bias)
    if quantization == "gguf":
        return BlockLinear(in_features, out_features, bias, block_kernels(fused))
    if quantization is not None:
        raise ValueError(f"unsupported quantization {quantization!r}")
    small = getattr(fused, "small_batch_linear", None)
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


def fused_ops_for(device: torch.device) -> Optional[Any]:
    """FlashInfer's module, whose fused norm/activation/rotary kernels the layers use, when on CUDA and importable;
    on the CPU the compiled CPU ops (CpuFusedOps) where they build; None otherwise (plain torch). Chosen once, when
    a model is built, and handed to each layer."""
    if device.type != "cpu":
        return cuda_import(device, "flashinfer")
    ops, how = CpuFusedOps.load()
    logger.info("CPU layer ops: %s; %d threads, CPU capability %s", how if ops is not None else
                f"plain torch ({how})", torch.get_num_threads(), torch.backends.cpu.get_cpu_capability())
    return ops


def set_fused_ops(model: nn.Module, ops: Optional[Any]) -> None:
    """Give every layer of a built model another fused-op module (None: plain torch): a server that started before
    FlashInfer's kernels were compiled switches to them here (engine/kernel_builds.py). The CPU's small-batch
    projections (CpuLinear) are not fused ops and stay as they are."""
    for m in model.modules():
        if isinstance(m, (RMSNorm, RotaryEmbedding, GatedMLP, Attention)):
            m.fused = ops


class UnsummedExperts(NamedTuple):
    """A sparse MLP's output left as each token's k weighted expert outputs, parts [T, k, H]: the RMSNorm after the
    layer (the next layer's input norm, or the model's final norm) sums them as it adds the residual."""

    parts: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fused: Optional[Any] = None, quantize_out: bool = False) -> None:
        """quantize_out: an FP8 projection takes the output, so on CUDA the norm hands it over quantised."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = fused
        self.quantize_out = quantize_out

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual), the add fused on GPU.
        With `quantize_out` on CUDA, norm(...) comes quantised per token (fp8.Fp8Activations), from one kernel.
        x may be UnsummedExperts: summed here, in the same kernel as the add and the norm where it runs."""
        if isinstance(x, UnsummedExperts):
            fused = triton_sum_add_rmsnorm() if residual is not None and x.parts.is_cuda and not self.quantize_out \
                else None
            if fused is not None:
                return fused(x.parts, residual, self.weight, self.eps), residual
            x = x.parts.sum(dim=1)
        quantisers = fused_quantisers(x) if self.quantize_out and (residual is None or residual.stride(-1) == 1) \
            else None
        if quantisers is not None:
            out = quantisers.add_norm_quant(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if self.fused is not None and x.dim() == 2:
            if residual is None:
                return self.fused.rmsnorm(x, self.weight, self.eps)
            self.fused.fused_add_rmsnorm(x, residual, self.weight, self.eps)  # in place: x=norm, residual=sum
            return x, residual
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[Dict[str, Any]]) -> torch.Tensor:
    # on the CPU whatever the default device: under the meta device this division goes through torch's Python
    # references, whose first use imports torch._dynamo (about 2 s)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
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
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary (rotate halves), with a cos/sin cache over every position of the context."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: Optional[Dict[str, Any]],
                 fused: Optional[Any] = None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.fused = fused
        self.reset_buffers()

    def reset_buffers(self, device: Optional[torch.device] = None) -> None:
        """(Re)compute the float32 cos/sin cache (after meta-device construction, or a dtype cast)."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        target = device if device is not None else torch.empty(0).device  # None: the default device
        # a model built on the meta device gets CPU-computed placeholders: meta's arange goes through torch's
        # Python references, whose first use imports torch._dynamo (about 2 s); the loader recomputes them anyway
        t = torch.arange(self.max_positions, dtype=torch.float32, device="cpu" if target.type == "meta" else target)
        freqs = torch.outer(t, inv_freq.to(t.device))
        self.register_buffer("cos", freqs.cos().to(target), persistent=False)  # [P, D/2] float32
        self.register_buffer("sin", freqs.sin().to(target), persistent=False)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(target), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D]."""
        if self.fused is not None:
            t = q.shape[0]
            qf, kf = q.reshape(t, -1), k.reshape(t, -1)
            self.fused.apply_rope_with_cos_sin_cache_inplace(positions, qf, kf, self.head_dim, self.cos_sin, True)
            return qf.view_as(q), kf.view_as(k)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul(gu: torch.Tensor, fused: Optional[Any]) -> torch.Tensor:
    """silu(gate) * up of a gated MLP's stacked output gu = [gate | up]: the fused ops' kernel where the layers
    have them (fused_ops_for), else torch's."""
    if fused is not None:
        return fused.silu_and_mul(gu)
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul. `inter`: this rank's share of the
    width; the down projection's partial sums are all-reduced unless `reduce_output` is False (the norm after it
    then all-reduces them: see reduce_add_norm)."""

    def __init__(self, hidden: int, inter: int, fused: Optional[Any] = None, tp: Optional[TensorParallel] = None,
                 quantization: Optional[str] = None, reduce_output: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = make_linear(hidden, 2 * inter, False, quantization, fused)
        self.down_proj = make_linear(inter, hidden, False, quantization, fused)
        self.fused = fused
        self.tp = tp or TensorParallel.single()
        self.reduce_output = reduce_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if isinstance(self.down_proj, Fp8Linear):  # its input quantised as it is computed
            out = self.down_proj.forward_silu_mul(gu)
        else:
            out = self.down_proj(silu_and_mul(gu, self.fused))
        return self.tp.all_reduce(out) if self.reduce_output else out


class VocabEmbedding(nn.Module):
    """Token embedding over this rank's rows of the vocabulary [start, start + rows); ids outside it contribute
    zeros, and the all-reduce sums each token's one non-zero row. Its weight doubles as a tied lm_head."""

    def __init__(self, rows: int, hidden: int, start: int = 0, tp: Optional[TensorParallel] = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start = start
        self.tp = tp or TensorParallel.single()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class Attention(nn.Module):
    """Grouped-query attention: fused qkv projection, optional q/k RMSNorm (Qwen3), rotary, then the backend."""

    def __init__(self, args: ModelArgs, layer_id: int, rotary: RotaryEmbedding, fused: Optional[Any] = None,
                 num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 tp: Optional[TensorParallel] = None, quantization: Optional[str] = None,
                 reduce_output: bool = True) -> None:
        """num_heads / num_kv_heads: this rank's heads (default: all); o_proj's partial sums are all-reduced unless
        `reduce_output` is False (the norm after it then all-reduces them: see reduce_add_norm). quantization: the
        projections' (make_linear)."""
        super().__init__()
        self.fused = fused
        self.layer_id = layer_id
        self.tp = tp or TensorParallel.single()
        self.hq, self.hkv, self.d = num_heads or args.num_heads, num_kv_heads or args.num_kv_heads, args.head_dim
        self.q_size, self.kv_size = self.hq * self.d, self.hkv * self.d
        self.qkv_proj = make_linear(args.hidden_size, self.q_size + 2 * self.kv_size, args.attention_bias,
                                    quantization, fused)
        self.o_proj = make_linear(self.q_size, args.hidden_size, False, quantization, fused)
        self.q_norm = RMSNorm(self.d, args.rms_norm_eps, fused) if args.qk_norm else None
        self.k_norm = RMSNorm(self.d, args.rms_norm_eps, fused) if args.qk_norm else None
        self.rotary = rotary
        self.reduce_output = reduce_output

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: Callable) -> torch.Tensor:
        """attn: the step's attention (an attention.AttentionStep), called as attn(q, k, v, layer_id)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.hq, self.d)
        k = k.reshape(t, self.hkv, self.d)
        v = v.reshape(t, self.hkv, self.d)
        prep = fused_qk_rope_store(qkv) if self.fused is not None else None
        if prep is not None:  # norms and rotary in place and, where the backend lets it, the store: one kernel
            target = attn.kv_store_target(self.layer_id)
            norm = self.q_norm is not None
            prep(qkv, positions, self.rotary.cos_sin, self.hq, self.hkv, self.d,
                 self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                 self.q_norm.eps if norm else 0.0, *(target or ()))
            if target is not None:
                k = v = None
        else:
            if self.q_norm is not None:
                if self.fused is not None:  # per-head norms in place, on the strided views of the qkv output
                    self.fused.rmsnorm(q, self.q_norm.weight, self.q_norm.eps, out=q)
                    self.fused.rmsnorm(k, self.k_norm.weight, self.k_norm.eps, out=k)
                else:
                    q = self.q_norm(q.reshape(-1, self.d)).view(t, self.hq, self.d)
                    k = self.k_norm(k.reshape(-1, self.d)).view(t, self.hkv, self.d)
            # with the fused ops, rotated in place: k and v stay side by side in the qkv output (one scatter
            # stores both)
            q, k = self.rotary(positions, q, k)
        o = attn(q, k, v, self.layer_id)
        out = self.o_proj(o.reshape(t, self.q_size))
        return self.tp.all_reduce(out) if self.reduce_output else out


def reduce_add_norm(tp: TensorParallel, norm: "RMSNorm", x: torch.Tensor, residual: torch.Tensor,
                    x_is_partial: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum + residual), sum + residual), where sum is x all-reduced over the ranks if `x_is_partial` (a
    row-parallel projection's output whose all-reduce was deferred to here), else x itself. With the group's
    fused kernel (tp.fused_norm) the all-reduce, the add and the norm are one kernel instead of two."""
    if x_is_partial:
        fused = tp.fused_norm
        if fused is not None and fused.fits(x):
            return fused(x, residual, norm.weight, norm.eps)
        x = tp.all_reduce(x)
    return norm(x, residual)
