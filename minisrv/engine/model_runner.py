"""One forward step: scheduled batch -> step tensors -> attention plan -> model -> last-position logits -> sampler.

The overlap protocol lives here and nowhere else. `launch` queues a step on the device and returns at once;
`collect` waits for the oldest launched step and writes its sampled tokens into the requests. Between the two, a
request's sampled token is only counted (`Request.num_pending`), and when the next step is launched before the
previous one is collected (overlap scheduling on CUDA), a decode input whose token is still pending is read on the
device from the previous step's sampled ids: the host never waits for the device to build a step.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

import torch

from minisrv.attention.base import AttentionBackend
from minisrv.attention.cascade import CascadePolicy
from minisrv.batch import ForwardBatch, ForwardMode, PrefixGroups
from minisrv.distributed import TensorParallel, TensorParallelError
from minisrv.kvcache import KVPool, ReqToTokenTable
from minisrv.utils import host_tensor, to_device

from .request import Request, TokenLogprob
from .sampler import SamplingBatch, sample
from .scheduler import ScheduledBatch

PROMPT_LOGPROB_ROWS = 1024  # prompt positions scored at once: never a [T, vocab] tensor for a long prompt


@dataclass
class SampledToken:
    """A token that reached the host, already appended to its request's output_ids (token_id None: a request
    that only scores its prompt, max_tokens 0, reached the end of its prefill)."""

    req: Request
    token_id: Optional[int]
    logprob: Optional[TokenLogprob]


@dataclass
class PromptScores:
    """Logprobs of some prompt tokens computed in a step (host copies, maybe pending): for owner k, the tokens at
    prompt positions positions[k]."""

    owners: List[Request]
    positions: List[List[int]]
    host: List[Optional[torch.Tensor]]  # chosen logprobs [R], top values [R, n], top ids [R, n]


@dataclass
class StepInputs:
    """Everything a forward step needs, as plain host data built from the scheduled batch: what rank 0 sends the
    other tensor-parallel ranks so that every rank runs the same step without knowing any request."""

    mode: ForwardMode
    ints: torch.Tensor  # int64: ids, positions, rows, last indices, seq_lens, cu_seqlens, pending rows, slots
    num_pending: int  # decode inputs still on the device (read from the newest launched step's sampled ids)
    seq_lens: List[int]
    extend_lens: List[int]
    sample_rows: Optional[List[int]]  # rows of the batch that sample a token (None: all)
    score_rows: Optional[List[int]] = None  # prompt logprobs: token rows whose next token is scored ...
    score_targets: Optional[List[int]] = None  # ... and those next tokens
    score_top_n: int = 0
    table_writes: Optional[list] = None  # request->token table writes since the last step (tensor parallel)
    prefix_groups: Optional[PrefixGroups] = None  # a decode step to run as cascade attention (attention/cascade.py)

    @property
    def num_sampled(self) -> int:
        return len(self.seq_lens) if self.sample_rows is None else len(self.sample_rows)


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; its results reach the host when `event` completes."""

    batch: ScheduledBatch
    sampling: List[Request]  # the requests that sample a token this step, in the order of `ids`
    ids: Optional[torch.Tensor]  # [S] sampled ids on the device (the next step's inputs may point into it)
    host: List[Optional[torch.Tensor]]  # ids, chosen logprobs, top values, top ids (host copies, maybe pending)
    event: Optional[torch.cuda.Event]
    index: Dict[str, int] = field(default_factory=dict)  # rid -> row in `ids`
    prompt_scores: Optional[PromptScores] = None

    def wait(self) -> Tuple[List[int], Optional[List[float]], Optional[Tuple[List[List[float]], List[List[int]]]]]:
        if self.event is not None:
            self.event.synchronize()
        ids, lp, top_v, top_i = self.host
        if ids is None:
            return [], None, None
        return (ids.tolist(), lp.tolist() if lp is not None else None,
                (top_v.tolist(), top_i.tolist()) if top_v is not None else None)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, pool: KVPool, table: ReqToTokenTable,
                 device: torch.device, graph_runner=None, tp: Optional[TensorParallel] = None,
                 cascade: Optional[CascadePolicy] = None) -> None:
        self.model = model
        self.tp = tp or TensorParallel.single()
        self.backend = backend
        self.pool = pool
        self.table = table
        self.device = device
        self.graph_runner = graph_runner  # CUDA-graph decode, when enabled
        self.cascade = cascade  # when decode steps run as cascade attention (None: never)
        self.num_cascade_steps = 0
        self.timings: Optional[Dict[str, float]] = None  # phase -> seconds, when profiling
        self.wait_s = 0.0  # host time spent waiting for the device's results (the GPU-bound share of a run)
        self._inflight: Deque[LaunchedStep] = deque()  # launched and not yet collected, oldest first
        self._newest_ids: Optional[torch.Tensor] = None  # sampled ids of the newest launched step, on the device
        self._deferred: Optional[tuple] = None  # a step whose forward is queued and sampling is not (see launch)

    def enable_profiling(self, timings: Dict[str, float]) -> None:
        """Charge each phase's time to `timings` (it synchronises the device after every phase)."""
        self.timings = timings

    def _tick(self, phase: str, t0: float) -> float:
        """Charge the time since t0 to phase (synchronising the device so the time is the phase's own)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = time.perf_counter()
        self.timings[phase] += t - t0
        return t

    def step_inputs(self, sb: ScheduledBatch) -> StepInputs:
        """Host data of a scheduled batch's step. A decode input whose token is still pending is marked with the row
        of the newest launched step's sampled ids it will be read from, on the device."""
        reqs, ext = sb.reqs, sb.extend_lens
        seq_lens = [r.num_cached + n for r, n in zip(reqs, ext)]
        pending_rows: List[int] = []
        if sb.mode is ForwardMode.DECODE:
            ids, pos = [], []
            prev = self._inflight[-1] if self._inflight else None
            for r in reqs:
                if r.num_pending:
                    pending_rows.append(prev.index[r.rid])  # its newest token is in the newest launched step
                    ids.append(0)
                else:
                    pending_rows.append(-1)
                    ids.append(r.output_ids[-1] if r.output_ids else r.prompt_ids[-1])
                pos.append(r.num_cached)
            if not any(r >= 0 for r in pending_rows):
                pending_rows = []
        else:
            ids, pos = [], []
            for r, n in zip(reqs, ext):
                assert not r.num_pending, "an extend step needs every token of its requests on the host"
                ids.extend(r.all_ids[r.num_cached:r.num_cached + n])
                pos.extend(range(r.num_cached, r.num_cached + n))
        cu = [0]
        for n in ext:
            cu.append(cu[-1] + n)
        # one host buffer and one copy for every step tensor (int32 ones are converted on the device)
        head = host_tensor(ids + pos + [r.row for r in reqs] + [c - 1 for c in cu[1:]] + seq_lens + cu
                           + pending_rows, torch.int64)
        cuda = self.device.type == "cuda"
        ints = torch.empty(head.numel() + sb.out_cache_loc.numel(), dtype=torch.int64, pin_memory=cuda)
        torch.cat([head, sb.out_cache_loc], out=ints)
        samples = sb.samples
        groups = None
        if self.cascade is not None and sb.mode is ForwardMode.DECODE:
            graphed = self.graph_runner is not None and len(reqs) <= self.graph_runner.max_bs
            groups = self.cascade.plan([r.pages for r in reqs], seq_lens, graphed)
            self.num_cascade_steps += groups is not None
        inp = StepInputs(sb.mode, ints, len(pending_rows), seq_lens, list(ext),
                         None if all(samples) else [i for i, s in enumerate(samples) if s], prefix_groups=groups)
        if self.table.journal is not None:
            inp.table_writes = self.table.take_journal()
        return inp

    def forward_batch(self, inp: StepInputs) -> ForwardBatch:
        """The step's tensors on the device: one host-to-device copy of `inp.ints`, sliced."""
        t, b, p = sum(inp.extend_lens), len(inp.seq_lens), inp.num_pending
        d = to_device(inp.ints, torch.int64, self.device)  # pinned on rank 0; staged through pinned memory elsewhere
        o = 2 * t + 2 * b  # start of seq_lens, then cu, then pending rows
        i32 = d[o:o + 2 * b + 1].to(torch.int32)
        input_ids = d[:t]
        if p:
            rows = d[o + 2 * b + 1:o + 2 * b + 1 + p]
            input_ids = torch.where(rows >= 0, self._newest_ids[rows.clamp(min=0)], input_ids)
        return ForwardBatch(
            mode=inp.mode,
            input_ids=input_ids,
            positions=d[t:2 * t],
            out_cache_loc=d[o + 2 * b + 1 + p:],
            req_rows=d[2 * t:2 * t + b],
            seq_lens=i32[:b],
            cu_seqlens_q=i32[b:],
            last_indices=d[2 * t + b:o],
            seq_lens_cpu=inp.seq_lens,
            extend_lens_cpu=inp.extend_lens,
            max_seq_len=max(inp.seq_lens),
            prefix_groups=inp.prefix_groups,
        )

    def build_forward_batch(self, sb: ScheduledBatch) -> ForwardBatch:
        return self.forward_batch(self.step_inputs(sb))

    @torch.inference_mode()
    def forward_logits(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] float32 at each request's last token of the step."""
        if fb.is_decode and self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        hidden = self.model(fb.input_ids, fb.positions, self.backend.step(fb))
        return self.model.compute_logits(hidden[fb.last_indices])

    @staticmethod
    def _plan_prompt_scores(sb: ScheduledBatch, inp: StepInputs) -> Optional[Tuple[List[Request], List[List[int]]]]:
        """For an extend step with requests asking for prompt logprobs: the token rows whose next prompt token is
        scored this step (position p's logits score token p + 1) go into `inp`; returns their owners and positions."""
        rows, targets, owners, positions = [], [], [], []
        start = 0
        for r, n in zip(sb.reqs, sb.extend_lens):
            if r.params.prompt_logprobs is not None:
                plen = len(r.prompt_ids)
                pos = [p + 1 for p in range(r.num_cached, r.num_cached + n) if p + 1 < plen]
                if pos:
                    owners.append(r)
                    positions.append(pos)
                    rows.extend(start + p - 1 - r.num_cached for p in pos)
                    targets.extend(r.prompt_ids[p] for p in pos)
            start += n
        if not rows:
            return None
        inp.score_rows, inp.score_targets = rows, targets
        inp.score_top_n = max(r.params.prompt_logprobs for r in owners)
        return owners, positions

    def _run(self, inp: StepInputs, fb: ForwardBatch) -> Tuple[torch.Tensor, Optional[List[Optional[torch.Tensor]]]]:
        """The forward every tensor-parallel rank runs: logits [B, V] at each request's last token and, when `inp`
        asks, the logprob (and top-n) of each scored prompt token, PROMPT_LOGPROB_ROWS rows at a time."""
        if inp.score_rows is None:
            return self.forward_logits(fb), None
        hidden = self.model(fb.input_ids, fb.positions, self.backend.step(fb))
        logits = self.model.compute_logits(hidden[fb.last_indices])
        rows, top_n = inp.score_rows, inp.score_top_n
        idx = to_device([rows, inp.score_targets], torch.int64, hidden.device)
        chosen, top_v, top_i = [], [], []
        for c in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            lp = torch.log_softmax(self.model.compute_logits(hidden[idx[0, c:c + PROMPT_LOGPROB_ROWS]]), dim=-1)
            chosen.append(lp.gather(1, idx[1, c:c + PROMPT_LOGPROB_ROWS, None]).squeeze(1))
            if top_n:
                t = lp.topk(top_n, dim=-1)
                top_v.append(t.values)
                top_i.append(t.indices)
        return logits, [torch.cat(chosen), torch.cat(top_v) if top_n else None, torch.cat(top_i) if top_n else None]

    def _to_host(self, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A non-blocking copy into pinned memory on CUDA (complete when the step's event is)."""
        if x is None or self.device.type != "cuda":
            return x
        return torch.empty(x.shape, dtype=x.dtype, pin_memory=True).copy_(x, non_blocking=True)

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs (before a tensor-parallel group's teardown: NCCL waits for graphs holding
        its kernels); decode runs eagerly after this."""
        if self.graph_runner is not None:
            self.graph_runner = None
            import gc
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    @torch.inference_mode()
    def launch(self, sb: ScheduledBatch, defer_sampling: bool = False) -> None:
        """Queue forward and sampling; copy results to the host without waiting for them. Under tensor
        parallelism the step's inputs go to the other ranks first, and the sampled ids after sampling.

        defer_sampling: queue only the forward; `finish_launch` queues the sampling. In between, the caller
        collects the previous step, whose tokens this step's sampling needs on the host (grammar masks,
        penalties), while the device runs this step's forward."""
        assert self._deferred is None, "finish_launch the deferred step first"
        prof = self.timings is not None
        t = time.perf_counter() if prof else 0.0
        inp = self.step_inputs(sb)
        scoring = None
        if inp.mode is not ForwardMode.DECODE and any(r.params.prompt_logprobs is not None for r in sb.reqs):
            scoring = self._plan_prompt_scores(sb, inp)
        if self.tp.enabled:
            self.tp.send_object(inp)
        try:
            fb = self.forward_batch(inp)
            if prof:
                t = self._tick("metadata", t)
            logits, score_outs = self._run(inp, fb)
        except Exception as e:
            if self.tp.enabled:  # the other ranks may wait in a collective this rank never reaches
                raise TensorParallelError(f"a step failed on rank 0 after the other ranks began it: "
                                          f"{type(e).__name__}: {e}") from e
            raise
        scores = None
        if scoring is not None:
            scores = PromptScores(scoring[0], scoring[1], [self._to_host(x) for x in score_outs])
        if prof:
            self._tick("forward_decode" if fb.is_decode else "forward_extend", t)
        self._deferred = (sb, inp, logits, scores)
        if not defer_sampling:
            self.finish_launch()

    @property
    def has_deferred(self) -> bool:
        return self._deferred is not None

    @torch.inference_mode()
    def finish_launch(self) -> None:
        """Queue the sampling of the step whose forward `launch` queued, and count it as in flight."""
        sb, inp, logits, scores = self._deferred
        self._deferred = None
        prof = self.timings is not None
        t = time.perf_counter() if prof else 0.0
        sampling = [r for r, s in zip(sb.reqs, sb.samples) if s]
        if not sampling:
            self._newest_ids = None
            event = None
            if scores is not None and self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
            self._inflight.append(LaunchedStep(sb, [], None, [None] * 4, event, prompt_scores=scores))
            return
        if inp.sample_rows is not None:
            logits = logits[to_device(inp.sample_rows, torch.int64, logits.device)]
        try:
            ids, lp, top = sample(logits, SamplingBatch.build(sampling, logits.device))
        except Exception:
            if self.tp.enabled:  # the other ranks wait for this step's ids: send them something, then fail
                self.tp.broadcast(torch.zeros(len(sampling), dtype=torch.int64, device=self.device))
            raise
        self._newest_ids = self.tp.broadcast(ids)  # every rank reads pending decode inputs from these
        outs = [ids, lp, *(top if top is not None else (None, None))]
        event = None
        host = [self._to_host(x) for x in outs]
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        for r in sampling:
            r.num_pending += 1
        self._inflight.append(LaunchedStep(sb, sampling, ids, host, event, {r.rid: k for k, r in enumerate(sampling)},
                                           scores))
        if prof:
            self._tick("sampling", t)

    @torch.inference_mode()
    def run_remote_step(self, inp: StepInputs) -> None:
        """A tensor-parallel rank > 0: the step rank 0 sent, on this rank's shard; then receive the sampled ids."""
        if inp.table_writes:
            self.table.replay(inp.table_writes)
        self._run(inp, self.forward_batch(inp))
        if inp.num_sampled:
            self._newest_ids = self.tp.broadcast(torch.empty(inp.num_sampled, dtype=torch.int64, device=self.device))
        else:
            self._newest_ids = None

    def oldest_requests(self) -> List[Request]:
        return list(self._inflight[0].batch.reqs) if self._inflight else []

    def collect(self) -> List[SampledToken]:
        """Wait for the oldest launched step; append its tokens to their requests (in batch order). A request that
        finished while its token was on the device gets nothing."""
        step = self._inflight.popleft()
        for req in step.sampling:
            req.num_pending -= 1  # whatever happens below, this step's tokens are no longer on their way
        t0 = time.perf_counter()
        token_ids, lps, top = step.wait()
        self.wait_s += time.perf_counter() - t0
        if step.prompt_scores is not None:
            _store_prompt_scores(step.prompt_scores)
        out: List[SampledToken] = []
        for i, req in enumerate(step.sampling):
            if req.finished:
                continue
            if req.max_new_tokens == 0:  # it only scores its prompt: the token sampled after it is not wanted
                out.append(SampledToken(req, None, None))
                continue
            tok = token_ids[i]
            req.output_ids.append(tok)
            lp = None
            if lps is not None and req.params.logprobs is not None:
                n_top = req.params.logprobs
                tops = dict(zip(top[1][i][:n_top], top[0][i][:n_top])) if n_top > 0 and top is not None else {}
                lp = TokenLogprob(tok, lps[i], tops)
                req.logprobs.append(lp)
            out.append(SampledToken(req, tok, lp))
        return out


def _store_prompt_scores(scores: PromptScores) -> None:
    chosen, top_v, top_i = (None if x is None else x.tolist() for x in scores.host)
    k = 0
    for req, positions in zip(scores.owners, scores.positions):
        n_top = req.params.prompt_logprobs
        for p in positions:
            tops = dict(zip(top_i[k][:n_top], top_v[k][:n_top])) if n_top else {}
            req.prompt_logprobs[p] = TokenLogprob(req.prompt_ids[p], chosen[k], tops)
            k += 1
