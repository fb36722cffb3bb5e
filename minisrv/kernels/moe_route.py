"""The router's top-k in one Triton launch: router logits [T, E] -> routing weights float32 [T, k] and expert ids
int32 [T, k], largest first, with or without renormalisation over the k (fused_moe.route's contract); and, for
decode batches of up to ROUTER_TOKENS tokens, the router's product, its top-k and the alignment in one launch
(`triton_router`).

Why: in torch ops this is a top-k (on CUDA a sort-based kernel for E = 128), a softmax and a cast to int32, each
its own launch; at decode, where a MoE layer's work is a few microseconds of weight reads per launch, those three
launches cost as much as a third of the experts' own time. Here one program takes BLOCK_T tokens' logits into
registers, finds the k largest by k rounds of max (ties to the lowest expert index), and writes the weights:
renormalised, the softmax of the k logits (equal to softmax -> top-k -> divide by the sum); otherwise the softmax
over all E at the k. No host sync, so decode steps capture it in CUDA graphs.

Why the router in one launch: at batch 1 the router's product (0.5 MB of weights at Qwen3-30B-A3B's shape), its
top-k and the alignment are three launches that each cost a launch's latency for almost no work. `triton_router`
spreads the product over (expert tile, K piece) programs; the last to finish (an arrival counter) routes and aligns
in registers. The kernels: moe_device.py.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, Optional, Tuple

import torch

from minisrv.kernels.moe_align import Aligned, aligned_buffers
from minisrv.kernels.triton_launcher import triton_launcher


@triton_launcher
def triton_route(triton: ModuleType, tl: ModuleType) -> Callable[..., Tuple[torch.Tensor, torch.Tensor]]:
    """The launcher `run(router_logits, top_k, renormalize)` -> (weights, ids), or None where Triton is missing."""
    from minisrv.kernels.moe_device import moe_route_topk

    def run(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        t, num_experts = router_logits.shape
        if router_logits.stride(1) != 1:
            router_logits = router_logits.contiguous()
        weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
        ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
        if t == 0:
            return weights, ids
        experts = triton.next_power_of_2(num_experts)
        block_t = max(1, min(16, 4096 // experts, triton.next_power_of_2(t)))
        moe_route_topk[(triton.cdiv(t, block_t),)](router_logits, weights, ids, t, num_experts, router_logits.stride(0),
                                                   TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=block_t,
                                                   EXPERTS=experts, K_POW2=triton.next_power_of_2(top_k), num_warps=4)
        return weights, ids

    return run


ROUTER_TOKENS = 16  # tokens up to which triton_router takes the step (the top-k's rows in one program)
ROUTER_PROGRAMS = 32  # (expert tile, K piece) programs the router's product aims for


@triton_launcher
def triton_router(triton: ModuleType, tl: ModuleType) -> Callable[..., Tuple[torch.Tensor, torch.Tensor, Aligned]]:
    """The launcher `run(x, router_weight, counter, top_k, renormalize, block_m, bias=None)` -> (weights, ids, Aligned):
    route() of x @ router_weight^T + bias (rounded to x's dtype, as the model's product is) and triton_align's output
    for those ids, for x [T <= ROUTER_TOKENS, H] bf16/fp16 with unit column stride, router_weight [E, H] of x's dtype,
    contiguous, and bias [E] or None. counter: int32 [1], zero, kept by the caller for its calls (each call leaves it
    zero; calls on one stream only). None where Triton is missing."""
    from minisrv.kernels.moe_device import moe_router

    def run(x: torch.Tensor, router_weight: torch.Tensor, counter: torch.Tensor, top_k: int, renormalize: bool,
            block_m: int, bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, Aligned]:
        t, hidden = x.shape
        num_experts = router_weight.shape[0]
        if not 0 < t <= ROUTER_TOKENS or x.stride(1) != 1 or not router_weight.is_contiguous() \
                or router_weight.shape[1] != hidden or router_weight.dtype != x.dtype:
            raise ValueError(f"router of x {tuple(x.shape)} (strides {x.stride()}), weight "
                             f"{tuple(router_weight.shape)} {router_weight.dtype}")
        block_e, block_k = 16, 128
        experts = max(block_e, triton.next_power_of_2(num_experts))
        tiles = experts // block_e
        pieces = max(1, min(ROUTER_PROGRAMS // tiles, triton.cdiv(hidden, block_k)))
        k_piece = triton.cdiv(triton.cdiv(hidden, pieces), block_k) * block_k
        pieces = triton.cdiv(hidden, k_piece)
        block_t = ROUTER_TOKENS  # the last program's rows (tl.dot's least, 16, too)
        dev = x.device
        partial = torch.empty(pieces * block_t * experts, dtype=torch.float32, device=dev)
        weights = torch.empty(t, top_k, dtype=torch.float32, device=dev)
        ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
        out = aligned_buffers(t * top_k, num_experts, block_m, dev)
        moe_router[(tiles * pieces,)](x, router_weight, bias if bias is not None else x, partial, counter, weights,
                                      ids, *out, t, hidden, num_experts, x.stride(0), out.expert_ids.numel(), k_piece,
                                      HAS_BIAS=bias is not None, ROUND_BF16=x.dtype == torch.bfloat16, TOP_K=top_k,
                                      RENORMALIZE=renormalize, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k,
                                      EXPERTS=experts, K_POW2=triton.next_power_of_2(top_k), K_PIECES=pieces,
                                      BLOCK_M=block_m, BLOCKS=64, PAIRS=max(16, triton.next_power_of_2(t * top_k)),
                                      num_warps=4)
        return weights, ids, out

    return run
