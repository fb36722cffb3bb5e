"""The engine loop that ties model, pool, scheduler, runner and sampler together, and the offline LLM class."""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from minisrv.attention import create_backend, resolve_backend
from minisrv.config import DEFAULT_CPU_POOL_TOKENS, EngineConfig
from minisrv.models.layers import enable_fused_ops
from minisrv.models.loader import load_model, load_model_args, load_tokenizer, resolve_model_path

from .detokenizer import IncrementalDetokenizer, find_stop
from .kv_cache import KVPool, PageAllocator, ReqToTokenTable
from .model_runner import ModelRunner
from .request import CompletionOutput, Request, RequestOutput, RequestStatus, SamplingParams, TokenLogprob
from .scheduler import Scheduler

logger = logging.getLogger("minisrv")

GiB = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def setup_logging(level: str) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("minisrv").setLevel(level.upper())


def resolve_device(cfg: EngineConfig) -> torch.device:
    if cfg.device:
        return torch.device(cfg.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str, checkpoint_dtype: Optional[str], device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(checkpoint_dtype or "", torch.bfloat16)


class Engine:
    """Continuous batching over one model. Not thread-safe: one caller drives `step()`."""

    def __init__(self, config: Optional[EngineConfig] = None, **kwargs: Any) -> None:
        cfg = config or EngineConfig(**kwargs)
        self.config = cfg
        setup_logging(cfg.log_level)
        t0 = time.perf_counter()
        self.device = resolve_device(cfg)
        self.model_path = resolve_model_path(cfg.model)
        self.args = load_model_args(self.model_path)
        self.backend_name = resolve_backend(cfg.attention_backend, self.device)  # fail before loading weights
        self.tokenizer = load_tokenizer(self.model_path, cfg.tokenizer)
        eos = set(self.args.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = sorted(eos)
        self.context_length = cfg.context_length or self.args.max_position_embeddings
        window = self.args.sliding_window
        if window is not None and self.context_length > window:
            # attention is full over the whole context here: exact only while sequences fit in the window
            if cfg.context_length:
                raise ValueError(f"context length {cfg.context_length} is over the model's sliding window of "
                                 f"{window} tokens; sliding-window attention is not supported, so the context "
                                 f"length can be at most {window}")
            logger.warning("the model uses sliding-window attention (%d tokens), which is not supported: "
                           "context length limited to %d", window, window)
            self.context_length = window
        self.dtype = resolve_dtype(cfg.dtype, self.args.torch_dtype, self.device)
        self.page_size = cfg.page_size or (16 if self.device.type == "cuda" else 1)
        self.model = load_model(self.model_path, self.args, self.dtype, self.device, self.context_length)
        fused = enable_fused_ops(self.device)
        t_load = time.perf_counter() - t0

        a = self.args
        per_token = KVPool.bytes_per_token(a.num_layers, a.num_kv_heads, a.head_dim, self.dtype)
        tokens = cfg.max_total_tokens or self._auto_pool_tokens(per_token)
        ps = self.page_size
        num_pages = max(1, tokens // ps)
        self.pool = KVPool(a.num_layers, num_pages, ps, a.num_kv_heads, a.head_dim, self.dtype, self.device)
        self.allocator = PageAllocator(num_pages)
        # one spare row: CUDA-graph padding rows point at it
        self.table = ReqToTokenTable(cfg.max_running_requests + 1, self.context_length, self.device)
        self.pad_row = self.table.alloc_row()
        self.pad_page: Optional[int] = None
        self.peak_pages_used = 0
        self._pending = None  # a launched step whose results are not yet processed
        self.wait_s = 0.0  # host time spent waiting for the device's results (GPU-bound share of a run)
        self.overlap = self.device.type == "cuda" and not cfg.disable_overlap_schedule
        self.max_request_len = min(self.context_length, self.pool.num_slots)
        self.backend = create_backend(self.backend_name, self.pool, self.table.table, a.num_heads)
        graph_runner = None
        if self.device.type == "cuda" and not cfg.disable_cuda_graph and self.backend.supports_cuda_graph:
            # CUDA-graph padding rows write their dummy K/V into a page of their own
            self.pad_page = self.allocator.alloc(1)[0]
            self.table.table[self.pad_row, :ps] = torch.arange(ps, dtype=torch.int32) + self.pad_page * ps
            self.max_request_len = min(self.context_length, self.pool.num_slots - ps)
            from .cuda_graph import CudaGraphRunner, default_max_bs
            max_bs = min(cfg.cuda_graph_max_bs or default_max_bs(self.device), cfg.max_running_requests)
            graph_runner = CudaGraphRunner(self.model, self.backend, self.pad_row, self.pad_page * ps, max_bs,
                                           self.context_length, self.device)
        self.runner = ModelRunner(self.model, self.backend, self.pool, self.table, self.device, graph_runner)
        self.scheduler = Scheduler(self.allocator, self.table, ps, cfg.max_running_requests,
                                   cfg.max_prefill_tokens, cfg.chunked_prefill_size)
        logger.info("model %s (%s, %s) on %s loaded in %.1fs%s", self.model_path, a.architecture,
                    str(self.dtype).replace("torch.", ""), self.device, t_load, "; fused ops on" if fused else "")
        logger.info("KV pool: %d tokens (%d pages of %d), %.2f GiB; context length %d; attention backend %s",
                    self.pool.num_slots, num_pages, ps, self.pool.nbytes / GiB, self.context_length,
                    self.backend_name)

    def _auto_pool_tokens(self, per_token: int) -> int:
        if self.device.type != "cuda":
            return DEFAULT_CPU_POOL_TOKENS
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        peak = self._activation_peak()
        budget = min(total * self.config.mem_fraction_static - weights, free - peak - GiB)
        if budget < per_token * 4096:
            raise MemoryError(f"not enough GPU memory for a KV pool: {budget / GiB:.2f} GiB left after weights "
                              f"({weights / GiB:.2f} GiB) and activations ({peak / GiB:.2f} GiB)")
        logger.info("GPU memory: total %.1f GiB, weights %.2f GiB, activation peak %.2f GiB",
                    total / GiB, weights / GiB, peak / GiB)
        return int(budget // per_token)

    @torch.inference_mode()
    def _activation_peak(self) -> int:
        """Bytes a largest prefill step needs beyond weights, measured by running one on a throwaway pool."""
        from minisrv.attention.base import ForwardBatch, ForwardMode, ceil_div
        a, cfg = self.args, self.config
        n = min(cfg.chunked_prefill_size, cfg.max_prefill_tokens, self.context_length)
        ps = self.page_size
        pages = ceil_div(n, ps) + 1
        pool = KVPool(a.num_layers, pages, ps, a.num_kv_heads, a.head_dim, self.dtype, self.device)
        table = torch.zeros((1, self.context_length), dtype=torch.int32, device=self.device)
        table[0, :n] = torch.arange(n, dtype=torch.int32, device=self.device)
        backend = create_backend(self.backend_name, pool, table, a.num_heads)
        dev = self.device
        fb = ForwardBatch(ForwardMode.EXTEND, torch.zeros(n, dtype=torch.int64, device=dev),
                          torch.arange(n, device=dev), torch.arange(n, device=dev),
                          torch.zeros(1, dtype=torch.int64, device=dev),
                          torch.tensor([n], dtype=torch.int32, device=dev),
                          torch.tensor([0, n], dtype=torch.int32, device=dev),
                          torch.tensor([n - 1], device=dev), [n], [n], n)
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        backend.prepare(fb)
        self.model.compute_logits(self.model(fb.input_ids, fb.positions, backend)[fb.last_indices])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        del pool, backend, table, fb
        torch.cuda.empty_cache()
        return peak

    # ------------------------------------------------------------------ requests
    def make_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: Optional[str] = None) -> Request:
        """Validate and build a request without changing any engine state (raises ValueError)."""
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.args.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        params.validate()
        limit = self.max_request_len
        n = len(prompt_ids)
        if params.max_tokens is None:
            if n >= limit:
                raise ValueError(f"prompt has {n} tokens, at or over the maximum context length of {limit} tokens")
            max_new = limit - n
        else:
            max_new = params.max_tokens
            if n + max_new > limit:
                raise ValueError(f"prompt ({n} tokens) plus max_tokens ({max_new}) is {n + max_new} tokens, "
                                 f"over the maximum context length of {limit} tokens")
        kw = {"rid": rid} if rid is not None else {}
        return Request(prompt_ids, params, max_new, eos_ids=self.eos_ids, **kw)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, rid: Optional[str] = None) -> Request:
        return self.add(self.make_request(prompt_ids, params, rid))

    def add(self, req: Request) -> Request:
        """Queue a request built by make_request."""
        if req.rid in self.scheduler.by_id:
            raise ValueError(f"duplicate request id {req.rid!r}")
        if req.params.stop:
            req._detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.params.skip_special_tokens)
        self.scheduler.add(req)
        return req

    def abort(self, rid: str) -> Optional[RequestOutput]:
        req = self.scheduler.abort(rid)
        if req is None:
            return None
        while req.output_ids and req.output_ids[-1] < 0:
            req.output_ids.pop()  # a token still on its way from the device
        return RequestOutput(req.rid, [], [], True, "abort", None, len(req.prompt_ids), len(req.output_ids))

    def has_work(self) -> bool:
        return self._pending is not None or self.scheduler.has_work()

    # ------------------------------------------------------------------ the loop
    def step(self) -> List[RequestOutput]:
        """Run one scheduled step; returns news for every request that sampled a token.

        With overlap (CUDA), the step scheduled and launched here runs on the device while the previous step's
        results are processed on the host, so the GPU never waits for the scheduler: the news returned is the
        previous step's, and a decode input whose token is still being sampled is a placeholder the device
        fills in (see ModelRunner.build_forward_batch).
        """
        prof = self.runner.timings
        outputs: List[RequestOutput] = []
        if self._pending is not None and self.scheduler.num_penalized:
            outputs = self._process(self._take_pending())  # penalties count the actual previous tokens
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        launched = None
        if batch is not None:
            if prof is not None:
                prof["schedule"] += time.perf_counter() - t0
            self.peak_pages_used = max(self.peak_pages_used,
                                       self.num_free_pages_when_idle - self.allocator.num_free)
            prev = self._pending.ids if self._pending is not None else None
            launched = self.runner.launch(batch, prev)
            self.scheduler.commit(batch)
            placeholders = []
            k = 0
            for req, sampled in zip(batch.reqs, batch.samples):
                if sampled:
                    placeholders.append(len(req.output_ids))
                    req.output_ids.append(-(k + 1))  # the token is on its way from the device
                    k += 1
            launched.positions = placeholders
        if self._pending is not None:
            outputs += self._process(self._take_pending())
        self._pending = launched
        if launched is not None and not self.overlap:
            outputs += self._process(self._take_pending())
        return outputs

    def _take_pending(self):
        p, self._pending = self._pending, None
        return p

    def _process(self, launched) -> List[RequestOutput]:
        """Write a launched step's sampled tokens into its requests and apply the finish checks."""
        t0 = time.perf_counter()
        result = launched.result()
        t1 = time.perf_counter()
        self.wait_s += t1 - t0
        t0 = t1
        outputs: List[RequestOutput] = []
        batch = launched.batch
        reqs = batch.reqs if len(launched.positions) == len(batch.reqs) else \
            [r for r, s in zip(batch.reqs, batch.samples) if s]
        token_ids, lp_rows = result.token_ids, result.logprobs
        for i, (req, pos) in enumerate(zip(reqs, launched.positions)):
            if req.status is RequestStatus.FINISHED:
                continue  # finished or aborted while this step was on the device
            tok = token_ids[i]
            req.output_ids[pos] = tok
            lps: List[TokenLogprob] = []
            if lp_rows is not None and req.params.logprobs is not None:
                top: Dict[int, float] = {}
                n_top = req.params.logprobs
                if n_top > 0 and result.top_logprobs is not None:
                    vals, ids = result.top_logprobs
                    top = dict(zip(ids[i][:n_top], vals[i][:n_top]))
                lps.append(TokenLogprob(tok, lp_rows[i], top))
                req.logprobs.extend(lps)
            reason = self._check_finish(req, tok, pos + 1)
            if reason is not None:
                del req.output_ids[pos + 1:]  # a token sampled after the end is dropped
                self.scheduler.finish(req, reason)
                outputs.append(RequestOutput(req.rid, [tok], lps, True, reason, req.stop_str,
                                             len(req.prompt_ids), pos + 1))
            else:
                outputs.append(RequestOutput(req.rid, [tok], lps, False, None, None, len(req.prompt_ids), pos + 1))
        if self.runner.timings is not None:
            self.runner.timings["postprocess"] += time.perf_counter() - t0
        return outputs

    def _check_finish(self, req: Request, tok: int, num_out: int) -> Optional[str]:
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in req.eos_ids):
            return "stop"
        if req._detok is not None:
            start = len(req.text)
            req.text += req._detok.add([tok])
            hit = find_stop(req.text, start, p.stop)
            if hit is not None:
                req.text = req.text[:hit[0]]
                req.stop_str = hit[1]
                return "stop"
        if num_out >= req.max_new_tokens:
            return "length"
        return None

    @property
    def num_free_pages_when_idle(self) -> int:
        """Pages free when no request is resident (all but the CUDA-graph pad page)."""
        return self.allocator.num_pages - (1 if self.pad_page is not None else 0)

    def stats(self) -> Dict[str, Any]:
        used = self.num_free_pages_when_idle - self.allocator.num_free
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_pages_used": used,
            "kv_pages_total": self.num_free_pages_when_idle,
            "kv_usage": used / self.num_free_pages_when_idle,
            "num_retractions": self.scheduler.num_retractions,
        }


