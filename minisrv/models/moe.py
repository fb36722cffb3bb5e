"""The sparse MLP of a mixture-of-experts layer (Qwen3-MoE, Mixtral, Qwen2-MoE): a router picks each token's top-k
experts, each a gated SiLU MLP, and their outputs are summed by the routing weights; Qwen2-MoE adds a shared expert
that every token takes, scaled by a sigmoid gate.

The experts are held stacked per layer (Experts), as the fused kernel takes them (kernels/fused_moe.py: Triton on
CUDA, a loop over the experts hit elsewhere). The loader fills them from the checkpoint's per-expert tensors one at a
time (`load_rows`), so no second copy of the experts is ever held. Under tensor parallelism each rank holds every
expert's slice of the intermediate width (as the dense MLP is split): its output is a partial sum, all-reduced like
the dense MLP's. FP8 experts are quantised as they are loaded (as Fp8Linear's rows); a 4-bit checkpoint's stay in 4
bits (w4a16.W4A16Experts), gpt-oss's MXFP4 ones (hub checkpoints on CUDA) as the checkpoint has them; the router
stays in the model's dtype. gpt-oss: a router with a bias, biases on both of the experts' products (the down bias
held by rank 0 alone: the other ranks' partial sums must not add it again), the clamped SwiGLU.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from minisrv.distributed import TensorParallel
from minisrv.kernels.fp8_quant import FP8, quantize_rows
from minisrv.kernels.fused_moe import Weights, fused_experts, route, route_and_align
from minisrv.kernels.moe_align import Aligned
from minisrv.kernels.moe_gemm import ClampedSwiGLU
from minisrv.kernels.moe_w4a16 import Mxfp4Experts

from .args import ModelArgs
from .layer_ops import LayerOps
from .layers import GatedMLP
from .w4a16 import Int4Scheme, W4A16Experts


class Experts(nn.Module):
    """E experts' weights, stacked: w13 [E, 2I, H] and w2 [E, H, I] in the model's dtype; in float8_e4m3fn with
    w13_scale [E, 2I] and w2_scale [E, H] (a float32 scale per output row) for quantization "fp8"; for "mxfp4",
    w13 [E, 2I, H/2] and w2 [E, H, I/2] bytes with their e8m0 exponents w13_scale [E, 2I, H/32] and w2_scale
    [E, H, I/32]. bias: w13_bias [E, 2I] and w2_bias [E, H]; swiglu: the clamped SwiGLU for SiLU-and-mul."""

    def __init__(self, num_experts: int, hidden: int, inter: int, quantization: Optional[str] = None,
                 bias: bool = False, swiglu: Optional[ClampedSwiGLU] = None) -> None:
        super().__init__()
        if quantization not in (None, "fp8", "mxfp4"):  # (4-bit integer experts: W4A16Experts)
            raise ValueError(f"unsupported quantization for a mixture of experts' experts: {quantization}")
        self.fp8, self.mxfp4, self.swiglu = quantization == "fp8", quantization == "mxfp4", swiglu
        self.source_dtype = torch.get_default_dtype()  # the model's dtype: rows are rounded to it before quantising

        def param(*shape, dtype=None, make=torch.empty):
            return nn.Parameter(make(num_experts, *shape, dtype=dtype), requires_grad=False)
        if self.mxfp4:
            if hidden % 32 or inter % 32:
                raise ValueError(f"MXFP4 experts need widths of whole 32s: hidden {hidden}, this rank's {inter}")
            self.w13 = param(2 * inter, hidden // 2, dtype=torch.uint8)
            self.w2 = param(hidden, inter // 2, dtype=torch.uint8)
            self.w13_scale = param(2 * inter, hidden // 32, dtype=torch.uint8)
            self.w2_scale = param(hidden, inter // 32, dtype=torch.uint8)
        else:
            dtype = FP8 if self.fp8 else None
            self.w13, self.w2 = param(2 * inter, hidden, dtype=dtype), param(hidden, inter, dtype=dtype)
            self.w13_scale = param(2 * inter, dtype=torch.float32, make=torch.ones) if self.fp8 else None
            self.w2_scale = param(hidden, dtype=torch.float32, make=torch.ones) if self.fp8 else None
        self.w13_bias = param(2 * inter) if bias else None
        self.w2_bias = param(hidden) if bias else None

    @torch.no_grad()
    def load_rows(self, which: str, expert: int, row: int, w: Any) -> None:
        """Checkpoint rows w [n, K] of one expert's `which` ("w13" or "w2") into its rows [row, row + n),
        quantised per row for FP8; for MXFP4, w is the rows' (bytes, exponents)."""
        param = getattr(self, which)
        if self.mxfp4:
            blocks, scales = w
            param[expert, row:row + blocks.shape[0]] = blocks.to(param.device)
            getattr(self, which + "_scale")[expert, row:row + blocks.shape[0]] = scales.to(param.device)
        elif not self.fp8:
            param[expert, row:row + w.shape[0]] = w.to(param.device, param.dtype)
        else:
            q, scale = quantize_rows(w.to(param.device, self.source_dtype))
            param[expert, row:row + w.shape[0]] = q
            getattr(self, which + "_scale")[expert, row:row + w.shape[0]] = scale.reshape(-1)

    def stacks(self) -> Tuple[Weights, Weights]:
        """w13 and w2 as the fused experts take them (MXFP4: each stack's bytes with their exponents)."""
        if self.mxfp4:
            return Mxfp4Experts(self.w13, self.w13_scale), Mxfp4Experts(self.w2, self.w2_scale)
        return self.w13, self.w2

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                aligned: Optional[Aligned] = None) -> torch.Tensor:
        scales = (None, None) if self.mxfp4 else (self.w13_scale, self.w2_scale)
        return fused_experts(x, *self.stacks(), topk_weights, topk_ids, *scales, aligned=aligned,
                             w13_bias=self.w13_bias, w2_bias=self.w2_bias, swiglu=self.swiglu)

    def extra_repr(self) -> str:
        e, two_i, h = self.w13.shape
        kind = ", float8_e4m3fn per-row scales" if self.fp8 else ", MXFP4" if self.mxfp4 else ""
        return f"experts={e}, hidden={h * 2 if self.mxfp4 else h}, inter={two_i // 2}{kind}"


