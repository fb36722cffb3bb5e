"""A stand-in for FlashAttention-3's `flash_attn_with_kvcache` (the fa backend's one kernel call), in float64 torch,
so that the backend's page tables, lengths and per-layer options run and are checked on a CPU.

The signature is the FA3 build's (flash_attn_interface, keyword names included): a misnamed argument fails here as
it would there. Semantics as FA3 documents them: pages [num_pages, page_size, Hkv, D]; request b's keys are the
first cache_seqlens[b] of its pages page_table[b] in order; q is [B, Sq, Hq, D], or ragged [T, Hq, D] with
cu_seqlens_q; `causal` aligns a request's queries to the bottom right (query j of Sq sees keys up to L - Sq + j),
window_size (left, 0) also hides keys more than `left` before it; `sinks` (bfloat16 [Hq]) joins each row's softmax
denominator as one more logit with no value. It also checks what the backend promises the kernel: int32 lengths and
page tables on the pool's device, and a bfloat16 sink per query head (FA3's
check: "sinks must have dtype bfloat16").
"""
from __future__ import annotations

from typing import Optional

import torch


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window_left: int,
            sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """q [n, Hq, D] causal from the bottom right against k/v [L, Hkv, D], in float64."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    assert n <= length, "a causal query block longer than its keys"
    g = hq // hkv
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, dim=1)) * scale
    pos = (length - n + torch.arange(n))[:, None]
    keys = torch.arange(length)[None, :]
    hidden = (keys > pos) | ((keys < pos - window_left) if window_left >= 0 else torch.zeros_like(keys > pos))
    s = s.masked_fill(hidden[None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(hq, n, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :length]
    return torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(g, dim=1))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False, sinks=None):
    assert k is None and v is None and qv is None and rotary_cos is None and cache_batch_idx is None
    assert causal and softcap == 0.0 and window_size[1] in (-1, 0) and q_descale is None and k_descale is None
    device = k_cache.device
    for name, t in (("cache_seqlens", cache_seqlens), ("page_table", page_table), ("cu_seqlens_q", cu_seqlens_q)):
        assert t is None or (t.dtype == torch.int32 and t.device == device), f"{name}: int32 on {device} expected"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    hq, d = q.shape[-2:]
    if sinks is not None:
        assert sinks.dtype == torch.bfloat16 and tuple(sinks.shape) == (hq,), "sinks: bfloat16 [Hq]"
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    page_size = k_cache.shape[1]
    lens = cache_seqlens.tolist()
    if cu_seqlens_q is None:  # [B, Sq, Hq, D]
        assert q.dim() == 4 and q.shape[0] == len(lens)
        blocks = [q[b] for b in range(q.shape[0])]
    else:
        cu = cu_seqlens_q.tolist()
        assert q.dim() == 3 and len(cu) == len(lens) + 1 and cu[-1] == q.shape[0]
        assert max_seqlen_q >= max(b - a for a, b in zip(cu, cu[1:]))
        blocks = [q[a:b] for a, b in zip(cu, cu[1:])]
    outs = []
    for b, (block, length) in enumerate(zip(blocks, lens)):
        pages = page_table[b, :-(-length // page_size)].long()
        assert int(pages.min()) >= 0 and int(pages.max()) < k_cache.shape[0], "page id outside the pool"
        kk = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:length]
        vv = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:length]
        outs.append(_attend(block, kk, vv, scale, window_size[0], sinks).to(q.dtype))
    return torch.stack(outs) if cu_seqlens_q is None else torch.cat(outs)
