"""Decode attention over the paged KV pool in Triton: one query token a request against its cached keys and values.

Why: at decode a step's attention is a read of every running request's K and V. FlashInfer's decode plans each step
on the host and at short contexts spends most of its time outside the bytes (docs/kernels.md). This kernel needs
no plan: its inputs are the page table and the lengths (the form FA3 and XQA take), so it is captured in CUDA graphs
as it is.

The work: program (request b, KV head h, piece s) takes the query heads of h's group (GQA: Hq / Hkv rows, padded to
a tensor-core tile), walks its share of b's tokens TILE at a time (each token's slot from the page table), and keeps
an online softmax in float32. A request is cut into at most `splits` pieces of at least MIN_CHUNK tokens, so a long
request in a small batch still spreads over the SMs while short ones stay whole. A request in one piece writes its
output directly; pieces write their normalised partial outputs and log-sum-exps, and a second launch merges them
(`splits` is fixed per launch, from the batch size, so the grid depends on the batch size alone).

FP8 pools: K and V are read in e4m3 and widened to q's dtype; K's scale is folded into the softmax scale, V's
multiplies the output. `reference` is the same computation in torch (float32 softmax), for the tests.
"""
from __future__ import annotations

from types import ModuleType
from typing import Callable, Optional

import torch

from minisrv.kernels.triton_launcher import triton_launcher

MIN_CHUNK = 128  # fewest tokens a piece takes: shorter requests are not split
TILE = 64  # tokens a loop step reads
TARGET_PROGRAMS = 132  # programs a launch aims for (one per SM of an H100) when choosing the splits
MAX_SPLITS = 32


