"""The OpenAI-compatible HTTP API: routes, SSE streaming, errors in OpenAI's shape, Prometheus metrics.

Tokenizing (and chat templating) and detokenizing happen here, on the HTTP side; the engine process sees only
token ids (see engine_proc.py). Every request is validated before it reaches the engine: types and ranges by the
pydantic schemas, the prompt plus max_tokens against the context length here.

Model names: the server answers to its served model name (`--served-model-name`, default: the basename of the
model path, e.g. `SmolLM2-135M-Instruct.Q4_1.gguf`), and also to the model path as given on the command line
and as resolved, so clients that pass the path (as with SGLang/vLLM) work too. A request without `model` goes to
the one model; any other name is a 404 (`model_not_found`).

Disconnects: a client that goes away (streaming or not) gets its requests aborted in the engine, which frees
their KV pages. With an API key, every route but /health needs `Authorization: Bearer <key>`.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple, Union

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisrv.engine.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_len
from minisrv.engine.request import RequestOutput, SamplingParams, TokenLogprob

from .engine_proc import EngineClient, EngineDead, EngineError, EngineInfo
from .protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                       ChatLogprobs, ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob, CompletionChoice,
                       CompletionChunk, CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage,
                       ErrorInfo, ErrorResponse, ModelCard, ModelList, TopLogprob, UsageInfo, now)

logger = logging.getLogger("minisrv.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
ASYNC_ENCODE_CHARS = 16384  # longer texts are tokenized in a worker thread to keep the event loop responsive
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


# ---------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(exc: Union[RequestValidationError, ValidationError]) -> Tuple[str, Optional[str]]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        return f"request body is not valid JSON{': ' + str(detail) if detail else ''}", None
    msg = str(e.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    param = loc[0] if loc else None
    where = ".".join(loc)
    more = f" (and {len(errs) - 1} more error{'s' if len(errs) > 2 else ''})" if len(errs) > 1 else ""
    return (f"{where}: {msg}" if where else f"request body: {msg}") + more, param


async def _parse_body(request: Request, schema: type) -> Any:
    """JSON body -> schema, whatever the Content-Type says (curl -d sends form encoding by default)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        msg, param = _validation_message(e)
        raise APIError(400, msg, param=param) from None


