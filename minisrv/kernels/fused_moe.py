"""Mixture-of-experts MLPs (Qwen3-MoE, Mixtral, Qwen2-MoE): the router's top-k (`route`) and the experts'
computation, out[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])) with e = ids[t, j].

`experts_reference` is the torch computation: a loop over the experts hit (it reads the hit experts on the host, so
it syncs and is not captured in CUDA graphs). It is the CPU path and the fused path's reference. `fused_experts` is
the CUDA path in four launches at decode (six with FP8), after the router's one (kernels/moe_route.py), and no host
sync: the pairs aligned by expert (kernels/moe_align.py; three launches and a memset past 256 tokens of top-8), the
grouped gate/up GEMM with SiLU-and-mul in its epilogue, the grouped down GEMM scaled by the routing weights
(kernels/moe_gemm.py), and the sum over k; with FP8 weights each GEMM's input is quantised per token first
(kernels/fp8_quant.py), as Fp8Linear does.

Why fused: at decode a MoE layer reads the weights of the experts hit (top-8 of 128 at batch 1: 8 experts), and
looping over experts in torch costs a host sync and ~6 launches per expert; the grouped GEMM reads each hit expert's
weights once for all of its tokens, in two launches.

Weights as the model holds them: w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I]; for FP8,
float8_e4m3fn with float32 scales per output row, w13_scale [E, 2I] and w2_scale [E, H] ([E, N, 1] is taken too);
4-bit (W4A16), kernels/moe_w4a16.py's PackedExperts, w13 of [H, 2I] and w2 of [I, H] matrices, no scales apart;
MXFP4, its Mxfp4Experts, w13 of [2I, H] and w2 of [H, I] rows. gpt-oss's experts add biases to both products
(w13_bias [E, 2I], w2_bias [E, H]) and take the clamped SwiGLU (moe_gemm.ClampedSwiGLU) for SiLU-and-mul.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F

from minisrv.kernels.fp8_gemm import dequantized_matmul
from minisrv.kernels.fp8_quant import FP8, quantize_tokens
from minisrv.kernels.moe_align import Aligned, triton_align
from minisrv.kernels.moe_gemm import ClampedSwiGLU, MoeConfig, config_for, moe_gemm
from minisrv.kernels.moe_route import ROUTER_TOKENS, triton_route, triton_router
from minisrv.kernels.moe_w4a16 import Mxfp4Experts, PackedExperts
from minisrv.kernels.mxfp4_pairs import mxfp4_pair_gemv
from minisrv.kernels.w4a16_gemm import w4a16_gemm

PAIR_ROWS = 16  # 4-bit and MXFP4 experts: up to this many (token, expert) pairs run as rows of a GEMV

Weights = Union[torch.Tensor, PackedExperts, Mxfp4Experts]  # an expert stack in the model's dtype or FP8, or 4 bits


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any float dtype) -> (weights float32 [T, top_k], ids int32 [T, top_k]), largest first:
    softmax over the E experts in float32, the top k, and with `renormalize` the k weights divided by their sum
    (Qwen3-MoE with norm_topk_prob, Mixtral; Qwen2-MoE does not renormalise). No host sync: on CUDA one
    Triton launch (kernels/moe_route.py), elsewhere route_reference."""
    fused = triton_route() if router_logits.is_cuda else None
    if fused is not None:
        return fused(router_logits, top_k, renormalize)
    return route_reference(router_logits, top_k, renormalize)


