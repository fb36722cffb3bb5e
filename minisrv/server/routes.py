"""The OpenAI-compatible HTTP app: its routes, and how each generation endpoint turns a request into prompts.

Tokenizing and chat templating happen here, on the HTTP side, so the engine process sees only token ids (see
engine_proc.py); the output text is made by the engine. A request is validated in full before anything reaches
the engine: its shape and types by pydantic (protocol.py), its values by SamplingParams and check_request, the
same checks the engine makes (a RequestError is a 400 naming the field, see errors.py). From there on both
endpoints share one path (generation.py) and differ only in their renderer (render.py).

Model names: the server answers to its served model name (`--served-model-name`, default: the basename of the
model path, e.g. `SmolLM2-135M-Instruct.Q4_1.gguf`), and also to the model path as given on the command line
and as resolved, so clients that pass the path (as with SGLang/vLLM) work too. A request without `model` goes to
the one model; any other name is a 404 (`model_not_found`).

Disconnects: a client that goes away (streaming or not) gets its requests aborted in the engine, which frees
their KV pages. With an API key, every route but /health needs `Authorization: Bearer <key>` (gate.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from minisrv.engine.request import RequestError, SamplingParams, check_request

from .engine_proc import EngineClient
from .errors import ENGINE_UNAVAILABLE, SERVER, APIError, error_response, install_error_handlers, validation_message
from .gate import Gate
from .generation import Generation, serve
from .logprobs import TokenText
from .messages import EngineInfo
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, now
from .render import ChatRenderer, CompletionRenderer

ASYNC_ENCODE_CHARS = 16384  # longer texts are tokenized in a worker thread to keep the event loop responsive

# request fields passed to SamplingParams as they are; one left out (None) gets SamplingParams' default, so
# /v1/completions without max_tokens gets its 16 (OpenAI's default too)
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
                   "skip_special_tokens")


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

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.served_model_name, created=self.created, root=self.info.model_path,
                         max_model_len=self.info.context_length)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="minisrv", version="0.1.0", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(Gate, state=state)

    @app.get("/health")
    async def health() -> Response:
        if state.ready:
            return JSONResponse({"status": "ok"})
        return error_response(503, "the engine is not ready", SERVER, code=ENGINE_UNAVAILABLE)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.set_engine_stats(await state.client.fresh_stats())
        body, content_type = state.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[state.model_card()])

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> ModelCard:
        state.check_model(model)
        return state.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _completions(state, await _parse_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _chat(state, await _parse_body(request, ChatCompletionRequest), request)

    return app


# ---------------------------------------------------------------------------------------------- request -> prompts
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
        msg, param = validation_message(e)
        raise APIError(400, msg, param=param) from None


def _check_common(state: ServerState, body: Any) -> None:
    state.check_model(body.model)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")


def _sampling_params(body: Any, **endpoint_fields: Any) -> SamplingParams:
    """The request's sampling fields plus the endpoint's own; raises RequestError (a 400 naming the field)."""
    kw: Dict[str, Any] = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    kw.update(endpoint_fields)
    return SamplingParams(**kw)


@contextlib.contextmanager
def _fields_named(names: Dict[str, str]) -> Iterator[None]:
    """A RequestError about a SamplingParams field names the request field that set it (param)."""
    try:
        yield
    except RequestError as e:
        e.param = names.get(e.param, e.param)
        raise


async def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> List[int]:
    if len(text) > ASYNC_ENCODE_CHARS:
        return await asyncio.to_thread(lambda: tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


def _stream_usage(body: Any) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


# ---------------------------------------------------------------------------------------------- /v1/completions
async def _completions(state: ServerState, body: CompletionRequest, request: Request) -> Response:
    _check_common(state, body)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (prompt logprobs are not computed)",
                       param="echo")
    params = _sampling_params(body, logprobs=body.logprobs)
    tok = state.tokenizer
    raw = body.prompt
    if isinstance(raw, str) or isinstance(raw[0], int):  # one prompt (the shape is checked by the schema)
        raw = [raw]
    prompts: List[List[int]] = []
    echoed: List[str] = []
    for p in raw:
        ids = await _encode(tok, p, True) if isinstance(p, str) else list(p)
        check_request(ids, params, state.info.limits, "prompt")
        prompts.append(ids)
        if body.echo:
            echoed.append(p if isinstance(p, str) else tok.decode(ids))
    renderer = CompletionRenderer(f"cmpl-{uuid.uuid4().hex}", state.served_model_name, state.token_text,
                                  body.logprobs)
    return await serve(state, request, Generation(prompts, params, body.n or 1, echoed), renderer,
                       bool(body.stream), _stream_usage(body))


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
    want_lp = bool(body.logprobs)
    top_n = body.top_logprobs or 0
    names = {"logprobs": "top_logprobs"}
    if body.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    # without max_tokens a chat answer may use the rest of the context
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    with _fields_named(names):
        params = _sampling_params(body, max_tokens=max_tokens, logprobs=top_n if want_lp else None)
    try:
        text = tok.apply_chat_template(_template_messages(body), add_generation_prompt=True, tokenize=False)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors (jinja raise_exception, bad roles) are the client's
        raise APIError(400, f"chat template failed: {e}", param="messages") from None
    ids = await _encode(tok, text, False)
    with _fields_named(names):
        check_request(ids, params, state.info.limits, "messages")
    renderer = ChatRenderer(f"chatcmpl-{uuid.uuid4().hex}", state.served_model_name, state.token_text, want_lp,
                            top_n)
    return await serve(state, request, Generation([ids], params, body.n or 1), renderer, bool(body.stream),
                       _stream_usage(body))
