"""FP8 (float8_e4m3fn) linear layers: weights stored in one byte each with a scale per output channel, activations
quantised per token as they arrive, the product by one scaled GEMM.

Why this form: decode reads every weight once per step, so weight bytes set the floor of a step at small batches;
one byte instead of two halves it. A scale per output row (rather than one per tensor or per 128x128 block) keeps
the error of each row to its own range and is what `torch._scaled_mm`'s row-wise mode takes on Hopper (scale_a
[M, 1] per token, scale_b [1, N] per channel, bfloat16 out), so one kernel does the whole GEMM; decode batches take
the small-batch kernel instead (kernels/fp8_gemm.py), whose narrow tiles read the weights on every SM. Where
neither runs (the CPU, a float32 or float16 model), the same arithmetic runs as a dequantised matmul: identical
quantisation, so CPU tests check what the GPU computes up to the GEMM's summation order.

The loader quantises each checkpoint tensor as it is read (`Fp8Linear.load_rows`), so the model never exists in
bf16 in full. Checkpoints that are already FP8 (per-tensor scales, or 128x128 block scales as in Qwen3's and
DeepSeek's FP8 releases) are dequantised as they are read (checkpoints/fp8_checkpoint.py) and requantised per
output row: per-tensor scales become rows of the same scale; block scales cost one more rounding, at most one e4m3
step per element (see tests/test_fp8_weights.py for the bound).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from minisrv.kernels.fp8_gemm import SMALL_M, dequantized_matmul, fits, small_m_fp8_gemm
from minisrv.kernels.fp8_quant import FP8, Fp8Activations, fused_quantisers, quantize_rows, quantize_tokens

__all__ = ["FP8", "Fp8Activations", "Fp8Linear", "fp8_checkpoint_format", "quantize_rows"]


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in float8_e4m3fn [N, K] and a float32 scale per output row; x quantised per token.
    Built empty (on the meta device, as the loader builds models) and filled row by row by `load_rows`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 source_dtype: Optional[torch.dtype] = None) -> None:
        """source_dtype: the model's dtype, which loaded rows are rounded to before quantising and the bias and the
        output (off CUDA) are in; default torch's default dtype, as for nn.Linear's parameters."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.source_dtype = source_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(1, out_features, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=self.source_dtype), requires_grad=False) \
            if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        """Quantised from a linear layer's weights, on the same device."""
        with torch.device(linear.weight.device):
            layer = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        layer.load_rows(0, linear.weight.detach())
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    @torch.no_grad()
    def load_rows(self, row: int, w: torch.Tensor) -> None:
        """Quantise checkpoint rows w [n, K] into output rows [row, row + n) (the loader's path: the model's weights
        never exist in bf16 in full, only one checkpoint tensor at a time). Each row is scaled on its own, so the
        bytes do not depend on how the rows arrive."""
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
            lead, (xq, xs), dtype = x.q.shape[:-1], x, self.source_dtype
        else:
            lead, dtype = x.shape[:-1], x.dtype
            xq, xs = quantize_tokens(x.reshape(-1, x.shape[-1]))
        if xq.is_cuda and dtype == torch.bfloat16 and hasattr(torch, "_scaled_mm"):  # the FP8 GEMM kernels run
            out = None
            if 0 < xq.shape[0] <= SMALL_M and fits(self.in_features):  # decode batches: narrow output tiles
                small = small_m_fp8_gemm()
                out = small(xq, xs, self.weight, self.weight_scale) if small is not None else None
            if out is None:
                out = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale,
                                       out_dtype=torch.bfloat16)
        else:  # the same product, dequantised (CPU; float32 / float16 models)
            out = dequantized_matmul(xq, xs, self.weight, self.weight_scale).to(dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*lead, self.out_features)

    def forward_silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """forward(silu(gate) * up) for gu = [gate | up] [T, 2K], the activation computed and quantised in one
        kernel where there is one (kernels/fp8_quant.py)."""
        fused = fused_quantisers(gu)
        if fused is not None:
            return self.forward(fused.silu_mul_quant(gu))
        g, u = gu.chunk(2, dim=-1)
        return self.forward(torch.nn.functional.silu(g) * u)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float8_e4m3fn per-row scales"


def fp8_checkpoint_format(quantization_config: Optional[dict]) -> Optional[Any]:
    """For a checkpoint's `quantization_config`: None when it is not quantised, or only gpt-oss's experts are
    (mxfp4: checkpoints/gpt_oss_experts.py); the block shape (bh, bw) or "tensor" (per-tensor or per-row scales)
    for an `fp8` one. Other methods raise ValueError naming them."""
    method = (quantization_config or {}).get("quant_method")
    if not quantization_config or method == "mxfp4":
        return None
    if method != "fp8":
        raise ValueError(f"unsupported checkpoint quantization {method!r}: minisrv reads fp8 checkpoints "
                         "(per-tensor, per-channel or 128x128 block scales), 4-bit awq, gptq and compressed-tensors "
                         "ones, gpt-oss's mxfp4 experts and bf16/fp16/fp32 ones")
    block = quantization_config.get("weight_block_size")
    return tuple(int(b) for b in block) if block else "tensor"