def route_and_align(x: torch.Tensor, router_weight: torch.Tensor, counter: torch.Tensor, top_k: int,
                    renormalize: bool, w13: Weights, fp8: bool, router_bias: Optional[torch.Tensor] = None
                    ) -> Optional[Tuple[torch.Tensor, torch.Tensor, Aligned]]:
    """For decode batches of up to ROUTER_TOKENS tokens where the fused experts run: route(x @ router_weight^T +
    router_bias) and the pairs aligned for the experts' launch rule, in one launch (moe_route.triton_router;
    `counter` a zeroed int32 [1] kept for these calls). None elsewhere: route the router's own product, and the
    experts align."""
    if not (x.is_cuda and 0 < x.shape[0] <= ROUTER_TOKENS and router_weight.dtype == x.dtype
            and router_weight.is_contiguous() and fused_runs(x, w13, fp8)):
        return None
    router = triton_router()
    if router is None:
        return None
    c = launch_config(x.shape[0] * top_k, w13, fp8)
    return router(x, router_weight, counter, top_k, renormalize, c.block_m, router_bias)


def launch_config(n_pairs: int, w13: Weights, fp8: bool) -> MoeConfig:
    """The grouped GEMMs' launch rule (moe_gemm.config_for; 4-bit experts take bf16's, MXFP4 ones their own)."""
    if isinstance(w13, (PackedExperts, Mxfp4Experts)):
        return config_for(n_pairs, w13.num_experts, False, isinstance(w13, Mxfp4Experts))
    return config_for(n_pairs, w13.shape[0], fp8)


