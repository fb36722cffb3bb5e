"""One forward step: scheduled batch -> step tensors -> attention plan -> model -> last-position logits -> sampler.

The overlap protocol lives here and nowhere else. `launch` queues a step on the device and returns at once;
`collect` hands over the oldest launched step's results, its sampled tokens written into the requests. Between the
two, a request's sampled token is only counted (`Request.num_pending`), and when the next step is launched before the
previous one is collected (overlap scheduling on CUDA), a decode input whose token is still pending is read on the
device from the previous step's sampled ids: the host never waits for the device to build a step.

A step whose sampling needs the previous tokens on the host (penalties count them, a grammar's mask needs them
accepted) is launched in two halves: its forward is queued, then the steps still in flight are read back (and their
tokens fed to the grammars) while the device runs that forward, then its sampling is queued. The steps read back
early wait in order for `collect` like any other.
"""
from __future__ import annotations

import gc
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from minisrv.attention.base import AttentionBackend
from minisrv.attention.cascade import CascadePolicy
from minisrv.batch import ForwardBatch, ForwardMode, PrefixGroups
from minisrv.distributed import TensorParallel, TensorParallelError
from minisrv.kernels.cpu_threads import ThreadTuner
from minisrv.kvcache import ReqToTokenTable
from minisrv.utils import to_device

from .pooling import PooledStep, Pooler
from .prompt_scores import PromptScores, plan_prompt_scores, score_prompt_rows, store_prompt_scores
from .request import Request
from .sampler import SamplingBatch, sample
from .speculative.verify import sampling_positions, verified_tokens
from .step_results import CollectedStep, SampledToken, StepHidden, take_token, token_logprob
from .scheduler import ScheduledBatch
from .step_inputs import StepInputs, StepLayout


@dataclass(frozen=True)
class RunnerParts:
    """What the steps run on besides the model, handed over in one piece (`ModelRunner.use_parts`) by setup at start
    and by the start-up switch to kernels built meanwhile (kernel_builds.StagedKernels)."""

    backend: AttentionBackend
    graph_runner: Optional[Any] = None  # CUDA-graph decode, when enabled
    cascade: Optional[CascadePolicy] = None  # when decode steps run as cascade attention (None: never)
    sampling_kernel: Optional[Callable] = None  # FlashInfer's draw (sampler.fused_sampling_kernel); None: torch's


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
    pooled: Optional[PooledStep] = None  # an embedding model's step: the vectors it finished
    hidden: Optional[StepHidden] = None  # what an EAGLE-3 head reads of it

    def wait(self) -> Tuple[List[int], Optional[List[float]], Optional[Tuple[List[List[float]], List[List[int]]]]]:
        if self.event is not None:
            self.event.synchronize()
        ids, lp, top_v, top_i = self.host
        if ids is None:
            return [], None, None
        return (ids.tolist(), lp.tolist() if lp is not None else None,
                (top_v.tolist(), top_i.tolist()) if top_v is not None else None)


