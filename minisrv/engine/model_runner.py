"""One forward step: scheduled batch -> step tensors -> backend plan -> model -> last-position logits -> sampler."""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from minisrv.attention.base import AttentionBackend, ForwardBatch, ForwardMode, to_device

from .kv_cache import KVPool, ReqToTokenTable
from .sampler import SamplingBatch, sample
from .scheduler import ScheduledBatch


@dataclass
class StepResult:
    """Host copies of the sampled tokens for the requests that sampled this step (in batch order)."""

    token_ids: List[int]
    logprobs: Optional[List[float]]
    top_logprobs: Optional[Tuple[List[List[float]], List[List[int]]]]


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; its results reach the host when `event` completes."""

    batch: ScheduledBatch
    ids: Optional[torch.Tensor]  # [S] sampled ids on the device (next step's inputs may point into it)
    host: List[Optional[torch.Tensor]]  # ids, chosen logprobs, top values, top ids (host copies, maybe pending)
    event: Optional[torch.cuda.Event]
    positions: List[int] = None  # where each sampling request's token goes in its output_ids

    def result(self) -> StepResult:
        if self.event is not None:
            self.event.synchronize()
        ids, lp, top_v, top_i = self.host
        if ids is None:
            return StepResult([], None, None)
        return StepResult(ids.tolist(), lp.tolist() if lp is not None else None,
                          (top_v.tolist(), top_i.tolist()) if top_v is not None else None)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, pool: KVPool, table: ReqToTokenTable,
                 device: torch.device, graph_runner=None) -> None:
        self.model = model
        self.backend = backend
        self.pool = pool
        self.table = table
        self.device = device
        self.graph_runner = graph_runner  # CUDA-graph decode, when enabled
        self.timings: Optional[Dict[str, float]] = None  # phase -> seconds, when profiling

    def enable_profiling(self) -> None:
        self.timings = defaultdict(float)

    def _tick(self, phase: str, t0: float) -> float:
        """Charge the time since t0 to phase (synchronising the device so the time is the phase's own)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        self.timings[phase] += t - t0
        return t

    def build_forward_batch(self, sb: ScheduledBatch, prev_ids: Optional[torch.Tensor] = None) -> ForwardBatch:
        """Step tensors for a scheduled batch. A decode input may be a placeholder -(k+1) for a token still being
        sampled by the previous step; it is resolved on the device from that step's ids (`prev_ids[k]`)."""
        reqs, ext = sb.reqs, sb.extend_lens
        seq_lens = [r.num_cached + n for r, n in zip(reqs, ext)]
        if sb.mode is ForwardMode.DECODE:
            ids = [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs]
            pos = [r.num_cached for r in reqs]
        else:
            ids, pos = [], []
            for r, n in zip(reqs, ext):
                ids.extend(r.all_ids[r.num_cached:r.num_cached + n])
                pos.extend(range(r.num_cached, r.num_cached + n))
        cu = [0]
        for n in ext:
            cu.append(cu[-1] + n)
        t, b = len(ids), len(reqs)
        # one pinned host buffer and one copy for every step tensor (int32 ones are converted on the device)
        head = torch.tensor(ids + pos + [r.row for r in reqs] + [c - 1 for c in cu[1:]] + seq_lens + cu,
                            dtype=torch.int64)
        cuda = self.device.type == "cuda"
        buf = torch.empty(head.numel() + t, dtype=torch.int64, pin_memory=cuda)
        torch.cat([head, sb.out_cache_loc], out=buf)
        d = buf.to(self.device, non_blocking=True) if cuda else buf
        o = 2 * t + 2 * b  # start of seq_lens, then cu
        i32 = d[o:o + 2 * b + 1].to(torch.int32)
        input_ids = d[:t]
        if prev_ids is not None and sb.mode is ForwardMode.DECODE and min(ids) < 0:
            input_ids = torch.where(input_ids < 0, prev_ids[(-input_ids - 1).clamp_(min=0)], input_ids)
        return ForwardBatch(
            mode=sb.mode,
            input_ids=input_ids,
            positions=d[t:2 * t],
            out_cache_loc=d[o + 2 * b + 1:],
            req_rows=d[2 * t:2 * t + b],
            seq_lens=i32[:b],
            cu_seqlens_q=i32[b:],
            last_indices=d[2 * t + b:o],
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(ext),
            max_seq_len=max(seq_lens),
        )

    @torch.inference_mode()
    def forward_logits(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] float32 at each request's last token of the step."""
        if fb.is_decode and self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        self.backend.prepare(fb)
        hidden = self.model(fb.input_ids, fb.positions, self.backend)
        return self.model.compute_logits(hidden[fb.last_indices])

    @torch.inference_mode()
    def launch(self, sb: ScheduledBatch, prev_ids: Optional[torch.Tensor] = None) -> LaunchedStep:
        """Queue forward and sampling; copy results to the host without waiting for them."""
        prof = self.timings is not None
        t = time.perf_counter() if prof else 0.0
        fb = self.build_forward_batch(sb, prev_ids)
        if prof:
            t = self._tick("metadata", t)
        logits = self.forward_logits(fb)
        if prof:
            t = self._tick("forward_decode" if fb.is_decode else "forward_extend", t)
        sampling = [r for r, s in zip(sb.reqs, sb.samples) if s]
        if not sampling:
            return LaunchedStep(sb, None, [None] * 4, None)
        if len(sampling) != len(sb.reqs):
            keep = to_device([i for i, s in enumerate(sb.samples) if s], torch.int64, logits.device)
            logits = logits[keep]
        ids, lp, top = sample(logits, SamplingBatch.build(sampling, logits.device))
        outs = [ids, lp, *(top if top is not None else (None, None))]
        event = None
        if self.device.type == "cuda":
            host = [None if x is None else torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(
                x, non_blocking=True) for x in outs]
            event = torch.cuda.Event()
            event.record()
        else:
            host = outs
        if prof:
            self._tick("sampling", t)
        return LaunchedStep(sb, ids, host, event)