def route_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """route in torch ops. Renormalised, the weights are computed as the softmax of the k largest logits, which
    equals softmax -> top-k -> divide by the sum (softmax is monotonic, and the common normaliser cancels)."""
    if renormalize:
        logits, ids = torch.topk(router_logits, top_k, dim=-1)
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        weights, ids = torch.topk(torch.softmax(router_logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    return weights, ids.to(torch.int32)


def _check_shapes(x: torch.Tensor, w13: Weights, w2: Weights, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor]) -> None:
    t, h = x.shape
    bad_topk = topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t
    if isinstance(w13, (PackedExperts, Mxfp4Experts)):
        kind, name = ("MXFP4", "Mxfp4Experts") if isinstance(w13, Mxfp4Experts) else ("4-bit", "PackedExperts")
        if type(w2) is not type(w13) or w13_scale is not None or w2_scale is not None \
                or w2.num_experts != w13.num_experts or bad_topk:
            raise ValueError(f"{kind} experts: w13 and w2 both {name} of as many experts, no separate scales, "
                             f"topk {tuple(topk_weights.shape)} / {tuple(topk_ids.shape)}")
        w13.check(h, w13.n, "w13")
        w2.check(w13.n // 2, h, "w2")
        return
    e, two_i, h13 = w13.shape
    if h13 != h or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2) or bad_topk \
            or (w13_scale is None) != (w2_scale is None):
        raise ValueError(f"experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, topk "
                         f"{tuple(topk_weights.shape)} / {tuple(topk_ids.shape)}, scales "
                         f"{w13_scale is not None} / {w2_scale is not None}")
    if w13_scale is not None and (w13.dtype != FP8 or w2.dtype != FP8 or w13_scale.numel() != e * two_i
                                  or w2_scale.numel() != e * h):
        raise ValueError(f"FP8 experts: w13 {w13.dtype}, w2 {w2.dtype} (float8_e4m3fn), scales "
                         f"{tuple(w13_scale.shape)} / {tuple(w2_scale.shape)} (per output row: [E, 2I] / [E, H])")


def experts_reference(x: torch.Tensor, w13: Weights, w2: Weights, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
                      w2_scale: Optional[torch.Tensor] = None, w13_bias: Optional[torch.Tensor] = None,
                      w2_bias: Optional[torch.Tensor] = None, swiglu: Optional[ClampedSwiGLU] = None) -> torch.Tensor:
    """The experts in torch: for each expert that received a pair, its tokens' rows, the gate/up product, silu(gate)
    * up, the down product, scaled by the routing weights and summed into a float32 accumulator (float64 for
    float64 x); x.dtype out. Products and SiLU-and-mul round to x.dtype as the dense MLP does off CUDA. FP8: each
    product's input quantised per token (quantize_tokens) and the product dequantised in float32 (float64 for
    float64 x: dequantized_matmul), Fp8Linear's path off CUDA. 4-bit: each expert dequantised, then multiplied
    (PackedExperts.product, W4A16Linear's path off CUDA; MXFP4 alike). Biases are added to each product in x.dtype,
    and `swiglu` replaces SiLU-and-mul, as transformers' gpt-oss does. Syncs with the host (which experts are hit)."""
    _check_shapes(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    t, h = x.shape
    packed = isinstance(w13, (PackedExperts, Mxfp4Experts))
    num_experts, top_k = (w13.num_experts if packed else w13.shape[0]), topk_ids.shape[1]
    fp8 = w13_scale is not None
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if fp8:
        xq, xs = quantize_tokens(x)
        w13_scale, w2_scale = w13_scale.reshape(num_experts, -1), w2_scale.reshape(num_experts, -1)
    flat = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1).to(acc_dtype)
    order = torch.argsort(flat, stable=True)
    out = torch.zeros(t, h, dtype=acc_dtype, device=x.device)
    start = 0
    for e, count in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        if fp8:
            gu = dequantized_matmul(xq[tokens], xs[tokens], w13[e], w13_scale[e], acc_dtype).to(x.dtype)
        elif packed:
            gu = w13.product(x.index_select(0, tokens), e)
        else:
            gu = x.index_select(0, tokens) @ w13[e].t()
        if w13_bias is not None:
            gu = gu + w13_bias[e].to(gu.dtype)
        gate, up = gu.chunk(2, dim=-1)
        act = swiglu(gate, up) if swiglu is not None else F.silu(gate) * up
        if fp8:
            y = dequantized_matmul(*quantize_tokens(act), w2[e], w2_scale[e], acc_dtype).to(x.dtype)
        elif packed:
            y = w2.product(act, e)
        else:
            y = act @ w2[e].t()
        if w2_bias is not None:
            y = y + w2_bias[e].to(y.dtype)
        out.index_add_(0, tokens, y.to(acc_dtype) * weights[pairs, None])
    return out.to(x.dtype)


def triton_experts(x: torch.Tensor, w13: Weights, w2: Weights, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
                   w2_scale: Optional[torch.Tensor] = None, config: Optional[MoeConfig] = None,
                   aligned: Optional[Aligned] = None, w13_bias: Optional[torch.Tensor] = None,
                   w2_bias: Optional[torch.Tensor] = None, swiglu: Optional[ClampedSwiGLU] = None) -> torch.Tensor:
    """The fused path on x's device, whatever it is (under TRITON_INTERPRET=1, the CPU too): x bf16 or fp16 with
    unit column stride; w13 and w2 of x's dtype (or FP8, with scales, or 4-bit); config: the launch rule's
    unless given (4-bit experts without activation order: up to PAIR_ROWS pairs, a row each, unless given);
    aligned: the pairs already aligned for the launch rule's block rows (route_and_align). Returns the
    sum over k, [T, H]. Biases and swiglu as experts_reference's. Raises RuntimeError where Triton is missing."""
    _check_shapes(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    int4 = isinstance(w13, PackedExperts)
    gemm, align = moe_gemm(), triton_align()
    if gemm is None or align is None:
        raise RuntimeError("the fused experts need Triton")
    t, h = x.shape
    num_experts, inter = (w13.num_experts, w2.k) if int4 or isinstance(w13, Mxfp4Experts) else \
        (w13.shape[0], w2.shape[2])
    top_k = topk_ids.shape[1]
    fp8 = w13_scale is not None
    n_pairs = t * top_k
    if n_pairs == 0:
        return x.new_zeros(t, h)
    by_pair = isinstance(w13, Mxfp4Experts) or (int4 and w13.perm is None and w2.perm is None and w13_bias is None
                                                 and swiglu is None)
    if by_pair and config is None and n_pairs <= PAIR_ROWS:
        return _experts_by_pair(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, swiglu)
    c = config or launch_config(n_pairs, w13, fp8)
    if aligned is None:
        aligned = align(topk_ids, num_experts, c.block_m)
    a, a_scale = quantize_tokens(x) if fp8 else (x, None)
    act = torch.empty(n_pairs, inter, dtype=x.dtype, device=x.device)
    gemm(a, a_scale, w13, w13_scale, act, None, aligned, top_k, True, c, w13_bias, swiglu)
    a, a_scale = quantize_tokens(act) if fp8 else (act, None)
    out = torch.empty(t, top_k, h, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    gemm(a, a_scale, w2, w2_scale, out.view(n_pairs, h), weights, aligned, 1, False, c, w2_bias)
    return out.view(t, h) if top_k == 1 else out.sum(dim=1)


def _experts_by_pair(x: torch.Tensor, w13: Union[PackedExperts, Mxfp4Experts], w2: Union[PackedExperts, Mxfp4Experts],
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_bias: Optional[torch.Tensor],
                     w2_bias: Optional[torch.Tensor], swiglu: Optional[ClampedSwiGLU]) -> torch.Tensor:
    """A decode step's few pairs, each a row of a kernel reading its own expert's weight: no alignment and no padded
    16-row blocks, whose tensor-core tiles cost a whole block's dequantisation per expert for one or two rows. MXFP4:
    kernels/mxfp4_pairs.py's kernel (biases, the activation and the routing weights in its epilogues); 4-bit
    integers: the dense 4-bit kernel's CUDA-cores path (kernels/w4a16_gemm.py), the activation between the two in
    torch. Both round the gate/up product to x's dtype before the activation, as experts_reference does."""
    t, top_k = topk_ids.shape
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    if isinstance(w13, Mxfp4Experts):
        gemv = mxfp4_pair_gemv()
        act = gemv(x, w13.blocks, w13.scales, ids, top_k, w13_bias, gated=True, swiglu=swiglu)
        y = gemv(act, w2.blocks, w2.scales, ids, 1, w2_bias, row_weights=topk_weights.reshape(-1).float())
        return y.view(t, top_k, -1).sum(dim=1)
    gemm = w4a16_gemm()
    gate, up = gemm(x, w13.qweight, w13.scales, w13.zeros, ids=ids, top_k=top_k).chunk(2, dim=-1)
    out = gemm(F.silu(gate) * up, w2.qweight, w2.scales, w2.zeros, ids=ids, top_k=1,
               row_weights=topk_weights.reshape(-1).float().contiguous())
    return out.view(t, top_k, -1).sum(dim=1)


def fused_runs(x: torch.Tensor, w13: Weights, fp8: bool) -> bool:
    """Whether fused_experts takes the fused path for these operands: CUDA, bf16/fp16 activations with unit column
    stride, weights of x's dtype, 4-bit, or FP8 on a GPU with FP8 dots (SM 8.9+), and Triton present."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.stride(-1) == 1):
        return False
    if not isinstance(w13, (PackedExperts, Mxfp4Experts)) and (
            torch.cuda.get_device_capability(x.device) < (8, 9) if fp8 else w13.dtype != x.dtype):
        return False
    return moe_gemm() is not None and triton_align() is not None


def fused_experts(x: torch.Tensor, w13: Weights, w2: Weights, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
                  w2_scale: Optional[torch.Tensor] = None, aligned: Optional[Aligned] = None,
                  w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None,
                  swiglu: Optional[ClampedSwiGLU] = None) -> torch.Tensor:
    """experts_reference's result, computed by the Triton kernels where they run (see fused_runs: CUDA with
    bf16/fp16 x; no host sync, so decode steps capture it in CUDA graphs), else by experts_reference (the CPU,
    float32 models, no Triton). aligned: route_and_align's, for the fused path."""
    extra = dict(w13_bias=w13_bias, w2_bias=w2_bias, swiglu=swiglu)
    if fused_runs(x, w13, w13_scale is not None):
        return triton_experts(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, aligned=aligned, **extra)
    return experts_reference(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, **extra)