# ---------------------------------------------------------------------------------------------- metrics
class ServerMetrics:
    """Prometheus metrics in a registry of their own (several apps can live in one process, e.g. in tests)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("minisrv_requests", "HTTP requests to /v1 routes, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("minisrv_request_finish", "Engine requests (one per choice) by finish reason",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("minisrv_prompt_tokens", "Prompt tokens sent to the engine", registry=r)
        self.generation_tokens = Counter("minisrv_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("minisrv_num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("minisrv_num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("minisrv_kv_cache_usage_ratio", "Share of KV pool pages in use (0..1)", registry=r)
        self.kv_pages_used = Gauge("minisrv_kv_cache_pages_used", "KV pool pages in use", registry=r)
        self.kv_pages_total = Gauge("minisrv_kv_cache_pages_total", "KV pool pages", registry=r)
        self.ttft = Histogram("minisrv_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("minisrv_inter_token_latency_seconds", "Time between consecutive output tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("minisrv_e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=LATENCY_BUCKETS, registry=r)

    def set_engine_stats(self, stats: Dict[str, Any]) -> None:
        if not stats:
            return
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        self.kv_usage.set(stats.get("kv_usage", 0.0))
        self.kv_pages_used.set(stats.get("kv_pages_used", 0))
        self.kv_pages_total.set(stats.get("kv_pages_total", 0))


_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


# ---------------------------------------------------------------------------------------------- token text
def _byte_decoder() -> Dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet (each byte 0..255 is shown as one printable character)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Token id -> (display string, raw bytes) for logprobs, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.cache: Dict[int, Tuple[str, List[int]]] = {}
        pieces = tokenizer.convert_ids_to_tokens(tokenizer(" a", add_special_tokens=False).input_ids)
        self.byte_level = bool(pieces) and pieces[0].startswith("Ġ")
        self.decoder = _byte_decoder() if self.byte_level else {}

    def get(self, tid: int) -> Tuple[str, List[int]]:
        hit = self.cache.get(tid)
        if hit is not None:
            return hit
        piece = self.tok.convert_ids_to_tokens(tid)
        raw: Optional[bytes] = None
        if isinstance(piece, str):
            if self.byte_level and all(c in self.decoder for c in piece):
                raw = bytes(self.decoder[c] for c in piece)
            elif not self.byte_level:
                if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    raw = bytes([int(piece[3:5], 16)])
                else:
                    raw = piece.replace("▁", " ").encode("utf-8")
        if raw is None:
            raw = self.tok.decode([tid]).encode("utf-8")
        hit = (raw.decode("utf-8", errors="replace"), list(raw))
        self.cache[tid] = hit
        return hit


# ---------------------------------------------------------------------------------------------- server state
@dataclass
class ServerState:
    """What the routes share. tokenizer and info are None while the engine loads (every /v1 route is a 503)."""

    client: EngineClient
    served_model_name: str
    tokenizer: Any = None
    info: Optional[EngineInfo] = None
    model_aliases: Sequence[str] = ()
    api_key: Optional[str] = None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=now)
    token_text: Optional[TokenText] = None

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.info is not None:
            self.attach(self.tokenizer, self.info)

    def attach(self, tokenizer: Any, info: EngineInfo) -> None:
        """The engine is up: from now on requests are served."""
        self.tokenizer, self.info = tokenizer, info
        self.token_text = TokenText(tokenizer)

    @property
    def ready(self) -> bool:
        return self.info is not None and self.client.ready and not self.client.dead

    def check_model(self, name: Optional[str]) -> None:
        if name is None or name == self.served_model_name or name in self.model_aliases:
            return
        raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.served_model_name}`.",
                       param="model", code="model_not_found")


# ---------------------------------------------------------------------------------------------- one choice
class _Choice:
    """Text of one choice as it streams: incremental detokenizing, stop-string cut, held-back partial stops."""

    def __init__(self, index: int, tokenizer: Any, prompt_ids: List[int], params: SamplingParams,
                 prefix: str = "") -> None:
        self.index = index
        self.stops = list(params.stop or [])
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.prefix = prefix  # echoed prompt text, sent before the first token
        self.text = ""  # generated text so far (cut at the stop string when finished)
        self.sent = 0  # characters of self.text already emitted
        self.logprobs: List[Tuple[TokenLogprob, int]] = []  # with each token's offset in self.text
        self.finish_reason: Optional[str] = None
        self.num_prompt_tokens = len(prompt_ids)
        self.num_output_tokens = 0

    def feed(self, out: RequestOutput) -> Tuple[str, List[Tuple[TokenLogprob, int]]]:
        """Take one step's output; return the text that can be emitted now and the step's token logprobs."""
        ids, lps = out.new_token_ids, out.new_logprobs
        if out.finished and out.finish_reason == "stop" and out.stop_str is None and ids:
            ids = ids[:-1]  # the EOS / stop token that ended it has no text
        new_lps: List[Tuple[TokenLogprob, int]] = []
        for i, tid in enumerate(ids):
            offset = len(self.text)
            self.text += self.detok.add([tid])
            if i < len(lps):
                new_lps.append((lps[i], offset))
        self.logprobs.extend(new_lps)
        self.num_output_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            if out.stop_str is not None:
                hit = find_stop(self.text, self.sent, self.stops or [out.stop_str])
                if hit is not None:
                    self.text = self.text[:hit[0]]
            else:
                self.text += self.detok.flush()
            end = len(self.text)
        else:
            end = len(self.text) - (partial_stop_len(self.text, self.stops) if self.stops else 0)
        end = max(end, self.sent)
        delta = self.text[self.sent:end]
        self.sent = end
        return delta, new_lps


@dataclass
class _Job:
    """One engine request: one choice of one prompt."""

    index: int
    rid: str
    prompt_ids: List[int]
    params: SamplingParams
    t_arrival: float = 0.0
    t_last: float = 0.0
    num_tokens: int = 0


async def _run_jobs(state: ServerState, jobs: List[_Job]) -> AsyncIterator[List[Tuple[int, RequestOutput]]]:
    """Submit all jobs; yield each engine step's outputs as (choice index, output). Aborts what is left on exit
    (a cancelled or closed generator: the client went away), never awaiting in that path."""
    client, m = state.client, state.metrics
    sink: asyncio.Queue = asyncio.Queue()
    pending: Dict[str, _Job] = {}
    by_index = {j.index: j for j in jobs}
    try:
        for j in jobs:
            j.t_arrival = time.perf_counter()
            client.submit(j.rid, j.prompt_ids, j.params, sink, j.index)
            pending[j.rid] = j
            m.prompt_tokens.inc(len(j.prompt_ids))
        while pending:
            items = [await sink.get()]
            while not sink.empty():
                items.append(sink.get_nowait())
            batch: List[Tuple[int, RequestOutput]] = []
            t = time.perf_counter()
            for index, item in items:
                j = by_index[index]
                if isinstance(item, Exception):  # refused by the engine, or the engine is gone
                    pending.pop(j.rid, None)
                    m.finished.labels(reason="error").inc()
                    raise item
                k = len(item.new_token_ids)
                if k:
                    m.generation_tokens.inc(k)
                    if j.num_tokens == 0:
                        m.ttft.observe(t - j.t_arrival)
                    else:
                        gap = (t - j.t_last) / k
                        for _ in range(k):
                            m.itl.observe(gap)
                    j.num_tokens += k
                    j.t_last = t
                if item.finished:
                    pending.pop(j.rid, None)
                    m.finished.labels(reason=item.finish_reason or "unknown").inc()
                    m.e2e.observe(t - j.t_arrival)
                batch.append((index, item))
            yield batch
    finally:
        for rid in list(pending):
            client.abort(rid)
            m.finished.labels(reason="abort").inc()


# ---------------------------------------------------------------------------------------------- disconnects
async def _wait_disconnect(receive: Callable) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, coro: Any) -> Any:
    """Run coro; if the client disconnects first, cancel it (its cleanup aborts the engine requests)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone; nothing to report to
        pass
    raise ClientGone()


