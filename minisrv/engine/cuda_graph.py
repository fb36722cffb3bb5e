"""CUDA graphs for decode steps: captured once per batch size, replayed with the batch padded to the next size
(and, with speculative decoding, verify steps' graphs: verify_graphs.py).

Inputs live in static buffers; before each replay the step's ids, positions, slots and rows are copied in and the
attention backend copies its metadata into its own static buffers (`prepare_for_replay`). Padding rows decode a
dummy token into a reserved pad slot and read only the pad row of the request->token table, so they never touch
a live request's KV.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Any, Dict, List

import torch

from minisrv.attention.base import AttentionBackend, AttentionStep
from minisrv.batch import ForwardBatch, ForwardMode

from .verify_graphs import VerifyGraphs

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