class SparseMoE(nn.Module):
    """router -> top-k -> experts (-> + sigmoid(shared gate) * shared expert); the partial sums of this rank's
    share of each expert are all-reduced unless `reduce_output` is False (the norm after it reduces them)."""

    def __init__(self, args: ModelArgs, inter: int, shared_inter: int, ops: LayerOps, tp: TensorParallel,
                 quantization: Optional[str], reduce_output: bool) -> None:
        """inter / shared_inter: this rank's share of each expert's width / of the shared expert's (0: none)."""
        super().__init__()
        self.top_k, self.renormalize = args.experts_per_token, args.norm_topk_prob
        # the router, in the model's dtype
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=args.expert_bias)
        if isinstance(quantization, Int4Scheme):
            self.experts = W4A16Experts(args.num_experts, args.hidden_size, inter, quantization)
        else:
            swiglu = ClampedSwiGLU(args.swiglu_alpha, args.swiglu_limit) if args.swiglu_limit is not None else None
            self.experts = Experts(args.num_experts, args.hidden_size, inter, quantization, args.expert_bias, swiglu)
        if shared_inter:
            self.shared_expert = GatedMLP(args.hidden_size, shared_inter, ops, tp, quantization,
                                          reduce_output=False)
            self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.tp, self.reduce_output = tp, reduce_output
        self.reset_buffers()

    def reset_buffers(self, device: Optional[torch.device] = None) -> None:
        """The small-batch router's arrival counter (fused_moe.route_and_align), zeroed (after meta-device
        construction: the loader calls this)."""
        self.register_buffer("router_counter", torch.zeros(1, dtype=torch.int32, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = route_and_align(x, self.gate.weight, self.router_counter, self.top_k, self.renormalize,
                                 self.experts.stacks()[0], self.experts.fp8, self.gate.bias)
        topk_weights, topk_ids, aligned = routed if routed is not None else \
            (*route(self.gate(x), self.top_k, self.renormalize), None)  # (None: fused_experts aligns them)
        out = self.experts(x, topk_weights, topk_ids, aligned=aligned)
        if self.shared_expert is not None:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out) if self.reduce_output else out
