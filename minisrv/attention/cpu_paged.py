"""The torch backend's CPU paths: decode that reads K/V in place in the paged pool, prompts packed without padding.

Decode: one query per request (and a verify step's few queries per request, each as a decode row); the C kernel
(kernels/cpu_attention.py) follows each request's row of the request->token table inside the attention, so no
request's KV is copied out of the pool and nothing is padded. Its metadata (kernels/cpu_decode.DecodeMeta) carries
the pool's views, so a model can run the step's layers in one call.
Extend (prompts, chunks, prompts on a cached prefix): each sequence on its own through torch's SDPA, which on the
CPU runs its flash kernel; a sequence with no cached prefix attends to the step's own K/V (no pool read at all),
one with a prefix to its K/V gathered from the pool under a causal mask aligned to its last position. The GQA
group is a stride-0 view of K/V (SDPA's `enable_gqa` takes its slower math path on the CPU). Layers with a sliding
window get their own mask (planned once per step for each window the model has); soft-capped scores and sinks, which
SDPA does not take, are computed in torch (`attend`).

These paths serve float32/bfloat16/float16 pools; an FP8 pool, or a decode without the compiled kernel, keeps the
padded path of torch_native.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from minisrv.batch import ForwardBatch
from minisrv.kernels.cpu_attention import PagedDecodeKernel
from minisrv.kernels.cpu_decode import DecodeMeta
from minisrv.models.attention_options import LayerAttention

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedSeq:
    start: int  # first row of the sequence in the step's tokens
    length: int  # its query tokens
    slots: Optional[torch.Tensor]  # [kv_len] its keys' slots when it extends a cached prefix; None without one
    # window -> [length, kv_len] bool, True where a query sees a key; None: causal over the step's own keys
    masks: Dict[Optional[int], Optional[torch.Tensor]]


@dataclass(frozen=True)
class PackedMeta:
    loc: torch.Tensor  # [T] slots this step's k/v go to
    seqs: Tuple[PackedSeq, ...]


class CpuPagedAttention:
    """Plans and runs the CPU paths for one backend's pool; `prepare` returns None for a step they do not serve."""

    def __init__(self, pool, num_q_heads: int, layers: Sequence[LayerAttention],
                 kernel: Optional[PagedDecodeKernel]) -> None:
        self.pool = pool
        self.num_q_heads = num_q_heads
        self.layers = layers
        self.windows = sorted({a.window for a in layers}, key=lambda w: w or 0)
        # what a decode step's layers in one call read (a model whose layers all have the same window only)
        self.decode_options = (layers[0].scale, layers[0].window or 0)
        self.kernel = kernel
        self.sinks = [a.sinks_tensor(torch.device("cpu")) for a in layers]  # each layer's, [Hq] float32 or None
        layers = range(len(pool.k))  # the pool's per-layer [slots, Hkv, D] views, which decode steps read
        self.flat_k, self.flat_v = [pool.flat_k(i) for i in layers], [pool.flat_v(i) for i in layers]

    @staticmethod
    def create(pool, num_q_heads: int, layers: Sequence[LayerAttention]) -> Optional["CpuPagedAttention"]:
        """The CPU paths over this pool, or None where the pool is FP8 (the padded path dequantises as it reads)."""
        if pool.quantized:
            return None
        kernel = None
        if PagedDecodeKernel.supports(pool.dtype, pool.kv_dtype, num_q_heads, pool.num_kv_heads):
            kernel, how = PagedDecodeKernel.load()
            if kernel is None:
                logger.warning("CPU decode attention: the paged kernel could not be built (%s); using the padded "
                               "torch path", how)
            else:
                logger.info("CPU decode attention: paged kernel in place (%s)", how)
        else:
            logger.info("CPU decode attention: padded torch path (the paged kernel takes float32 pools; this one "
                        "is %s)", pool.kv_dtype)
        return CpuPagedAttention(pool, num_q_heads, layers, kernel)

    def prepare(self, b: ForwardBatch, table: torch.Tensor, loc: torch.Tensor):
        """The step's plan over `table` (the request->token table of the layers it serves), storing at `loc`."""
        if b.is_decode:
            if self.kernel is None or b.prefix_groups is not None:
                return None
            return DecodeMeta(loc, b.req_rows.long(), b.seq_lens.to(torch.int32), self.flat_k,
                              self.flat_v, table, *self.decode_options)
        if b.verify and self.kernel is not None:
            return self._verify_meta(b, table, loc)
        seqs, start = [], 0
        for row, ext, seq_len in zip(b.req_rows.tolist(), b.extend_lens_cpu, b.seq_lens_cpu):
            # on a cached prefix its keys come from the pool
            slots = table[row, :seq_len].long() if seq_len > ext else None
            masks = {w: None if slots is None and (w is None or ext <= w) else window_mask(seq_len, ext, w)
                     for w in self.windows}
            seqs.append(PackedSeq(start, ext, slots, masks))
            start += ext
        return PackedMeta(loc, tuple(seqs))

    def _verify_meta(self, b: ForwardBatch, table: torch.Tensor, loc: torch.Tensor) -> DecodeMeta:
        """A verify step as decode rows, one a token: query j of a request whose step ends at length s is a decode query
        of its table row over s - n + j + 1 keys (all the step's K/V are stored before any is read), so the few queries
        read K/V in place as decode does, and a model whose decode layers run in one call runs these too."""
        ext = b.extend_lens_cpu
        rows = torch.repeat_interleave(b.req_rows.long(), torch.tensor(ext))
        kv_lens = torch.tensor([s - n + j + 1 for s, n in zip(b.seq_lens_cpu, ext) for j in range(n)],
                               dtype=torch.int32)
        return DecodeMeta(loc, rows, kv_lens, self.flat_k, self.flat_v, table, *self.decode_options)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, meta) -> torch.Tensor:
        self.pool.store(layer_id, meta.loc, k, v)
        opts = self.layers[layer_id]
        if isinstance(meta, DecodeMeta):
            return self.kernel(q, meta.k[layer_id], meta.v[layer_id], meta.req_to_token, meta.rows, meta.kv_lens,
                               opts.scale, opts.window or 0, opts.softcap or 0.0, self.sinks[layer_id])
        out = torch.empty(q.shape, dtype=q.dtype)
        hkv = self.pool.num_kv_heads
        g = self.num_q_heads // hkv
        sinks = self.sinks[layer_id]
        sinks = sinks.view(hkv, g, 1, 1) if sinks is not None else None
        for s in meta.seqs:
            end = s.start + s.length
            if s.slots is None:
                kk, vv = k[s.start:end], v[s.start:end]
            else:
                kk, vv = self.pool.load(layer_id, s.slots)
            # [Hkv, G, n, D] queries over [Hkv, G (stride 0), L, D] keys: the group shares its KV head's rows
            qs = q[s.start:end].transpose(0, 1).unflatten(0, (hkv, g))
            ks = kk.transpose(0, 1)[:, None].expand(hkv, g, kk.shape[0], kk.shape[2])
            vs = vv.transpose(0, 1)[:, None].expand(hkv, g, vv.shape[0], vv.shape[2])
            o = attend(qs, ks, vs, s.masks[opts.window], opts, sinks)
            out[s.start:end] = o.flatten(0, 1).transpose(0, 1)
        return out


def window_mask(seq_len: int, ext: int, window: Optional[int], device: Optional[torch.device] = None) -> torch.Tensor:
    """[ext, seq_len] bool: the last `ext` of `seq_len` positions as queries, True where one sees a key (causal, and
    within its window)."""
    q_pos = torch.arange(seq_len - ext, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
           opts: LayerAttention, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q k^T * scale, soft-capped, under `mask`) v over [..., L, D] (mask None: causal from the bottom
    right); SDPA where there is neither a soft-cap nor sinks, else in float32 in torch. sinks: float32, the scores'
    shape but for their last dim ([..., Lq, 1]): each row's sink logit, in its softmax's denominator only."""
    if opts.softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=opts.scale)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * opts.scale
    if opts.softcap is not None:
        s = torch.tanh(s / opts.softcap) * opts.softcap
    if mask is None:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(s.shape[-1] - s.shape[-2])
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # the sink as one more column of the softmax, dropped after it
        s = torch.cat([s, sinks.expand(*s.shape[:-1], 1)], dim=-1)
    p = s.softmax(-1)
    return torch.matmul(p[..., :v.shape[-2]] if sinks is not None else p, v.float()).to(v.dtype)
