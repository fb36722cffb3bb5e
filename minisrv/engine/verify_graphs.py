"""CUDA graphs for verify steps (engine/speculative/): captured once per batch size at one query length q (the
request's last token and q - 1 drafts), replayed with the batch padded up, as decode graphs are (cuda_graph.py).

A verify step's requests may bring shorter drafts than q - 1: each request's tokens take the first rows of its q
rows, and the rows past them are padding whose K/V go to the pad slot and whose logits are dropped. Its length for
attention is then its prefix + q, so that FA3's bottom-right causal alignment still lets real query j see exactly
keys 0..prefix + j; the padding queries read past the request's end through its table row (stale but valid
pages), and what they compute is discarded. With an EAGLE-3 head (`read_aux`), the graphs also give the target
layers' inputs the head reads ([T, 3 x hidden]: models/llama.py's DecoderLayers).
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch

from minisrv.attention.base import AttentionBackend, AttentionStep
from minisrv.attention.page_table import StaticPageTable
from minisrv.batch import ForwardBatch
from minisrv.utils import to_device


class VerifyGraphs:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, req_to_token: torch.Tensor,
                 pad_slot: int, sizes: List[int], q_len: int, max_seq_len: int, device: torch.device,
                 read_aux: bool = False) -> None:
        """backend: the one whose verify_meta the graphs run (AttentionBackend.verify_backend)."""
        self.model, self.backend, self.req_to_token, self.read_aux = model, backend, req_to_token, read_aux
        self.pad_slot, self.sizes, self.q_len = pad_slot, sizes, q_len
        self.max_bs, self.max_seq_len = sizes[-1], max_seq_len
        n = self.max_bs * q_len
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.out_cache_loc = torch.full((n,), pad_slot, **i64)
        self.static = StaticPageTable(self.max_bs, max_seq_len, backend.page_size, device)
        self.static.seq_lens.fill_(q_len)
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}  # logits, layer inputs read
        self.meta: Dict[int, Any] = {}

    def _run(self, bs: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        n = bs * self.q_len
        step = AttentionStep(self.backend, self.meta[bs])
        aux: Optional[List[torch.Tensor]] = [] if self.read_aux else None
        logits = self.model.compute_logits(self.model(self.input_ids[:n], self.positions[:n], step, aux))
        return logits, torch.cat(aux, dim=-1) if aux else None

    def capture(self, capture_one) -> None:
        """capture_one(fn) -> (graph, output): the decode graphs' capture (same stream, pool and mode)."""
        for bs in reversed(self.sizes):
            self.meta[bs] = self.backend.verify_meta(self.out_cache_loc[:bs * self.q_len], *self.static.rows(bs),
                                                     self.q_len)
            self.graphs[bs], self.outputs[bs] = capture_one(lambda bs=bs: self._run(bs))

    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.verify and fb.batch_size <= self.max_bs and max(fb.extend_lens_cpu) <= self.q_len
                and max(s - n for s, n in zip(fb.seq_lens_cpu, fb.extend_lens_cpu)) + self.q_len <= self.max_seq_len)

    def replay(self, fb: ForwardBatch) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logits [T, V] of the step's T real tokens, and (read_aux) the layer inputs read [T, 3 x hidden]."""
        bs, q = fb.batch_size, self.q_len
        pbs = self.sizes[bisect.bisect_left(self.sizes, bs)]
        rows = [i * q + j for i, n in enumerate(fb.extend_lens_cpu) for j in range(n)]
        lens = [s - n + q for s, n in zip(fb.seq_lens_cpu, fb.extend_lens_cpu)]
        both = to_device(rows + lens, torch.int64, self.input_ids.device)
        rows_d, lens_d = both[:len(rows)], both[len(rows):].to(torch.int32)
        n = pbs * q
        for buf, src, pad in ((self.input_ids, fb.input_ids, 0), (self.positions, fb.positions, 0),
                              (self.out_cache_loc, fb.out_cache_loc, self.pad_slot)):
            buf[:n].fill_(pad)
            buf.index_copy_(0, rows_d, src)
        padded = dataclasses.replace(fb, seq_lens=lens_d, seq_lens_cpu=lens, max_seq_len=max(lens))
        self.static.fill(self.req_to_token, padded, pbs)
        self.static.seq_lens[bs:pbs] = q  # padding requests: q queries over q keys of page 0
        self.graphs[pbs].replay()
        logits, aux = self.outputs[pbs]
        return logits[rows_d], aux[rows_d] if aux is not None else None