class ModelRunner:
    """Runs an engine's steps; each mode in one place: a generation model's step (`launch`: forward, then sampling;
    with prompt logprobs asked, the forward also scores prompt tokens, prompt_scores.py), an embedding model's
    (`_launch_pooling`), a decode step planned as cascade attention (`_cascade_plan`), and a tensor-parallel rank
    > 0 following rank 0's steps (`run_remote_step`)."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, table: ReqToTokenTable, device: torch.device,
                 tp: Optional[TensorParallel] = None, pooler: Optional[Pooler] = None) -> None:
        self.model = model
        self.pooler = pooler  # an embedding model's: its steps pool the hidden states, nothing is sampled
        self.tp = tp or TensorParallel.single()
        self.table = table
        self.device = device
        self.threads = ThreadTuner(torch.get_num_threads()) if device.type == "cpu" and not self.tp.enabled else None
        self.use_parts(RunnerParts(backend))
        self.num_cascade_steps = 0
        self.wait_s = 0.0  # host time spent waiting for the device's results (the GPU-bound share of a run)
        self._inflight: Deque[LaunchedStep] = deque()  # launched and not yet read back, oldest first
        self._read_back: Deque[CollectedStep] = deque()  # read back early by a launch, not yet collected, oldest first
        self._newest_ids: Optional[torch.Tensor] = None  # sampled ids of the newest launched step, on the device
        self.reads_aux = False  # extend steps keep the layer inputs an EAGLE-3 head reads (LaunchedStep.hidden)

    @property
    def parts(self) -> RunnerParts:
        return RunnerParts(self.backend, self.graph_runner, self.cascade, self.sampling_kernel)

    def use_parts(self, parts: RunnerParts) -> None:
        """Run the next steps on these parts (none in flight: the caller has collected them)."""
        self.backend, self.graph_runner, self.cascade, self.sampling_kernel = parts.backend, parts.graph_runner, \
            parts.cascade, parts.sampling_kernel

    # ------------------------------------------------------------------ step inputs
    def step_inputs(self, sb: ScheduledBatch) -> StepInputs:
        """Host data of a scheduled batch's step, its integer fields in one buffer (step_inputs.py)."""
        reqs, ext = sb.reqs, sb.extend_lens
        seq_lens = [r.num_cached + n for r, n in zip(reqs, ext)]
        if sb.mode is ForwardMode.DECODE:
            ids, pos, pending_rows = self._decode_inputs(reqs)
        else:  # an extend step; a verify step's requests extend by their last token and their draft
            ids, pos, pending_rows = [], [], []
            for i, (r, n) in enumerate(zip(reqs, ext)):
                assert not r.num_pending, "an extend or verify step needs every token of its requests on the host"
                ids += r.all_ids[r.num_cached:r.num_cached + n] if sb.drafts is None else [r.last_id, *sb.drafts[i]]
                pos.extend(range(r.num_cached, r.num_cached + n))
        cu = list(accumulate(ext, initial=0))
        logit_rows = list(range(cu[-1])) if sb.drafts is not None else [c - 1 for c in cu[1:]]
        layout = StepLayout(cu[-1], len(reqs), len(pending_rows), len(logit_rows))
        ints = layout.pack(self.device.type == "cuda", sb.out_cache_loc, input_ids=ids, positions=pos,
                           req_rows=[r.row for r in reqs], logit_rows=logit_rows, seq_lens=seq_lens,
                           cu_seqlens_q=cu, pending_rows=pending_rows)
        samples = sb.samples
        inp = StepInputs(sb.mode, ints, layout, seq_lens, list(ext),
                         None if all(samples) else [i for i, s in enumerate(samples) if s],
                         prefix_groups=self._cascade_plan(sb, seq_lens), verify=sb.drafts is not None)
        if self.table.journal is not None:
            inp.table_writes = self.table.take_journal()
        return inp

    def _decode_inputs(self, reqs: List[Request]) -> Tuple[List[int], List[int], List[int]]:
        """A decode step's input ids, positions and pending rows. A request whose newest token is still pending is
        marked with the row of the newest launched step's sampled ids it will be read from, on the device (its id
        here is a placeholder); with none pending, there are no pending rows."""
        ids, pos, pending_rows = [], [], []
        prev = self._inflight[-1] if self._inflight else None
        for r in reqs:
            if r.num_pending:
                pending_rows.append(prev.index[r.rid])  # its newest token is in the newest launched step
                ids.append(0)
            else:
                pending_rows.append(-1)
                ids.append(r.last_id)
            pos.append(r.num_cached)
        if not any(r >= 0 for r in pending_rows):
            pending_rows = []
        return ids, pos, pending_rows

    def _cascade_plan(self, sb: ScheduledBatch, seq_lens: List[int]) -> Optional[PrefixGroups]:
        """Cascade mode: a decode step whose requests share long prefixes reads each shared prefix once
        (attention/cascade.py's policy decides); None: the step runs as a plain one."""
        if self.cascade is None or sb.mode is not ForwardMode.DECODE:
            return None
        graphed = self.graph_runner is not None and len(sb.reqs) <= self.graph_runner.max_bs
        groups = self.cascade.plan([r.pages for r in sb.reqs], seq_lens, graphed)
        self.num_cascade_steps += groups is not None
        return groups

    def forward_batch(self, inp: StepInputs) -> ForwardBatch:
        """The step's tensors on the device: one host-to-device copy of `inp.ints`, viewed field by field."""
        f = inp.layout.unpack(to_device(inp.ints, torch.int64, self.device))
        input_ids = f.input_ids
        if inp.layout.num_pending:
            rows = f.pending_rows
            input_ids = torch.where(rows >= 0, self._newest_ids[rows.clamp(min=0)], input_ids)
        return ForwardBatch(
            mode=inp.mode, input_ids=input_ids, positions=f.positions, out_cache_loc=f.out_cache_loc,
            req_rows=f.req_rows, seq_lens=f.seq_lens, cu_seqlens_q=f.cu_seqlens_q, logit_rows=f.logit_rows,
            seq_lens_cpu=inp.seq_lens, extend_lens_cpu=inp.extend_lens, max_seq_len=max(inp.seq_lens),
            prefix_groups=inp.prefix_groups, verify=inp.verify)

    def build_forward_batch(self, sb: ScheduledBatch) -> ForwardBatch:
        return self.forward_batch(self.step_inputs(sb))

    # ------------------------------------------------------------------ the forward, on every rank
    @torch.inference_mode()
    def forward_logits(self, fb: ForwardBatch, aux: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """Logits [B, V] (the head's dtype) at each request's last token of the step. aux: gets the layer inputs an
        EAGLE-3 head reads appended, [T, 3 x hidden] for the step's T tokens."""
        graphs = self.graph_runner
        if fb.is_decode and graphs is not None and graphs.can_run(fb):
            return graphs.replay(fb)
        if fb.verify and graphs is not None and graphs.verify is not None and graphs.verify.can_run(fb) and \
                (aux is None or graphs.verify.read_aux):
            logits, read = graphs.verify.replay(fb)
            if aux is not None:
                aux.append(read)
            return logits
        hidden = self._hidden(fb, aux)
        return self.model.compute_logits(hidden[fb.logit_rows])

    def _hidden(self, fb: ForwardBatch, aux: Optional[List[torch.Tensor]]) -> torch.Tensor:
        read: Optional[List[torch.Tensor]] = [] if aux is not None else None
        hidden = self.model(fb.input_ids, fb.positions, self.backend.step(fb), read)
        if aux is not None:
            aux.append(torch.cat(read, dim=-1))
        return hidden

    def _forward(self, inp: StepInputs, fb: ForwardBatch, aux: Optional[List[torch.Tensor]] = None
                 ) -> Tuple[torch.Tensor, Optional[List[Optional[torch.Tensor]]]]:
        """The forward every tensor-parallel rank runs. An embedding model's: the hidden states [T, hidden]
        (pooling.py). A generation model's: logits [B, V] at each request's last token and, when `inp` scores
        prompt tokens, their logprobs (and top-n) (prompt_scores.py). aux: as forward_logits."""
        if self.pooler is not None:
            return self.model(fb.input_ids, fb.positions, self.backend.step(fb)), None
        if inp.score_rows is None:
            return self.forward_logits(fb, aux), None
        hidden = self._hidden(fb, aux)
        return self.model.compute_logits(hidden[fb.logit_rows]), score_prompt_rows(self.model, hidden, inp)

    def _forward_on_all_ranks(self, inp: StepInputs, aux: Optional[List[torch.Tensor]] = None
                              ) -> Tuple[torch.Tensor, Optional[List[Optional[torch.Tensor]]]]:
        """Rank 0's forward, the step's inputs sent to the other ranks first."""
        try:
            if self.tp.enabled:
                self.tp.send_object(inp)
            return self._forward(inp, self.forward_batch(inp), aux)
        except Exception as e:
            if self.tp.enabled:  # a rank is gone, or waits in a collective this rank never reaches
                raise TensorParallelError(f"a tensor-parallel step failed on rank 0: {type(e).__name__}: {e}") from e
            raise

    @torch.inference_mode()
    def run_remote_step(self, inp: StepInputs) -> None:
        """A tensor-parallel rank > 0: the step rank 0 sent, on this rank's shard; then receive the sampled ids."""
        if inp.table_writes:
            self.table.replay(inp.table_writes)
        self._forward(inp, self.forward_batch(inp))
        self._newest_ids = self.tp.broadcast(torch.empty(inp.num_sampled, dtype=torch.int64, device=self.device)) \
            if inp.num_sampled and self.pooler is None else None

    # ------------------------------------------------------------------ launching steps (rank 0)
    @property
    def num_inflight(self) -> int:
        return len(self._inflight) + len(self._read_back)

    @torch.inference_mode()
    def launch(self, sb: ScheduledBatch, needs_previous_tokens: bool = False) -> None:
        """Queue forward and sampling; copy results to the host without waiting for them. needs_previous_tokens:
        this step's sampling reads the tokens of the steps still in flight (see the module docstring). On the CPU
        the step runs on the thread count kernels/cpu_threads.py finds fastest."""
        decode_size = len(sb.reqs) if sb.mode is ForwardMode.DECODE else None
        with nullcontext() if self.threads is None else self.threads.step(decode_size):
            inp = self.step_inputs(sb)
            if self.pooler is not None:
                return self._launch_pooling(sb, inp)
            scores = plan_prompt_scores(sb.reqs, sb.extend_lens, inp) \
                if inp.mode is ForwardMode.EXTEND and not inp.verify else None
            aux: Optional[List[torch.Tensor]] = [] if self.reads_aux and inp.mode is ForwardMode.EXTEND else None
            logits, score_outs = self._forward_on_all_ranks(inp, aux)
            if scores is not None:
                scores.host = [self._to_host(x) for x in score_outs]
            if needs_previous_tokens:
                while self._inflight:
                    self._read_back.append(self._read_oldest())
            self._queue_sampling(sb, inp, logits, scores)
            if aux:  # what the step's requests were before it (it is committed after launch)
                self._inflight[-1].hidden = StepHidden(aux[0], list(sb.reqs), [r.num_cached for r in sb.reqs],
                                                       list(sb.extend_lens))

    def _launch_pooling(self, sb: ScheduledBatch, inp: StepInputs) -> None:
        """An embedding model's step: pool its hidden states instead of sampling, and count it as in flight."""
        hidden, _ = self._forward_on_all_ranks(inp)
        pooled = self.pooler.pool(sb.reqs, sb.extend_lens, hidden, self._to_host)
        self._newest_ids = None
        self._inflight.append(LaunchedStep(sb, [], None, [None] * 4, self._event(), pooled=pooled))

    def _queue_sampling(self, sb: ScheduledBatch, inp: StepInputs, logits: torch.Tensor,
                        scores: Optional[PromptScores]) -> None:
        sampling = [r for r, s in zip(sb.reqs, sb.samples) if s]
        if not sampling:
            self._newest_ids = None
            event = self._event() if scores is not None else None
            self._inflight.append(LaunchedStep(sb, [], None, [None] * 4, event, prompt_scores=scores))
            return
        if inp.sample_rows is not None:
            logits = logits[to_device(inp.sample_rows, torch.int64, logits.device)]
        rows = sampling if sb.drafts is None else sampling_positions(sampling, sb.drafts)  # a verify step's
        try:
            ids, lp, top = sample(logits, SamplingBatch.build(rows, logits.device), self.sampling_kernel)
        except Exception:
            if self.tp.enabled:  # the other ranks wait for this step's ids: send them something, then fail
                self.tp.broadcast(torch.zeros(len(rows), dtype=torch.int64, device=self.device))
            raise
        self._newest_ids = self.tp.broadcast(ids)  # every rank reads pending decode inputs from these
        host = [self._to_host(x) for x in (ids, lp, *(top if top is not None else (None, None)))]
        event = self._event()
        for r in sampling:
            r.num_pending += 1
        # a verify step's next tokens depend on what is kept: nothing reads them on the device (it is collected first)
        index = {r.rid: k for k, r in enumerate(sampling)} if sb.drafts is None else {}
        self._inflight.append(LaunchedStep(sb, sampling, ids, host, event, index, scores))

    def _event(self) -> Optional[torch.cuda.Event]:
        """A CUDA event recorded after the work queued so far (None on the CPU, where it is already done)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

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
            gc.unfreeze()  # the graphs may have been frozen with the start-up heap (utils.freeze_startup_heap)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ reading steps back
    def collect(self) -> CollectedStep:
        return self._read_back.popleft() if self._read_back else self._read_oldest()

    def _read_oldest(self) -> CollectedStep:
        """Wait for the oldest step in flight; append its tokens to their requests (in batch order) and feed them to
        their grammars. A request that finished while its token was on the device gets nothing."""
        step = self._inflight.popleft()
        for req in step.sampling:
            req.num_pending -= 1  # whatever happens below, this step's tokens are no longer on their way
        t0 = time.perf_counter()
        try:
            token_ids, lps, top = step.wait()
            if step.prompt_scores is not None:
                store_prompt_scores(step.prompt_scores)
            embedded = step.pooled.store() if step.pooled is not None else []
        except Exception as e:  # noqa: BLE001 - the caller decides whether the engine survives it
            return CollectedStep(list(step.batch.reqs), [], e)
        finally:
            self.wait_s += time.perf_counter() - t0
        if step.batch.drafts is not None:
            tokens, verified = verified_tokens(step.sampling, step.batch.drafts, token_ids, lps, top)
            return CollectedStep(list(step.batch.reqs), tokens, verified=verified, hidden=step.hidden)
        out: List[SampledToken] = [SampledToken(r, None, None) for r in embedded if not r.finished]
        for i, req in enumerate(step.sampling):
            if req.finished:
                continue
            if req.max_new_tokens == 0:  # it only scores its prompt: the token sampled after it is not wanted
                out.append(SampledToken(req, None, None))
                continue
            tok = token_ids[i]
            out.append(take_token(SampledToken(req, tok, token_logprob(req, tok, i, lps, top))))
        return CollectedStep(list(step.batch.reqs), out, hidden=step.hidden)
