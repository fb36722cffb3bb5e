"""The engine loop: schedule a step, launch it, collect the previous one, turn its tokens into news.

Building the parts is in setup.py, who runs next in scheduler/, the step itself and the overlap protocol in
model_runner.py, the text in text.py. A step that raises does not stop the loop: its requests are retried one by
one, so the request that causes it fails alone with an error its client sees; only a device fault ends the loop.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import logging
import time
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence

from minisrv.batch import ForwardMode
from minisrv.config import EngineConfig, setup_logging
from minisrv.distributed import TensorParallelError, destroy_tensor_parallel
from minisrv.kvcache.radix import RadixCache

from .grammar import GrammarBackend
from .pooling import PoolingParams, embedding_request
from .request import Request, RequestLimits, RequestOutput, SamplingParams, check_request, prompt_logprob_list
from .scheduler import Scheduler
from .scheduler.window import WindowPages
from .setup import build_engine_parts
from .speculative.eagle import EagleProposer
from .speculative.speculator import make_speculator
from .step_results import SampledToken, take_token
from .tp_workers import STOP_AND_TEAR_DOWN, STOP_NOW, build_tensor_parallel_parts
from .text import TextStream, decode_cleans_up

logger = logging.getLogger("minisrv")

COMPILE_IDLE_WAIT_S = 0.002  # with nothing to run but grammars compiling, a step waits this long for one
# on the CPU a long prompt's chunks are sized so that a step takes about this long (scheduler.py's step_target_s):
# a request that arrives beside a long prompt then waits about two such steps for its first token
CPU_STEP_TARGET_S = 0.5


class Engine:
    """Continuous batching over one model. Not thread-safe: one caller drives `step()`."""

    def __init__(self, config: Optional[EngineConfig] = None, *, staged_kernels: bool = False, **kwargs: Any) -> None:
        """staged_kernels: start serving before FlashInfer's kernels are compiled, on kernels that need no compiling,
        and switch to them between two steps once they are (a server's engine: kernel_builds.py). Otherwise the
        engine waits for them, built side by side."""
        cfg = config or EngineConfig(**kwargs)
        self.config = cfg
        setup_logging(cfg.log_level)
        parts = build_tensor_parallel_parts(cfg) if cfg.tp_size > 1 else build_engine_parts(cfg, staged=staged_kernels)
        self.parts = parts  # the model, tokenizer, KV pool and the rest the loop runs on (setup.EngineParts)
        self.runner = parts.runner
        self.staged_kernels = parts.staged_kernels  # None once every kernel asked for serves
        self.workers = parts.workers  # tensor parallelism: ranks 1..N-1 (None with one rank)
        if self.workers is not None:
            atexit.register(self.close, at_exit=True)  # the ranks are not daemons: they must be told to stop
        self.limits = RequestLimits(parts.args.vocab_size, parts.max_request_len)
        self.cache = None if cfg.disable_radix_cache else \
            RadixCache(parts.allocator, parts.page_size, parts.window_allocator)
        # None: one token a step. EAGLE3's proposer reads what the runner keeps of each extend and verify step
        self.drafter = None if parts.draft_head is None else EagleProposer(
            parts.draft_head, parts.runner.model.model.embed_tokens, parts.table.table, parts.pool.num_slots,
            cfg.speculative_num_draft_tokens - 1)
        self.runner.reads_aux = self.drafter is not None
        self.speculator = make_speculator(cfg, parts.device.type, self.drafter)
        self.scheduler = Scheduler(parts.allocator, parts.table, parts.page_size, cfg.max_running_requests,
                                   cfg.max_prefill_tokens, cfg.chunked_prefill_size, self.cache,
                                   step_target_s=CPU_STEP_TARGET_S if parts.device.type == "cpu" else None,
                                   speculator=self.speculator, windows=None if parts.window_rule is None else
                                   WindowPages(parts.window_allocator, parts.table, parts.window_rule, self.cache))
        self.overlap = parts.device.type == "cuda" and not cfg.disable_overlap_schedule
        self.num_free_pages_when_idle = parts.allocator.num_free  # all but the CUDA-graph pad page
        self.peak_pages_used = 0
        self.num_cached_prompt_tokens = 0  # prompt tokens served from the prefix cache, since start
        # structured outputs: grammars compile off the loop; requests wait in the queue until theirs is done
        self.grammar = GrammarBackend(parts.tokenizer, parts.args.vocab_size, parts.eos_ids,
                                      compile_timeout_s=cfg.grammar_compile_timeout)
        self.clean_up = decode_cleans_up(parts.tokenizer)  # as the tokenizer's own decode does (see text.py)
        self._compiling: List[Request] = []

    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: Optional[str] = None) -> Request:
        """Validate and build a request without changing any engine state (raises RequestError). PoolingParams
        make an embedding request, the only kind an embedding model takes (engine/pooling.py)."""
        if isinstance(params, PoolingParams) or self.parts.pooling is not None:
            return embedding_request(prompt_ids, params, self.parts.pooling, self.limits, self.parts.eos_ids, rid)
        max_new = check_request(prompt_ids, params, self.limits)
        return Request(list(prompt_ids), params, max_new, rid, eos_ids=self.parts.eos_ids)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: Optional[str] = None) -> Request:
        return self.add(self.make_request(prompt_ids, params, rid))

    def add(self, req: Request) -> Request:
        """Queue a request built by make_request."""
        p = req.params
        req.text = TextStream(self.parts.tokenizer, req.prompt_ids, p.stop, p.skip_special_tokens, self.clean_up)
        req.grammar = self.grammar.submit(p)  # never waits for the compile (see _grammars_done)
        self.scheduler.add(req)
        if req.grammar is not None:
            self._compiling.append(req)
        return req

    def abort(self, rid: str) -> Optional[RequestOutput]:
        req = self.scheduler.abort(rid)
        if req is None:
            return None
        self._compiling = [r for r in self._compiling if r is not req]
        return RequestOutput.ended(req, "abort")

    def has_work(self) -> bool:
        return self.runner.num_inflight > 0 or self.scheduler.has_work()

    def step(self) -> List[RequestOutput]:
        """Run one scheduled step; returns news for every request that sampled a token or failed.

        With overlap (CUDA), the step launched here runs on the device while the previous step's results are
        processed on the host, so the GPU never waits for the scheduler: the news returned is the previous step's.
        """
        outputs = self._grammars_done() if self._compiling else []
        if self.speculator is not None and self.runner.num_inflight and \
                self.speculator.wants_drafts(self.scheduler.running):
            outputs += self._collect(keep=0)  # drafts are made from every token so far
        batch, launched = None, False
        try:
            batch = self.scheduler.schedule()
            if batch is not None:
                used = self.num_free_pages_when_idle - self.parts.allocator.num_free
                self.peak_pages_used = max(self.peak_pages_used, used)
                t0 = time.perf_counter()
                # penalties count the previous tokens and a grammar's mask needs them accepted: with such a request
                # live, the runner reads the steps in flight back before this one samples
                self.runner.launch(batch, needs_previous_tokens=bool(self.scheduler.num_penalized or
                                                                      self.scheduler.num_constrained))
                self.scheduler.commit(batch)
                launched = True
        except Exception as e:  # noqa: BLE001 - one bad step must not end the engine
            self._check_fatal(e)
            outputs += self._step_failed(batch.reqs if batch is not None else [], e)
        # a verify step is collected at once: what it keeps decides the next step's inputs
        outputs += self._collect(keep=1 if self.overlap and launched and batch.drafts is None else 0)
        if launched and not self.overlap and batch.mode is ForwardMode.EXTEND and batch.drafts is None:
            self.scheduler.extend_took(sum(batch.extend_lens), time.perf_counter() - t0)
        if batch is None and self._compiling and not self.runner.num_inflight:
            # nothing ran but grammars are compiling: wait a moment for one rather than spin
            cf.wait([r.grammar.future for r in self._compiling], COMPILE_IDLE_WAIT_S, cf.FIRST_COMPLETED)
        return outputs

    def switch_kernels(self, idle: bool = False) -> List[RequestOutput]:
        """The one poll of the kernels built since the start (kernel_builds.StagedKernels), made once a turn before
        `step`: once they are built, the steps in flight are collected (their news is returned) and the runner
        switches, so that no step runs across the switch. idle: the engine has had nothing to do for a while."""
        staged = self.staged_kernels
        if staged is None:
            return []
        busy = self.has_work()
        if busy:
            staged.stepping()
        idle = idle and not busy
        if not (staged.sampling_ready() or staged.layers_ready(idle)):
            return []
        outputs = self._collect(keep=0)
        staged.upgrade(self.runner, idle)
        if staged.finished:
            self.staged_kernels = None
        return outputs

    def _check_fatal(self, e: Exception) -> None:
        """Re-raise a failure the engine cannot survive: a CUDA error (it poisons the context) or a lost
        tensor-parallel rank (TensorParallelError, naming the rank)."""
        if self.workers is not None:
            self.workers.check(e)
        if isinstance(e, TensorParallelError) or type(e).__name__ in ("AcceleratorError", "CudaError",
                                                                      "OutOfMemoryError") or "CUDA error" in str(e):
            raise e

    def finish_cache_write(self, timeout: float = 120.0) -> None:
        """Wait for the GGUF cache's writer (a first start writes the dequantised parameters while it already
        serves: checkpoints/loader.py), so that an exit does not cut it and the next start maps the file."""
        if self.parts.cache_write is not None:
            self.parts.cache_write.join(timeout)

    def close(self, at_exit: bool = False) -> None:
        """Stop the tensor-parallel ranks and tear their process group down, so that another engine in this
        process can form one (nothing to do with one rank). The engine runs no step after this. at_exit: the
        process is ending: the ranks just exit (no group teardown, which nothing after needs)."""
        if self.workers is None:
            return
        tp = self.runner.tp
        if at_exit:
            self.workers.stop(lambda: tp.send_object(STOP_NOW), lambda: None)
        else:
            self.runner.release_graphs()  # NCCL's teardown waits for graphs that captured its kernels to go
            self.workers.stop(lambda: tp.send_object(STOP_AND_TEAR_DOWN), lambda: destroy_tensor_parallel(tp))
            atexit.unregister(self.close)
        self.workers = None

    def _grammars_done(self) -> List[RequestOutput]:
        """Requests whose grammar finished compiling become schedulable; a failed compile, or one past its
        deadline, ends its request."""
        outputs, still = [], []
        for r in self._compiling:
            if r.finished:
                continue  # aborted while compiling
            error = r.grammar.poll()
            if error is not None:
                logger.info("request %s: %s", r.rid, error)
                self.scheduler.finish(r, "error")
                outputs.append(RequestOutput.ended(r, "error", error=str(error), error_param=error.param))
            elif not r.grammar.ready:
                still.append(r)
        self._compiling = still
        return outputs

    def _collect(self, keep: int) -> List[RequestOutput]:
        """News of the launched steps, oldest first, until `keep` remain in flight."""
        outputs: List[RequestOutput] = []
        while self.runner.num_inflight > keep:
            step = self.runner.collect()
            if step.error is not None:
                self._check_fatal(step.error)
                outputs += self._step_failed(step.reqs, step.error)
                continue
            for req, drafted, kept in step.verified:
                if not req.finished:
                    self.scheduler.verified(req, drafted, kept)
            if step.verified:
                self.speculator.stats.verify_steps += 1
            for s in step.tokens:
                if not s.appended:  # a verified token: it joins its request unless an earlier one ended it
                    if s.req.finished:
                        continue
                    take_token(s)
                try:
                    if s.error is not None:  # its grammar rejected the token
                        outputs += self._fail([s.req], s.error)
                    else:
                        outputs.append(self._news(s))
                except Exception as e:  # noqa: BLE001 - e.g. a tokenizer that cannot decode the token
                    outputs += self._fail([s.req], e)
            if step.hidden is not None and self.drafter is not None:  # once the step's tokens joined
                self.drafter.absorb(step.hidden)
        return outputs

    def _news(self, s: SampledToken) -> RequestOutput:
        """Apply the finish checks to a request's new token and say what it adds."""
        req, tok = s.req, s.token_id
        req.solo = False  # it ran a step to the end
        p, text = req.params, req.text
        num_out = len(req.output_ids)
        offset = text.length
        reason = None
        if tok is None:  # max_tokens 0: the prompt is scored, or embedded (its vector is ready); nothing generated
            text.finish()
            reason = "length" if req.embedding is None else "stop"
            self.scheduler.finish(req, reason)
            self.num_cached_prompt_tokens += req.num_cached_tokens
            return RequestOutput.ended(req, reason, num_cached_tokens=req.num_cached_tokens,
                                       prompt_logprobs=prompt_logprob_list(req),
                                       embedding=req.embedding.vector if req.embedding is not None else None)
        if s.grammar_ended or tok in p.stop_token_ids or (not p.ignore_eos and tok in req.eos_ids):
            reason = "stop"  # the token that ends it has no text (a grammar ends on accepting a stop token)
        elif text.add(tok) is not None:
            reason = "stop"
        elif num_out >= req.max_new_tokens:
            reason = "length"
        if num_out == 1:
            self.num_cached_prompt_tokens += req.num_cached_tokens
        if reason is not None:
            text.finish()
            self.scheduler.finish(req, reason)
        return RequestOutput.token(req, token_id=tok, text=text.take(), logprob=s.logprob, offset=offset,
                                   reason=reason, prompt_logprobs=prompt_logprob_list(req) if num_out == 1 else None)

    def _step_failed(self, reqs: List[Request], e: Exception) -> List[RequestOutput]:
        """A step raised. A request running alone is the cause: it fails. Otherwise each is retried alone."""
        live = list({id(r): r for r in reqs if not r.finished}.values())
        if len(live) == 1 and live[0].solo:
            return self._fail(live, e)
        logger.warning("a step of %d requests failed (%s: %s); retrying them one at a time",
                       len(live), type(e).__name__, e)
        for r in live:
            self.scheduler.isolate(r)
        return []

    def _fail(self, reqs: List[Request], e: Exception) -> List[RequestOutput]:
        logger.error("request(s) %s failed: %s: %s", ", ".join(r.rid for r in reqs), type(e).__name__, e)
        outs = []
        for r in reqs:
            self.scheduler.finish(r, "error")
            outs.append(RequestOutput.ended(r, "error", error=f"{type(e).__name__}: {e}"))
        return outs

    def flush_cache(self) -> bool:
        """Empty the prefix cache; only while no request is queued or running (returns whether it did)."""
        return not self.has_work() and self.scheduler.cache.flush()

    def stats(self) -> Dict[str, Any]:
        """kv_pages_used counts pages requests hold; pages only the prefix cache holds are free for the taking."""
        used = self.num_free_pages_when_idle - self.scheduler.cache.available_pages()
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_pages_used": used,
            "kv_pages_total": self.num_free_pages_when_idle,
            "kv_usage": used / self.num_free_pages_when_idle,
            "num_retractions": self.scheduler.num_retractions,
            "cache_tokens": self.cache.num_tokens if self.cache is not None else 0,
            "cached_prompt_tokens": self.num_cached_prompt_tokens,
            **({f"spec_{k}": v for k, v in asdict(self.speculator.stats).items()} if self.speculator else {}),
        }