def takes_head_dim(head_dim: int) -> bool:
    """Whether the kernel's tiles fit this head size: a power of two of at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def splits_for(batch_size: int, num_kv_heads: int) -> int:
    """Pieces a request may be cut into at this batch size: enough (request, head, piece) programs to fill the GPU
    where every request is long, a power of two, 1 where the batch alone fills it."""
    want = -(-TARGET_PROGRAMS // max(1, batch_size * num_kv_heads))
    splits = 1
    while splits < want and splits < MAX_SPLITS:
        splits *= 2
    return splits


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
              seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q [B, Hq, D]; k_cache/v_cache [num_pages, page_size, Hkv, D]; page_table [B, max_pages] int32; seq_lens [B].
    Each request attends to its first seq_lens[b] tokens; float32 softmax, q's dtype out."""
    b, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for i in range(b):
        n = int(seq_lens[i])
        pos = torch.arange(n, device=q.device)
        slots = page_table[i, pos // page_size].long() * page_size + pos % page_size
        k = k_cache.reshape(-1, hkv, d)[slots].float() * k_scale  # [n, Hkv, D]
        v = v_cache.reshape(-1, hkv, d)[slots].float() * v_scale
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out


@triton_launcher
def triton_decode_attention(triton: ModuleType, tl: ModuleType) -> Callable[..., torch.Tensor]:
    """The launcher `run(q, k_cache, v_cache, page_table, seq_lens, scale, k_scale=1.0, v_scale=1.0, splits=None,
    out=None, min_chunk=MIN_CHUNK, tile=TILE, num_warps=4, num_stages=3)` -> out [B, Hq, D] (reference's contract;
    splits: splits_for's unless given; out: a tensor to write, else a new one; min_chunk a multiple of tile; the rest:
    the launch, for bench_attention's sweeps), or None where Triton is missing.
    q's last dimension contiguous; the caches' layout [num_pages, page_size, Hkv, D] with D contiguous; D a power of
    two of at least 16."""

    @triton.jit
    def decode_attention_pieces(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr, qk_scale, v_scale,
                                stride_qb, stride_qh, stride_kpage, stride_ktok, stride_khead, stride_table, stride_ob,
                                stride_oh, GROUP: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                                TILE: tl.constexpr, SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr):
        """Program (b, h, s): piece s of request b against KV head h. qk_scale holds log2(e), so the softmax runs in
        base 2. Outputs: a whole request straight to out; a piece to part [B, Hq, SPLITS, D] (normalised) and lse
        [B, Hq, SPLITS] (base 2)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        n = tl.load(lens_ptr + b)
        chunk = tl.maximum(tl.cdiv(tl.cdiv(n, SPLITS), TILE) * TILE, MIN_CHUNK)  # tokens a piece takes
        start = s * chunk
        if start >= n:
            return
        end = tl.minimum(start + chunk, n)
        rows = tl.arange(0, ROWS)
        row_ok = rows < GROUP
        heads = h * GROUP + rows
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        l = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, D], dtype=tl.float32)
        table = table_ptr + b.to(tl.int64) * stride_table
        for t0 in range(start, end, TILE):
            pos = t0 + tl.arange(0, TILE)
            ok = pos < end
            page = tl.load(table + pos // PAGE, mask=ok, other=0).to(tl.int64)
            offs = page * stride_kpage + (pos % PAGE) * stride_ktok + h * stride_khead
            k = tl.load(k_ptr + offs[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
            scores = tl.dot(q, tl.trans(k)) * qk_scale
            scores = tl.where(ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offs[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
            m = m_new
        acc = acc / l[:, None]
        if chunk >= n:
            o = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
            tl.store(o, (acc * v_scale).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            piece = (b * (GROUP * tl.num_programs(1)) + heads) * SPLITS + s  # [ROWS] rows of part / lse
            tl.store(part_ptr + piece[:, None].to(tl.int64) * D + d[None, :], acc, mask=row_ok[:, None])
            tl.store(lse_ptr + piece, m + tl.log2(l), mask=row_ok)

    @triton.jit
    def decode_attention_merge(part_ptr, lse_ptr, lens_ptr, out_ptr, v_scale, stride_ob, stride_oh, D: tl.constexpr,
                               TILE: tl.constexpr, SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr):
        """Program (b, query head): the pieces of a split request merged by their log-sum-exps; requests in one
        piece were written by decode_attention_pieces and are left alone."""
        b = tl.program_id(0)
        head = tl.program_id(1)
        n = tl.load(lens_ptr + b)
        chunk = tl.maximum(tl.cdiv(tl.cdiv(n, SPLITS), TILE) * TILE, MIN_CHUNK)  # as decode_attention_pieces's
        if chunk >= n:
            return
        pieces = tl.arange(0, SPLITS)
        ok = pieces < tl.cdiv(n, chunk)
        row = (b * tl.num_programs(1) + head) * SPLITS
        lse = tl.load(lse_ptr + row + pieces, mask=ok, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))
        d = tl.arange(0, D)
        part = tl.load(part_ptr + (row + pieces).to(tl.int64)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        o = tl.sum(part * w[:, None], 0) / tl.sum(w, 0) * v_scale
        tl.store(out_ptr + b * stride_ob + head * stride_oh + d, o.to(out_ptr.dtype.element_ty))

    def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
            seq_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
            splits: Optional[int] = None, out: Optional[torch.Tensor] = None,
            min_chunk: int = MIN_CHUNK, tile: int = TILE, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
        bs, hq, d = q.shape
        page_size, hkv = k_cache.shape[1], k_cache.shape[2]
        if (hq % hkv or not takes_head_dim(d) or q.stride(2) != 1 or k_cache.stride(3) != 1
                or k_cache.stride() != v_cache.stride() or tuple(k_cache.shape[2:]) != (hkv, d)):
            raise ValueError(f"decode attention: q {tuple(q.shape)} (strides {q.stride()}), caches "
                             f"{tuple(k_cache.shape)} (strides {k_cache.stride()})")
        splits = splits or splits_for(bs, hkv)
        group = hq // hkv
        if out is None:
            out = torch.empty((bs, hq, d), dtype=q.dtype, device=q.device)
        if splits > 1:
            part = torch.empty((bs * hq * splits, d), dtype=torch.float32, device=q.device)
            lse = torch.empty((bs * hq * splits,), dtype=torch.float32, device=q.device)
        else:  # no request is split: the piece outputs are never written
            part = lse = out
        consts = dict(TILE=tile, SPLITS=splits, MIN_CHUNK=min_chunk)
        decode_attention_pieces[(bs, hkv, splits)](
            q, k_cache, v_cache, page_table, seq_lens, out, part, lse, scale * k_scale * 1.4426950408889634,
            v_scale, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            page_table.stride(0), out.stride(0), out.stride(1), GROUP=group,
            ROWS=max(16, triton.next_power_of_2(group)), D=d, PAGE=page_size, num_warps=num_warps,
            num_stages=num_stages, **consts)
        if splits > 1:
            decode_attention_merge[(bs, hq)](part, lse, seq_lens, out, v_scale, out.stride(0), out.stride(1), D=d,
                                             num_warps=4, **consts)
        return out

    return run