class EventStream(StreamingResponse):
    """SSE response that stops (and closes its generator, aborting the engine requests) when the client leaves,
    also while the request is still queued and nothing is being written."""

    def __init__(self, gen: AsyncIterator[str]) -> None:
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.gen = gen

    async def __call__(self, scope: Any, receive: Callable, send: Callable) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def pump() -> None:
                    try:
                        await send({"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
                        async for chunk in self.gen:
                            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(pump)
                await _wait_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.gen.aclose()  # type: ignore[attr-defined]


def _sse(obj: Any) -> str:
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------- request -> jobs
def _sampling_params(body: Any, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
    kw: Dict[str, Any] = dict(max_tokens=max_tokens, logprobs=logprobs, stop=body.stop,
                              stop_token_ids=body.stop_token_ids, ignore_eos=bool(body.ignore_eos),
                              skip_special_tokens=body.skip_special_tokens is not False, seed=body.seed)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        v = getattr(body, name)
        if v is not None:
            kw[name] = v
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _check_common(state: ServerState, body: Any) -> None:
    state.check_model(body.model)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")


def _check_ids(state: ServerState, ids: List[int], param: str) -> None:
    if not ids:
        raise APIError(400, "the prompt is empty", param=param)
    vocab = state.info.vocab_size
    if any(t < 0 or t >= vocab for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", param=param)


def _check_length(state: ServerState, n_prompt: int, max_tokens: Optional[int], param: str) -> None:
    limit = state.info.max_request_len
    if max_tokens is None:
        if n_prompt >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt has "
                                f"{n_prompt} tokens, which leaves no room for a completion.", param=param,
                           code="context_length_exceeded")
    elif n_prompt + max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the "
                            f"completion). Please reduce the prompt or max_tokens.", param="max_tokens",
                       code="context_length_exceeded")


async def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> List[int]:
    if len(text) > ASYNC_ENCODE_CHARS:
        return await asyncio.to_thread(lambda: tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


def _make_jobs(prefix: str, prompts: List[List[int]], n: int, params: SamplingParams) -> List[_Job]:
    jobs = []
    for p, ids in enumerate(prompts):
        for j in range(n):
            # with a seed and n > 1, choice j samples with seed + j: choices differ yet are reproducible
            pj = dataclasses.replace(params, seed=params.seed + j) if params.seed is not None and j else params
            index = p * n + j
            jobs.append(_Job(index, f"{prefix}-{index}", ids, pj))
    return jobs


def _usage(prompts: List[List[int]], choices: Sequence[_Choice]) -> UsageInfo:
    p = sum(len(x) for x in prompts)
    c = sum(ch.num_output_tokens for ch in choices)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _engine_failure(e: Exception) -> APIError:
    if isinstance(e, EngineError):
        return APIError(400, str(e))
    return APIError(503, str(e) or "the engine is not available", type="server_error", code="engine_unavailable")


async def _sse_stream(chunks: AsyncIterator[str], usage: Optional[Callable[[], Any]]) -> AsyncIterator[str]:
    """A stream's chunks, then the usage chunk (when asked for) and [DONE]; an engine failure on the way becomes an
    error event followed by [DONE]. Closing this closes `chunks` (which aborts its engine requests)."""
    async with contextlib.aclosing(chunks):
        try:
            async for c in chunks:
                yield c
        except (EngineError, EngineDead) as e:
            yield _sse_failure(e)
            yield SSE_DONE
            return
    if usage is not None:
        yield _sse(usage())
    yield SSE_DONE


def _sse_failure(e: Exception) -> str:
    """An engine failure in the middle of a stream, as an SSE error event."""
    err = _engine_failure(e)
    return _sse(ErrorResponse(error=ErrorInfo(message=err.message, type=err.type, code=err.code)))


async def _collect(request: Request, state: "ServerState", jobs, choices: Sequence["_Choice"]) -> None:
    """Run a non-streaming request's jobs to the end, feeding each choice; abort if the client goes away."""
    async def collect() -> None:
        async for batch in _run_jobs(state, jobs):
            for index, out in batch:
                choices[index].feed(out)

    try:
        await _unless_disconnected(request, collect())
    except (EngineError, EngineDead) as e:
        raise _engine_failure(e) from None


# ---------------------------------------------------------------------------------------------- logprob shapes
def _completion_logprobs(state: ServerState, lps: Sequence[Tuple[TokenLogprob, int]], base: int,
                         top_n: int) -> CompletionLogprobs:
    tt = state.token_text
    out = CompletionLogprobs()
    for lp, offset in lps:
        out.tokens.append(tt.get(lp.token_id)[0])
        out.token_logprobs.append(lp.logprob)
        top = {tt.get(t)[0]: v for t, v in list(lp.top.items())[:top_n]}
        top.setdefault(tt.get(lp.token_id)[0], lp.logprob)  # OpenAI: the sampled token is always included
        out.top_logprobs.append(top)
        out.text_offset.append(base + offset)
    return out


def _chat_logprobs(state: ServerState, lps: Sequence[Tuple[TokenLogprob, int]], top_n: int) -> ChatLogprobs:
    tt = state.token_text
    content = []
    for lp, _ in lps:
        s, b = tt.get(lp.token_id)
        tops = sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(ChatTokenLogprob(token=s, logprob=lp.logprob, bytes=b, top_logprobs=[
            TopLogprob(token=tt.get(t)[0], logprob=v, bytes=tt.get(t)[1]) for t, v in tops]))
    return ChatLogprobs(content=content)


# ---------------------------------------------------------------------------------------------- the app
def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="minisrv", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.minisrv = state
    m = state.metrics

    # ------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        msg, param = _validation_message(e)
        return error_response(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; recorded in the metrics as 499

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal server error: {type(e).__name__}: {e}", "server_error")

    # ------------------------------------------------------------ auth + request counting (pure ASGI)
    app.add_middleware(_Gate, state=state)

    # ------------------------------------------------------------ routes
    @app.get("/health")
    async def health() -> Response:
        if state.ready:
            return JSONResponse({"status": "ok"})
        return error_response(503, "the engine is not ready", "server_error", code="engine_unavailable")

    @app.get("/metrics")
    async def metrics() -> Response:
        m.set_engine_stats(await state.client.fresh_stats())
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[_model_card(state)])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        state.check_model(model)
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _completions(state, await _parse_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _chat(state, await _parse_body(request, ChatCompletionRequest), request)

    return app


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.served_model_name, created=state.created, root=state.info.model_path,
                     max_model_len=state.info.context_length)


class _Gate:
    """API-key check (all routes but /health) and the request counter by endpoint and status code."""

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Any, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        key = self.state.api_key
        if key and path != "/health" and not self._authorized(scope, key):
            resp = error_response(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                  code="invalid_api_key")
            await resp(scope, receive, send)
            self._count(path, 401)
            return
        if not self.state.ready and path.startswith("/v1/"):
            resp = error_response(503, "the engine is not ready (still loading, or stopped)", "server_error",
                                  code="engine_unavailable")
            await resp(scope, receive, send)
            self._count(path, 503)
            return
        status = {"code": 499}

        async def send_and_note(msg: Dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            status["code"] = 500
            raise
        finally:
            self._count(path, status["code"])

    @staticmethod
    def _authorized(scope: Any, key: str) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
        return False

    def _count(self, path: str, code: int) -> None:
        if path.startswith("/v1/"):
            endpoint = path if path in _ENDPOINTS else ("/v1/models" if path.startswith("/v1/models") else "other")
            self.state.metrics.requests.labels(endpoint=endpoint, status=str(code)).inc()


# ---------------------------------------------------------------------------------------------- /v1/completions
async def _completions(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    _check_common(state, body)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (prompt logprobs are not computed)",
                       param="echo")
    tok = state.tokenizer
    raw = body.prompt
    if isinstance(raw, str):
        raw = [raw]
    elif raw and isinstance(raw[0], int):
        raw = [raw]
    prompts: List[List[int]] = []
    texts: List[str] = []
    for p in raw:
        ids = await _encode(tok, p, True) if isinstance(p, str) else list(p)
        _check_ids(state, ids, "prompt")
        prompts.append(ids)
        texts.append(p if isinstance(p, str) else (tok.decode(ids) if body.echo else ""))
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
    for ids in prompts:
        _check_length(state, len(ids), max_tokens, "prompt")
    params = _sampling_params(body, max_tokens, body.logprobs)
    n = body.n or 1
    cid = f"cmpl-{uuid.uuid4().hex}"
    jobs = _make_jobs(cid, prompts, n, params)
    choices = [_Choice(j.index, tok, j.prompt_ids, j.params, texts[j.index // n] if body.echo else "")
               for j in jobs]
    model = state.served_model_name
    top_n = body.logprobs or 0

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        created = now()

        async def stream() -> AsyncIterator[str]:
            def chunk(ch: _Choice, text: str, lps: Any, finish: Optional[str]) -> str:
                logprobs = None
                if body.logprobs is not None:
                    base = len(ch.prefix)
                    logprobs = _completion_logprobs(state, lps, base, top_n)
                return _sse(CompletionChunk(id=cid, created=created, model=model, choices=[
                    CompletionChoice(index=ch.index, text=text, logprobs=logprobs, finish_reason=finish)]))

            for ch in choices:
                if ch.prefix:
                    yield chunk(ch, ch.prefix, [], None)
            async for batch in _run_jobs(state, jobs):
                for index, out in batch:
                    ch = choices[index]
                    delta, lps = ch.feed(out)
                    finish = ch.finish_reason if out.finished else None
                    if delta or finish or (body.logprobs is not None and lps):
                        yield chunk(ch, delta, lps, finish)

        def usage() -> CompletionChunk:
            return CompletionChunk(id=cid, created=created, model=model, choices=[], usage=_usage(prompts, choices))

        return EventStream(_sse_stream(stream(), usage if include_usage else None))

    await _collect(request, state, jobs, choices)
    resp = CompletionResponse(id=cid, model=model, usage=_usage(prompts, choices), choices=[
        CompletionChoice(index=ch.index, text=ch.prefix + ch.text, finish_reason=ch.finish_reason,
                         logprobs=(_completion_logprobs(state, ch.logprobs, len(ch.prefix), top_n)
                                   if body.logprobs is not None else None))
        for ch in choices])
    return Response(resp.model_dump_json(), media_type="application/json")


# ---------------------------------------------------------------------------------------------- /v1/chat/completions
def _template_messages(body: ChatCompletionRequest) -> List[Dict[str, Any]]:
    msgs = []
    for i, msg in enumerate(body.messages):
        d = msg.model_dump(exclude_none=True)
        content = msg.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                                   param="messages")
                parts.append(part.text)
            content = "".join(parts)
        d["content"] = content or ""
        if d["role"] == "developer":
            d["role"] = "system"
        msgs.append(d)
    return msgs


async def _chat(state: ServerState, body: ChatCompletionRequest, request: Request) -> Response:
    _check_common(state, body)
    if body.tools:
        raise APIError(400, "tools are not supported", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise APIError(400, "response_format other than text is not supported", param="response_format")
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    tok = state.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
    try:
        text = tok.apply_chat_template(_template_messages(body), add_generation_prompt=True, tokenize=False)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors (jinja raise_exception, bad roles) are the client's
        raise APIError(400, f"chat template failed: {e}", param="messages") from None
    ids = await _encode(tok, text, False)
    _check_ids(state, ids, "messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    _check_length(state, len(ids), max_tokens, "messages")
    want_lp = bool(body.logprobs)
    top_n = body.top_logprobs or 0
    params = _sampling_params(body, max_tokens, top_n if want_lp else None)
    n = body.n or 1
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    prompts = [ids]
    jobs = _make_jobs(cid, prompts, n, params)
    choices = [_Choice(j.index, tok, j.prompt_ids, j.params) for j in jobs]
    model = state.served_model_name

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        created = now()

        async def stream() -> AsyncIterator[str]:
            def chunk(index: int, delta: DeltaMessage, lps: Any, finish: Optional[str]) -> str:
                return _sse(ChatCompletionChunk(id=cid, created=created, model=model, choices=[
                    ChatStreamChoice(index=index, delta=delta, finish_reason=finish,
                                     logprobs=_chat_logprobs(state, lps, top_n) if want_lp and lps else None)]))

            for ch in choices:
                yield chunk(ch.index, DeltaMessage(role="assistant", content=""), [], None)
            async for batch in _run_jobs(state, jobs):
                for index, out in batch:
                    ch = choices[index]
                    delta, lps = ch.feed(out)
                    finish = ch.finish_reason if out.finished else None
                    if delta or (want_lp and lps):
                        yield chunk(index, DeltaMessage(content=delta), lps, None)
                    if finish:
                        yield chunk(index, DeltaMessage(), [], finish)

        def usage() -> ChatCompletionChunk:
            return ChatCompletionChunk(id=cid, created=created, model=model, choices=[], usage=_usage(prompts, choices))

        return EventStream(_sse_stream(stream(), usage if include_usage else None))

    await _collect(request, state, jobs, choices)
    resp = ChatCompletionResponse(id=cid, model=model, usage=_usage(prompts, choices), choices=[
        ChatChoice(index=ch.index, message=ChatResponseMessage(content=ch.text), finish_reason=ch.finish_reason,
                   logprobs=_chat_logprobs(state, ch.logprobs, top_n) if want_lp else None)
        for ch in choices])
    return Response(resp.model_dump_json(), media_type="application/json")
