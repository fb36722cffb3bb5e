"""A stand-in for the three FlashInfer 0.6.13 APIs the fi backend calls, in plain torch, so that the backend's
planning (indptrs, page ids, last-page lengths, cascade order and merge) runs and is checked on a CPU.

Signatures are FlashInfer 0.6.13's (flashinfer/prefill.py, decode.py, cascade.py), keyword names included, so a
misnamed argument fails here as it would there; options the backend never uses must keep their defaults. Beyond
computing attention it checks what the backend promises itself: indptrs and last-page lengths are int32 host
tensors (a device tensor would make FlashInfer's plan synchronise), page ids are int32 on the pool's device, every
request has at least one key (FlashInfer leaves attention over no keys undefined), and q matches the plan. The
semantics are FlashInfer's: NHD pages [num_pages, page_size, Hkv, D]; request i's keys are its pages in order, all
full but the last, which holds last_page_len[i]; q head h reads kv head h // (Hq / Hkv); a causal query j of qo_len
sees keys up to kv_len - qo_len + j (and, with window_left >= 0, from window_left keys before it: a decode query
is the last position); logits_soft_cap c turns each scaled score s into c * tanh(s / c); log-sum-exps are base 2,
and merge_state_in_place combines two partial results of disjoint key sets exactly. A decode wrapper in CUDA-graph
mode checks and copies its plan into the fixed buffers it was made with, as FlashInfer's does, and runs on what
those buffers hold when it runs (as a replayed graph's kernel would).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

__version__ = "0.6.13-fake"

LN2 = math.log(2.0)


def _host_i32(t: torch.Tensor, what: str) -> torch.Tensor:
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int32 and t.device.type == "cpu", \
        f"{what} must be an int32 host tensor, got {getattr(t, 'dtype', type(t))} on {getattr(t, 'device', '?')}"
    return t


class _Paged:
    """A planned paged KV layout: per request its page ids and key count."""

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int,
                 device: torch.device) -> None:
        _host_i32(indptr, "paged_kv_indptr")
        _host_i32(last_page_len, "paged_kv_last_page_len")
        assert indices.dtype == torch.int32 and indices.device == device, \
            f"paged_kv_indices must be int32 on {device}, got {indices.dtype} on {indices.device}"
        ptr = indptr.tolist()
        last = last_page_len.tolist()
        assert len(ptr) == len(last) + 1 and ptr[0] == 0 and ptr[-1] == indices.numel(), \
            f"indptr {ptr} does not fit {len(last)} requests and {indices.numel()} page ids"
        self.pages, self.kv_lens = [], []
        for i, n in enumerate(last):
            count = ptr[i + 1] - ptr[i]
            assert count >= 1, f"request {i} has no pages (attention over no keys is undefined)"
            assert 1 <= n <= page_size, f"request {i}: last page length {n} outside [1, {page_size}]"
            self.pages.append(indices[ptr[i]:ptr[i + 1]].long())
            self.kv_lens.append((count - 1) * page_size + n)
        self.page_size = page_size

    def keys(self, i: int, cache: torch.Tensor) -> torch.Tensor:
        """Request i's keys (or values) [kv_len, Hkv, D] from one NHD cache [num_pages, page_size, Hkv, D]."""
        pages = self.pages[i]
        assert int(pages.max()) < cache.shape[0] and int(pages.min()) >= 0, "page id outside the pool"
        return cache[pages].reshape(-1, *cache.shape[2:])[:self.kv_lens[i]]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, window_left: int = -1,
            soft_cap=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [n, Hq, D] against k/v [L, Hkv, D] in float64: output [n, Hq, D] and base-2 log-sum-exp [n, Hq]."""
    n, hq, _ = q.shape
    length, hkv, _ = k.shape
    g = hq // hkv
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale  # [Hq, n, L]
    if soft_cap:
        s = torch.tanh(s / soft_cap) * soft_cap
    q_pos = (length - n + torch.arange(n))[:, None]
    if causal:
        assert n <= length, "a causal query block longer than its keys"
        s = s.masked_fill(~(torch.arange(length)[None, :] <= q_pos)[None], float("-inf"))
    if window_left >= 0:
        s = s.masked_fill((torch.arange(length)[None, :] < q_pos - window_left)[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # natural log, [Hq, n]
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vv)
    return out, (lse / LN2).transpose(0, 1)


def _check_cache(paged_kv_cache, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype):
    assert isinstance(paged_kv_cache, tuple) and len(paged_kv_cache) == 2, "the backend passes (k_cache, v_cache)"
    k, v = paged_kv_cache
    for c in (k, v):
        assert c.dim() == 4 and tuple(c.shape[1:]) == (page_size, num_kv_heads, head_dim), \
            f"NHD cache [pages, {page_size}, {num_kv_heads}, {head_dim}] expected, got {tuple(c.shape)}"
        assert c.dtype == dtype, f"kv dtype {c.dtype}, planned {dtype}"
    return k, v


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto",
                 jit_args=None, jit_kwargs=None) -> None:
        assert kv_layout == "NHD" and not use_cuda_graph and backend == "auto" and jit_args is None
        self.device = float_workspace_buffer.device
        self.plans = 0
        self._plan = None

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, page_size: int, head_dim_vo=None, custom_mask=None,
             packed_custom_mask=None, causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, sm_scale=None, window_left: int = -1, logits_soft_cap=None,
             rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking: bool = True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len: int = 0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None,
             block_tables=None, max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None,
             disable_split_kv: bool = False) -> None:
        assert pos_encoding_mode == "NONE" and (window_left == -1 or causal) and logits_soft_cap != 0
        assert custom_mask is None and packed_custom_mask is None and head_dim_vo in (None, head_dim_qk)
        assert isinstance(q_data_type, torch.dtype) and kv_data_type in (None, q_data_type)
        assert num_qo_heads % num_kv_heads == 0
        qo = _host_i32(qo_indptr, "qo_indptr").tolist()
        paged = _Paged(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size, self.device)
        assert len(qo) == len(paged.kv_lens) + 1 and qo[0] == 0
        for i, n in enumerate(paged.kv_lens):
            assert qo[i + 1] >= qo[i], "qo_indptr decreases"
            assert not causal or qo[i + 1] - qo[i] <= n, "a causal query block longer than its keys"
        self._plan = (qo, paged, num_qo_heads, num_kv_heads, head_dim_qk, causal,
                      head_dim_qk ** -0.5 if sm_scale is None else sm_scale, q_data_type, window_left, logits_soft_cap)
        self.plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor=None):
        assert not args and out is None and lse is None and sinks is None and kv_cache_sf is None
        qo, paged, hq, hkv, d, causal, scale, dtype, window_left, soft_cap = self._plan
        assert q.shape == (qo[-1], hq, d) and q.dtype == dtype, \
            f"q {tuple(q.shape)} {q.dtype} does not match the plan ({qo[-1]}, {hq}, {d}) {dtype}"
        k_cache, v_cache = _check_cache(paged_kv_cache, hkv, d, paged.page_size, dtype)
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        s = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for i in range(len(paged.kv_lens)):
            if qo[i + 1] == qo[i]:
                continue
            oi, si = _attend(q[qo[i]:qo[i + 1]], paged.keys(i, k_cache), paged.keys(i, v_cache), scale, causal,
                             window_left, soft_cap)
            o[qo[i]:qo[i + 1]] = oi.to(q.dtype)
            s[qo[i]:qo[i + 1]] = si.float()
        return (o, s) if return_lse else o


class BatchDecodeWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto", jit_args=None) -> None:
        assert kv_layout == "NHD" and backend == "auto" and jit_args is None
        self.device = float_workspace_buffer.device
        self.plans = 0
        self._plan = None
        self._graph_buffers = None
        if use_cuda_graph:  # bound to fixed buffers, which plan rewrites and run reads (as a captured kernel does)
            bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            assert all(isinstance(b, torch.Tensor) and b.dtype == torch.int32 and b.device == self.device
                       for b in bufs), "CUDA-graph mode needs int32 index buffers on the workspace's device"
            self._graph_buffers = bufs
            self._fixed_batch_size = len(paged_kv_indptr_buffer) - 1

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None,
             rope_scale=None, rope_theta=None, non_blocking: bool = True, block_tables=None, seq_lens=None,
             fixed_split_size=None, disable_split_kv: bool = False, q_len_per_req: int = 1) -> None:
        assert pos_encoding_mode == "NONE" and logits_soft_cap != 0 and q_len_per_req == 1
        assert isinstance(q_data_type, torch.dtype) and kv_data_type in (None, q_data_type) and data_type is None
        assert num_qo_heads % num_kv_heads == 0
        paged = _Paged(indptr, indices, last_page_len, page_size, self.device)
        if self._graph_buffers is not None:  # FlashInfer's checks and copies in CUDA-graph mode
            indptr_buf, indices_buf, last_buf = self._graph_buffers
            if len(last_page_len) != self._fixed_batch_size:
                raise ValueError(f"The batch size should be fixed in cudagraph mode, the runtime batch size "
                                 f"{len(last_page_len)}  mismatches the batch size set during initialization "
                                 f"{self._fixed_batch_size}")
            if len(indices) > len(indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            indptr_buf.copy_(indptr)
            last_buf.copy_(last_page_len)
            indices_buf[:len(indices)].copy_(indices)
            paged = page_size  # run reads the buffers as they are by then
        self._plan = (paged, num_qo_heads, num_kv_heads, head_dim,
                      head_dim ** -0.5 if sm_scale is None else sm_scale, q_data_type, window_left, logits_soft_cap)
        self.plans += 1

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
            lse=None, return_lse: bool = False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        assert not args and out is None and lse is None and sinks is None and q_len_per_req is None
        paged, hq, hkv, d, scale, dtype, window_left, soft_cap = self._plan
        if self._graph_buffers is not None:
            indptr_buf, indices_buf, last_buf = self._graph_buffers
            indptr = indptr_buf.cpu()
            paged = _Paged(indptr, indices_buf[:int(indptr[-1])], last_buf.cpu(), paged, self.device)
        bs = len(paged.kv_lens)
        assert q.shape == (bs, hq, d) and q.dtype == dtype, \
            f"q {tuple(q.shape)} {q.dtype} does not match the plan ({bs}, {hq}, {d}) {dtype}"
        k_cache, v_cache = _check_cache(paged_kv_cache, hkv, d, paged.page_size, dtype)
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        s = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for i in range(bs):
            oi, si = _attend(q[i:i + 1], paged.keys(i, k_cache), paged.keys(i, v_cache), scale, False, window_left,
                             soft_cap)
            o[i] = oi[0].to(q.dtype)
            s[i] = si[0].float()
        return (o, s) if return_lse else o


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask: Optional[torch.Tensor] = None) -> None:
    """(v, s) <- the attention state over the union of the two key sets; s are base-2 log-sum-exps [n, H]."""
    assert mask is None
    assert v.shape == v_other.shape and s.shape == s_other.shape == v.shape[:2]
    assert s.dtype == s_other.dtype == torch.float32 and v.dtype == v_other.dtype
    assert v.is_contiguous() and s.is_contiguous() and v_other.is_contiguous() and s_other.is_contiguous()
    m = torch.maximum(s, s_other).double()
    w, w_other = torch.exp2(s.double() - m), torch.exp2(s_other.double() - m)
    total = w + w_other
    merged = (v.double() * w[..., None] + v_other.double() * w_other[..., None]) / total[..., None]
    v.copy_(merged.to(v.dtype))
    s.copy_((m + torch.log2(total)).float())
