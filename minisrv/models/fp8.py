"""FP8 (float8_e4m3fn) linear layers: weights stored in one byte each with a scale per output channel, activations
quantised per token as they arrive, the product by one scaled GEMM.

Why this form: decode reads every weight once per step, so weight bytes set the floor of a step at small batches;
one byte instead of two halves it. A scale per output row (rather than one per tensor or per 128x128 block) keeps
the error of each row to its own range and is what `torch._scaled_mm`'s row-wise mode takes on Hopper (scale_a
[M, 1] per token, scale_b [1, N] per channel, bfloat16 out), so one kernel does the whole GEMM. Where that kernel
is missing (the CPU, a float32 or float16 model), the same arithmetic runs as a dequantised matmul: identical
quantisation, so CPU tests check what the GPU computes up to the GEMM's summation order.

The loader quantises each checkpoint tensor as it is read (`Fp8Linear.load_rows`), so the model never exists in
bf16 in full. Checkpoints that are already FP8 (per-tensor scales, or 128x128 block scales as in Qwen3's and
DeepSeek's FP8 releases) are dequantised as they are read (`dequantize`) and requantised per output row: per-tensor
scales become rows of the same scale; block scales cost one more rounding, at most one e4m3 step per element (see
tests/test_fp8_weights.py for the bound).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from minisrv.models.small_m_gemm import SMALL_M, fits, small_m_gemm

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_SCALE = 1e-12  # an all-zero row or token gets this scale (its quantised values are all 0)
LINEAR_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # quantised; embedding, norms, lm_head are not
# a decoder layer's norms whose output feeds an FP8 projection ((sub-module, projection) of the same layer): they
# can hand it quantised activations
NORMS_BEFORE_PROJECTIONS = {"input_layernorm": ("self_attn", "qkv_proj"),
                            "post_attention_layernorm": ("mlp", "gate_up_proj")}


def quantize_rows(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (float8 [R, C], float32 scale [R, 1]) with x ~= q * scale, each row scaled to its own max."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_(min=MIN_SCALE) / FP8_MAX
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: Optional[Tuple[int, int]] = None,
               rows: Optional[Tuple[int, int]] = None, cols: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """float32 values of an FP8 checkpoint tensor q [R, C] (or a slice of one). scale: a scalar (per tensor),
    [R_full] or [R_full, 1] (per row), or [ceil(R_full / bh), ceil(C_full / bw)] with block=(bh, bw). rows / cols:
    where q's rows / columns start in the full tensor, and how many (a tensor-parallel rank's slice)."""
    q = q.float()
    scale = scale.float()
    r0 = rows[0] if rows else 0
    c0 = cols[0] if cols else 0
    if scale.numel() == 1:
        return q * scale.reshape(())
    if block is None:  # per row
        s = scale.reshape(-1)[r0:r0 + q.shape[0]]
        return q * s[:, None]
    bh, bw = block
    ri = torch.arange(r0, r0 + q.shape[0]) // bh
    ci = torch.arange(c0, c0 + q.shape[1]) // bw
    return q * scale[ri][:, ci]


class Fp8Activations(NamedTuple):
    """Activations already quantised per token (q float8 [T, K], scale float32 [T, 1]), as a fused norm hands them
    to the projection after it (see RMSNorm.quantize_out); `shape` is q's, so layers can size by it."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


class FusedQuantisers(NamedTuple):
    """The per-token quantisers of _triton_quant, each returning Fp8Activations."""

    quant: Callable[[torch.Tensor], Fp8Activations]  # x [T, K]
    silu_mul_quant: Callable[[torch.Tensor], Fp8Activations]  # [gate | up] [T, 2K] -> silu(gate) * up
    # (x, residual or None, weight, eps) -> rmsnorm(x + residual) * weight; residual <- x + residual in place
    add_norm_quant: Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor, float], Fp8Activations]


@functools.lru_cache(maxsize=None)
def _triton_quant() -> Optional[FusedQuantisers]:
    """One-kernel per-token quantisers (Triton) for CUDA, or None where Triton is missing: `quant(x)`, and two that
    compute the activation they quantise, so it never goes to memory in bf16: `silu_mul_quant(gu)` (SiLU(gate) *
    up, the MLP's down-projection input) and `add_norm_quant(x, residual, weight, eps)` (the decoder's residual add
    and RMSNorm, the qkv and gate/up projections' input; residual updated in place to x + residual, or None).
    Why: eager torch takes five kernels to quantise, and a decode step quantises four activations per layer;
    fusing three of them into the kernels before them leaves one extra kernel per layer instead of four. (Under
    tensor parallelism with the all-reduce fusion, the norms of decode batches run inside the all-reduce kernel
    instead, and the qkv and gate/up inputs take `quant` after it.)

    Each rounds to the model's dtype where the unfused path does (after the add and after the norm, HF's order;
    after SiLU-and-mul), so the two paths quantise the same values up to one rounding: the CPU path also rounds
    SiLU's output before the multiply, which can move a value by one bf16 ulp."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means "not present"
        return None

    @triton.jit
    def kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, n, stride, r_stride, eps, BLOCK: tl.constexpr,
               MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
        """MODE 0: quantise x's row; 1: x's row is [gate | up] (2n wide), quantise silu(gate) * up; 2: quantise
        rmsnorm(x + residual) * w, writing x + residual to residual when HAS_RESIDUAL."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < n
        dtype = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride + offs, mask=ok, other=0.0).to(tl.float32)
        if MODE == 1:
            up = tl.load(x_ptr + row * stride + n + offs, mask=ok, other=0.0).to(tl.float32)
            x = (x / (1.0 + tl.exp(-x)) * up).to(dtype).to(tl.float32)
        if MODE == 2:
            if HAS_RESIDUAL:
                x = (x + tl.load(r_ptr + row * r_stride + offs, mask=ok, other=0.0).to(tl.float32)).to(dtype)
                tl.store(r_ptr + row * r_stride + offs, x, mask=ok)
                x = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
            w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            x = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / 448.0
        y = tl.minimum(tl.maximum(x / s, -448.0), 448.0)
        tl.store(q_ptr + row * n + offs, y.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row, s)

    def launch(x: torch.Tensor, n: int, mode: int, residual=None, weight=None, eps: float = 0.0) -> Fp8Activations:
        t = x.shape[0]
        if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
            raise ValueError("the fused quantisers need rows of unit column stride")
        q = torch.empty((t, n), dtype=FP8, device=x.device)
        s = torch.empty((t, 1), dtype=torch.float32, device=x.device)
        if t:
            block = triton.next_power_of_2(n)
            kernel[(t,)](x, residual if residual is not None else x, weight if weight is not None else x, q, s, n,
                         x.stride(0), residual.stride(0) if residual is not None else 0, eps, BLOCK=block,
                         MODE=mode, HAS_RESIDUAL=residual is not None,
                         num_warps=16 if block >= 16384 else (8 if block >= 4096 else 4))
        return Fp8Activations(q, s)

    return FusedQuantisers(
        quant=lambda x: launch(x, x.shape[1], 0),
        silu_mul_quant=lambda gu: launch(gu, gu.shape[1] // 2, 1),
        add_norm_quant=lambda x, residual, weight, eps: launch(x, x.shape[1], 2, residual, weight, eps))


def quantize_tokens(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Activations [T, K] -> (float8 [T, K], float32 [T, 1]), one scale per token (dynamic: no calibration)."""
    if x.is_cuda and x.stride(-1) == 1:
        fused = _triton_quant()
        if fused is not None:
            return tuple(fused.quant(x))
    return quantize_rows(x)


def fused_quantisers(x: torch.Tensor) -> Optional[FusedQuantisers]:
    """The fused quantisers (see _triton_quant) for activations like x, or None (CPU, no Triton, not contiguous,
    not bf16/fp16): the caller then computes the activation and quantises it separately."""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16):
        return _triton_quant()
    return None


def _scaled_mm_ok(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the FP8 GEMM kernels run for activations on x's device, of the model's `dtype`."""
    return x.is_cuda and dtype == torch.bfloat16 and hasattr(torch, "_scaled_mm")


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in float8_e4m3fn [N, K] and a float32 scale per output row; x quantised per token."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                 source_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [N, K] float8_e4m3fn
        self.weight_scale = nn.Parameter(scale.reshape(1, -1).float().contiguous(), requires_grad=False)  # [1, N]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.source_dtype = source_dtype  # the model's dtype: loaded rows are rounded to it before quantising

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        """Quantised from a linear layer's weights (on the meta device: the shapes only, for the loader to fill)."""
        q, scale = quantize_rows(linear.weight.detach())
        return cls(q, scale, linear.bias, linear.weight.dtype)

    @torch.no_grad()
    def load_rows(self, row: int, w: torch.Tensor) -> None:
        """Quantise checkpoint rows w [n, K] into output rows [row, row + n) (the loader's path: the model's weights
        never exist in bf16 in full, only one checkpoint tensor at a time). The same bytes as loading the rows into
        a `source_dtype` linear layer and converting it with `from_linear`, since each row is scaled on its own."""
        q, scale = quantize_rows(w.to(self.weight.device, self.source_dtype))
        self.weight[row:row + w.shape[0]] = q
        self.weight_scale[0, row:row + w.shape[0]] = scale.reshape(-1)

    def dequantized_weight(self) -> torch.Tensor:
        """W as float32 [N, K] (what the layer multiplies by)."""
        return self.weight.float() * self.weight_scale.reshape(-1, 1)

    def forward(self, x) -> torch.Tensor:
        """x: activations [..., K], or Fp8Activations [T, K] (quantised already, by a fused norm or by
        `forward_silu_mul`)."""
        if isinstance(x, Fp8Activations):
            lead, (xq, xs), like = x.q.shape[:-1], x, x.q
            dtype = self.source_dtype
        else:
            lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
            xq, xs = quantize_tokens(x2)
            like, dtype = x2, x.dtype
        out = None
        if _scaled_mm_ok(like, dtype) and 0 < xq.shape[0] <= SMALL_M and fits(self.in_features):
            small = small_m_gemm()  # decode batches: narrow output tiles (see small_m_gemm.py)
            out = small(xq, self.weight, xs=xs, ws=self.weight_scale) if small is not None else None
        if out is None and _scaled_mm_ok(like, dtype):
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale,
                                   out_dtype=torch.bfloat16)
        elif out is None:  # the same product, dequantised (CPU; float32 / float16 models)
            out = ((xq.float() * xs) @ self.dequantized_weight().t()).to(dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def forward_silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """forward(silu(gate) * up) for gu = [gate | up] [T, 2K], the activation computed and quantised in one
        kernel where there is one (fused_quantisers)."""
        fused = fused_quantisers(gu)
        if fused is not None:
            return self.forward(fused.silu_mul_quant(gu))
        g, u = gu.chunk(2, dim=-1)
        return self.forward(F.silu(g) * u)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn per-row scales"


def quantize_linear_layers(model: nn.Module) -> int:
    """Replace the decoder's projection layers (LINEAR_NAMES) by Fp8Linear, quantising their weights per output
    row (on a meta-device model: swapped for empty FP8 layers the loader fills), and have the norms before them
    hand over quantised activations. Returns how many layers were replaced."""
    count = 0
    for module in list(model.modules()):
        for name in LINEAR_NAMES:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, Fp8Linear.from_linear(child))
                count += 1
    for module in model.modules():  # after every swap: a layer comes before its projections in modules()
        for name, (block, projection) in NORMS_BEFORE_PROJECTIONS.items():
            norm, fed = getattr(module, name, None), getattr(getattr(module, block, None), projection, None)
            if hasattr(norm, "quantize_out") and isinstance(fed, Fp8Linear):
                norm.quantize_out = True
    return count


def fp8_checkpoint_format(quantization_config: Optional[dict]) -> Optional[Any]:
    """For a checkpoint's `quantization_config`: None when it is not quantised; the block shape (bh, bw) or
    "tensor" (per-tensor or per-row scales) for an `fp8` one. Other methods raise ValueError naming them."""
    if not quantization_config:
        return None
    method = quantization_config.get("quant_method")
    if method != "fp8":
        raise ValueError(f"unsupported checkpoint quantization {method!r}: minisrv reads fp8 checkpoints "
                         "(per-tensor, per-channel or 128x128 block scales) and bf16/fp16/fp32 ones")
    block = quantization_config.get("weight_block_size")
    return tuple(int(b) for b in block) if block else "tensor"
