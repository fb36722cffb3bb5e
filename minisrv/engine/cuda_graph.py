"""CUDA graphs for decode steps: captured once per batch size, replayed with the batch padded to the next size;
and, with speculative decoding, verify steps' graphs (`VerifyGraphs`).

Inputs live in static buffers; before each replay the step's ids, positions, slots and rows are copied in and the
attention backend copies its metadata into its own static buffers (`prepare_for_replay`). Padding rows decode a
dummy token into a reserved pad slot and read only the pad row of the request->token table, so they never touch
a live request's KV.

Verify graphs are captured at one query length q (the request's last token and q - 1 drafts). A verify step's
requests may bring shorter drafts than q - 1: each request's tokens take the first rows of its q rows, and the rows
past them are padding whose K/V go to the pad slot and whose logits are dropped. Its length for attention is then its
prefix + q, so that FA3's bottom-right causal alignment still lets real query j see exactly keys 0..prefix + j; the
padding queries read past the request's end through its table row (stale but valid pages), and what they compute is
discarded. With an EAGLE-3 head (`read_aux`), the graphs also give the target layers' inputs the head reads
([T, 3 x hidden]: models/llama.py's DecoderLayers).
"""
from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from minisrv.attention.base import AttentionBackend, AttentionStep
from minisrv.attention.page_table import StaticPageTable
from minisrv.batch import ForwardBatch, ForwardMode
from minisrv.utils import to_device

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> List[int]:
    return [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))


def default_max_bs(device: torch.device) -> int:
    total = torch.cuda.get_device_properties(device).total_memory / (1 << 30)
    return 256 if total >= 70 else 160 if total >= 35 else 64


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, pad_row: int, pad_slot: int,
                 max_bs: int, max_seq_len: int, device: torch.device, verify_q_len: int = 0,
                 verify_max_bs: int = 0, verify_read_aux: bool = False) -> None:
        """verify_q_len: with speculative decoding, the query length of verify steps (their graphs are captured for
        batch sizes up to verify_max_bs, where the backend has a verify_backend); verify_read_aux: they also give
        the layer inputs an EAGLE-3 head reads."""
        self.model = model
        self.backend = backend
        self.device = device
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.pad_row = pad_row
        self.pad_slot = pad_slot
        n = self.max_bs
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.out_cache_loc = torch.full((n,), pad_slot, **i64)
        self.req_rows = torch.full((n,), pad_row, **i64)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logit_rows = torch.arange(n, **i64)
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: Dict[int, torch.Tensor] = {}
        self.meta: Dict[int, Any] = {}  # batch size -> the attention metadata its graph was captured with
        self.mempool = torch.cuda.graph_pool_handle()
        backend.init_graph_state(self.max_bs, max_seq_len)
        vb = backend.verify_backend() if verify_q_len and verify_max_bs else None
        self.verify = VerifyGraphs(model, vb, vb.req_to_token, pad_slot, capture_sizes(min(verify_max_bs, max_bs)),
                                   verify_q_len, max_seq_len, device, verify_read_aux) if vb is not None else None
        self.capture()

    def _static_batch(self, bs: int, seq_lens_cpu: List[int]) -> ForwardBatch:
        return ForwardBatch(ForwardMode.DECODE, self.input_ids[:bs], self.positions[:bs], self.out_cache_loc[:bs],
                            self.req_rows[:bs], self.seq_lens[:bs], self.cu_seqlens_q[:bs + 1],
                            self.logit_rows[:bs], seq_lens_cpu, [1] * bs, max(seq_lens_cpu))

    def _run(self, fb: ForwardBatch, meta: Any) -> torch.Tensor:
        hidden = self.model(fb.input_ids, fb.positions, AttentionStep(self.backend, meta))
        return self.model.compute_logits(hidden[fb.logit_rows])

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        free0 = torch.cuda.mem_get_info(self.device)[0]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # with tensor parallelism the NCCL watchdog thread queries events while this thread captures: only this
        # thread's calls must be capturable
        mode = "thread_local" if getattr(self.model, "tp", None) is not None and self.model.tp.enabled else "global"

        def capture_one(run):
            run()  # warm-up: lazy kernel selection and allocations happen here
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool, stream=stream, capture_error_mode=mode):
                out = run()
            return graph, out

        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
                fb = self._static_batch(bs, [1] * bs)
                meta = self.backend.prepare_for_capture(fb)  # plans happen outside the captured region
                self.graphs[bs], self.logits[bs] = capture_one(lambda: self._run(fb, meta))
                self.meta[bs] = meta
            if self.verify is not None:
                self.verify.capture(capture_one)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_gib = (free0 - torch.cuda.mem_get_info(self.device)[0]) / (1 << 30)
        self.capture_s = round(time.perf_counter() - t0, 2)
        logger.info("captured %d decode CUDA graphs (batch sizes 1..%d)%s in %.1fs, %.2f GiB",
                    len(self.graphs), self.max_bs, "" if self.verify is None else
                    f" and {len(self.verify.graphs)} verify graphs ({self.verify.q_len} tokens a request)",
                    self.capture_s, self.capture_gib)

    def can_run(self, fb: ForwardBatch) -> bool:
        # a cascade step (prefix_groups set) plans two attention levels of its own: it runs eagerly
        return fb.is_decode and fb.prefix_groups is None and fb.batch_size <= self.max_bs

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        bs = fb.batch_size
        pbs = self.sizes[bisect.bisect_left(self.sizes, bs)]
        for buf, src, pad in ((self.input_ids, fb.input_ids, 0), (self.positions, fb.positions, 0),
                              (self.out_cache_loc, fb.out_cache_loc, self.pad_slot),
                              (self.req_rows, fb.req_rows, self.pad_row), (self.seq_lens, fb.seq_lens, 1)):
            buf[:bs].copy_(src, non_blocking=True)
            if pbs > bs:  # padding rows
                buf[bs:pbs].fill_(pad)
        self.backend.prepare_for_replay(fb, pbs, self.meta[pbs])
        self.graphs[pbs].replay()
        return self.logits[pbs][:bs]


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