PromptType = Union[str, List[int]]


class LLM:
    """Offline batch generation: `LLM().generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: Optional[str] = None, attention_backend: str = "auto", **kwargs: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, attention_backend=attention_backend, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def _encode(self, prompt: PromptType) -> List[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt).input_ids
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True) -> List[CompletionOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self._encode(p) for p in prompts]
        eng = self.engine
        reqs = [eng.make_request(i, p) for i, p in zip(ids, params)]  # all validated before any is queued
        for r in reqs:
            eng.add(r)
        live = {r.rid for r in reqs}
        bar = None
        if use_tqdm and len(reqs) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(reqs), desc="generate", unit="req")
        try:
            while live:
                for out in eng.step():
                    if out.finished and out.rid in live:
                        live.discard(out.rid)
                        if bar is not None:
                            bar.update(1)
                if not eng.has_work() and live:
                    raise RuntimeError(f"engine stopped with {len(live)} unfinished requests")
        except BaseException:
            for rid in live:
                eng.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        texts = self.texts_of(reqs)
        return [CompletionOutput(
            prompt=p if isinstance(p, str) else None,
            prompt_token_ids=r.prompt_ids,
            text=t,
            token_ids=list(r.output_ids),
            finish_reason=r.finish_reason,
            logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
        ) for p, r, t in zip(prompts, reqs, texts)]

    @staticmethod
    def _text_ids(req: Request) -> List[int]:
        """The output ids that make up the text: a final stop or eos token is not part of it."""
        ids = req.output_ids
        if req.finish_reason == "stop" and ids and (ids[-1] in req.params.stop_token_ids or ids[-1] in req.eos_ids):
            ids = ids[:-1]
        return ids

    def texts_of(self, reqs: Sequence[Request]) -> List[str]:
        """Output texts, decoded in one batch per skip_special_tokens setting (the Rust tokenizer decodes a
        batch in parallel); the same strings as tokenizer.decode one by one."""
        texts: List[Optional[str]] = [r.text if r.stop_str is not None else None for r in reqs]
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        for skip in (True, False):
            todo = [i for i, r in enumerate(reqs) if texts[i] is None and r.params.skip_special_tokens == skip]
            if not todo:
                continue
            ids = [self._text_ids(reqs[i]) for i in todo]
            if backend is not None and len(todo) > 1:
                out = backend.decode_batch(ids, skip_special_tokens=skip)
                if self.tokenizer.clean_up_tokenization_spaces:
                    out = [self.tokenizer.clean_up_tokenization(t) for t in out]
            else:
                out = [self.tokenizer.decode(x, skip_special_tokens=skip) for x in ids]
            for i, t in zip(todo, out):
                texts[i] = t
        return texts

    def chat(self, messages: Union[List[Dict[str, str]], List[List[Dict[str, str]]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             use_tqdm: bool = True) -> List[CompletionOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.encode_chat(c) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def encode_chat(self, messages: List[Dict[str, str]]) -> List[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids
