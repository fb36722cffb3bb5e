"""The router's top-k in one Triton launch: router logits [T, E] -> routing weights float32 [T, k] and expert ids
int32 [T, k], largest first, with or without renormalisation over the k (fused_moe.route's contract).

Why: in torch ops this is a top-k (on CUDA a sort-based kernel for E = 128), a softmax and a cast to int32, each
its own launch; at decode, where a MoE layer's work is a few microseconds of weight reads per launch, those three
launches cost as much as a third of the experts' own time. Here one program takes BLOCK_T tokens' logits into
registers, finds the k largest by k rounds of max (ties to the lowest expert index), and writes the weights:
renormalised, the softmax of the k logits (equal to softmax -> top-k -> divide by the sum); otherwise the softmax
over all E at the k. No host sync, so decode steps capture it in CUDA graphs.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch


@functools.lru_cache(maxsize=None)
def triton_route() -> Optional[Callable[..., Tuple[torch.Tensor, torch.Tensor]]]:
    """The launcher `run(router_logits, top_k, renormalize)` -> (weights, ids), or None where Triton is missing."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - any import failure means "not present"
        return None

    @triton.jit
    def moe_route_topk(logits_ptr, weights_ptr, ids_ptr, n_tokens, num_experts, stride_t, TOP_K: tl.constexpr,
                       RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, EXPERTS: tl.constexpr, K_POW2: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        experts = tl.arange(0, EXPERTS)
        row_ok = rows < n_tokens
        x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_t + experts[None, :],
                    mask=row_ok[:, None] & (experts < num_experts)[None, :], other=float("-inf")).to(tl.float32)
        x = tl.where(x == x, x, float("-inf"))  # a NaN logit is never chosen over a number, and never matches best
        top = tl.max(x, axis=1)
        slots = tl.arange(0, K_POW2)
        chosen = tl.zeros((BLOCK_T, K_POW2), dtype=tl.int32)
        exps = tl.zeros((BLOCK_T, K_POW2), dtype=tl.float32)
        if RENORMALIZE:
            denom = tl.zeros((BLOCK_T,), dtype=tl.float32)
        else:
            denom = tl.sum(tl.exp(x - top[:, None]), axis=1)
        for j in tl.static_range(TOP_K):
            best = tl.max(x, axis=1)
            # ties to the lowest index; kept in range even for a row of -inf (then expert 0 is repeated)
            index = tl.minimum(tl.min(tl.where(x == best[:, None], experts[None, :], EXPERTS), axis=1),
                               num_experts - 1)
            e = tl.exp(best - top)
            if RENORMALIZE:
                denom += e
            chosen = tl.where(slots[None, :] == j, index[:, None], chosen)
            exps = tl.where(slots[None, :] == j, e[:, None], exps)
            x = tl.where(experts[None, :] == index[:, None], float("-inf"), x)
        out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
        ok = row_ok[:, None] & (slots < TOP_K)[None, :]
        tl.store(weights_ptr + out, exps / denom[:, None], mask=ok)
        tl.store(ids_ptr + out, chosen, mask=ok)

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
