"""The OpenAI-compatible HTTP app: its routes, and how each generation endpoint turns a request into prompts.

Tokenizing and chat templating happen here, on the HTTP side, so the engine process sees only token ids (see
engine_proc.py); the output text is made by the engine. A request is validated in full before anything reaches
the engine: its shape and types by pydantic (protocol.py), its values by SamplingParams and check_request, the
same checks the engine makes (a RequestError is a 400 naming the field, see errors.py); a response_format, regex
or ebnf becomes a SamplingParams constraint whose grammar is parsed here (check_grammar) before it is queued, and
chat's tools and tool_choice are planned by tools.py (a required or named call is a JSON-schema constraint). From
there on both endpoints share one path (generation.py) and differ only in their renderer (render.py).

Model names: the server answers to its served model name (`--served-model-name`, default: the basename of the
model path, e.g. `SmolLM2-135M-Instruct.Q4_1.gguf`), and also to the model path as given on the command line
and as resolved, so clients that pass the path (as with SGLang/vLLM) work too. A request without `model` goes to
the one model; any other name is a 404 (`model_not_found`).

Disconnects: a client that goes away (streaming or not) gets its requests aborted in the engine, which frees
their KV pages. With an API key, every route but /health needs `Authorization: Bearer <key>` (gate.py), which
also checks Host, Origin, Content-Type and the body's size and read time.

Keeping the event loop free (so /health and the streams of others never wait): a body over INLINE_BODY_BYTES is
parsed, validated, templated and tokenized in a worker thread; a request may ask for at most MAX_CHOICES choices
(prompts x n); a prompt whose length in characters already proves it longer than the model's limit is refused
before it is tokenized (see `max_token_chars`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from minisrv import __version__
from minisrv.engine.grammar import check_grammar
from minisrv.engine.request import RequestError, SamplingParams, check_request

from .engine_proc import EngineClient
from .errors import ENGINE_UNAVAILABLE, SERVER, APIError, error_response, install_error_handlers, validation_message
from .gate import Gate, HTTPPolicy
from .generation import Generation, serve
from .jsonbody import parse as parse_json
from .logprobs import TokenText
from .messages import EngineInfo
from .metrics import ServerMetrics
from .protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, now
from .render import ChatRenderer, CompletionRenderer
from .tools import parser_for, plan_tools, template_messages_with_tool_calls

INLINE_BODY_BYTES = 16384  # larger bodies are parsed, templated and tokenized in a worker thread
ASYNC_ENCODE_CHARS = 16384  # so are longer texts (a chat template can make a long text of a short body)

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
    http: HTTPPolicy = field(default_factory=HTTPPolicy)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=now)
    token_text: Optional[TokenText] = None
    max_token_chars: Optional[int] = None  # see max_token_chars(); None: unknown, no early length check
    tool_call_parser: str = "auto"  # hermes | llama3_json | auto (from the chat template); see tools.py
    stopping: bool = False  # the shutdown's grace period is over: what still runs is ended (see stop)
    on_stop: Set[Callable[[], None]] = field(default_factory=set)  # what stop() tells

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.info is not None:
            self.attach(self.tokenizer, self.info)

    def attach(self, tokenizer: Any, info: EngineInfo) -> None:
        """The engine is up: from now on requests are served."""
        self.tokenizer, self.info = tokenizer, info
        self.token_text = TokenText(tokenizer)
        self.max_token_chars = max_token_chars(tokenizer)

    @property
    def fingerprint(self) -> str:
        """OpenAI's system_fingerprint: what, besides the weights, decides the outputs here."""
        return f"fp_minisrv_{__version__}_{self.info.backend_name.replace(',', '_')}"

    def stop(self) -> None:
        """End every request still running: generations end with a server_shutdown error (a 503, or a stream's
        error event and [DONE]), body reads with a 503; new ones are answered so at once."""
        self.stopping = True
        for tell in list(self.on_stop):
            tell()

    @property
    def ready(self) -> bool:
        return self.info is not None and self.client.ready and not self.client.dead

    def check_model(self, name: Optional[str]) -> None:
        if name is None or name == self.served_model_name or name in self.model_aliases:
            return
        raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.served_model_name}`.",
                       param="model", code="model_not_found")

    def model_card(self) -> ModelCard:
        # the limit requests are held to: the context length, or less when the KV pool is smaller
        return ModelCard(id=self.served_model_name, created=self.created, root=self.info.model_path,
                         max_model_len=self.info.max_request_len)


def max_token_chars(tokenizer: Any) -> Optional[int]:
    """The most characters of input text one token can stand for, where the tokenizer makes that provable; None
    otherwise. Then a text of c characters is at least ceil(c / max_token_chars) tokens.

    Provable for a byte-level BPE without a normalizer (GPT-2, Llama 3, SmolLM2, ...): the text's UTF-8 bytes are
    split into pieces that keep every byte (ByteLevel, Split and Digits pre-tokenizers, unless a Split removes its
    matches), each token is one vocabulary entry whose string has one character per byte, and an added token
    matches its literal content; every character starts in exactly one token and has at least one byte, so a
    token covers at most as many characters as it has bytes. A fixed ratio would not do: SmolLM2 has a token
    of a newline and 80 spaces (81 characters). A normalizer (NFC, stripping, ...) can shrink the text, so with one there is no bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        pre = spec.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
            return None
        if not any(p.get("type") == "ByteLevel" for p in parts):
            return None
        if any(p.get("type") not in ("ByteLevel", "Split", "Digits") or p.get("behavior") == "Removed"
               for p in parts):
            return None
        vocab = backend.get_vocab(with_added_tokens=False)
        added = [t.content for t in backend.get_added_tokens_decoder().values()]
        return max([len(s) for s in vocab] + [len(a.encode("utf-8")) for a in added])
    except Exception:  # noqa: BLE001 - an unexpected tokenizer: no early check, tokenizing still works
        return None


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
        body, large = await _parse_body(request, CompletionRequest)
        return await _completions(state, body, request, large)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body, large = await _parse_body(request, ChatCompletionRequest)
        return await _chat(state, body, request, large)

    from .tokenizer_routes import add_tokenizer_routes  # here: that module imports this one
    add_tokenizer_routes(app, state)
    return app


# ---------------------------------------------------------------------------------------------- request -> prompts
async def _parse_body(request: Request, schema: type) -> Tuple[Any, bool]:
    """JSON body -> schema (the Gate has checked that it is declared application/json and not too large); also
    whether it is large, i.e. parsed in a worker thread (as the prompts made of it are then)."""
    raw = await request.body()

    def validate(data: Any) -> Any:
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            msg, param = validation_message(e)
        raise APIError(400, msg, param=param)  # outside the except: no __context__ holding the input

    if len(raw) > INLINE_BODY_BYTES:
        return await asyncio.to_thread(parse_json, raw, validate), True
    return parse_json(raw, validate), False


def _check_common(state: ServerState, body: Any) -> None:
    state.check_model(body.model)
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")


def _sampling_params(body: Any, **endpoint_fields: Any) -> SamplingParams:
    """The request's sampling fields, its constraint and logit_bias, plus the endpoint's own; raises RequestError
    (a 400 naming the field)."""
    kw: Dict[str, Any] = {name: getattr(body, name) for name in SAMPLING_FIELDS if getattr(body, name) is not None}
    if body.logit_bias:
        try:
            kw["logit_bias"] = {int(t): v for t, v in body.logit_bias.items()}
        except ValueError:
            raise RequestError("logit_bias keys must be token ids", "logit_bias") from None
    kw.update(_constraint(body))
    kw.update(endpoint_fields)
    with _fields_named({"json_schema": "response_format", "json_object": "response_format"}):
        return SamplingParams(**kw)


def _constraint(body: Any) -> Dict[str, Any]:
    """response_format (text, json_object, json_schema) and SGLang's regex / ebnf as SamplingParams fields."""
    kw: Dict[str, Any] = {}
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            kw["json_object"] = True
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise RequestError("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                   "\"schema\": {...}}}", "response_format")
            kw["json_schema"] = json.dumps(schema)
        elif kind != "text":
            raise RequestError(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                               "response_format")
    if body.regex is not None:
        kw["regex"] = body.regex
    if body.ebnf is not None:
        kw["ebnf"] = body.ebnf
    return kw


@contextlib.contextmanager
def _fields_named(names: Dict[str, str]) -> Iterator[None]:
    """A RequestError about a SamplingParams field names the request field that set it (param)."""
    try:
        yield
    except RequestError as e:
        e.param = names.get(e.param, e.param)
        raise


def _check_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise APIError(400, f"a request may ask for at most {MAX_CHOICES} choices in all (prompts x n); this one "
                            f"asks for {num_prompts} x {n} = {num_prompts * n}",
                       param="prompt" if num_prompts > MAX_CHOICES else "n")


def _encode(state: ServerState, text: str, add_special_tokens: bool, param: str) -> List[int]:
    """Tokenize a prompt text, unless its length alone proves it too long for the model (a 400)."""
    limit = state.info.max_request_len
    per_token = state.max_token_chars
    if per_token and len(text) > limit * per_token:
        at_least = math.ceil(len(text) / per_token)
        raise RequestError(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                           f"{len(text)} characters, which are at least {at_least} tokens.", param,
                           "context_length_exceeded")
    return state.tokenizer(text, add_special_tokens=add_special_tokens).input_ids


async def _off_loop(offload: bool, fn: Callable[[], Any]) -> Any:
    """fn() in a worker thread when it may take long (so the event loop keeps serving), else here."""
    return await asyncio.to_thread(fn) if offload else fn()


def _stream_usage(body: Any) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


# ---------------------------------------------------------------------------------------------- /v1/completions
async def _completions(state: ServerState, body: CompletionRequest, request: Request, large: bool) -> Response:
    _check_common(state, body)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    echo_lp = bool(body.echo) and body.logprobs is not None  # the prompt's tokens are scored too
    params = _sampling_params(body, logprobs=body.logprobs, prompt_logprobs=body.logprobs if echo_lp else None)
    raw = body.prompt
    if isinstance(raw, str) or isinstance(raw[0], int):  # one prompt (the shape is checked by the schema)
        raw = [raw]
    _check_choices(len(raw), body.n or 1)

    def prepare() -> Tuple[List[List[int]], List[str]]:
        prompts: List[List[int]] = []
        echoed: List[str] = []
        for p in raw:
            ids = _encode(state, p, True, "prompt") if isinstance(p, str) else list(p)
            check_request(ids, params, state.info.limits, "prompt")
            check_grammar(params)
            prompts.append(ids)
            if body.echo:
                echoed.append(p if isinstance(p, str) else state.tokenizer.decode(ids))
        return prompts, echoed

    size = sum(len(p) for p in raw)  # characters or token ids
    prompts, echoed = await _off_loop(large or size > ASYNC_ENCODE_CHARS, prepare)
    renderer = CompletionRenderer(f"cmpl-{uuid.uuid4().hex}", state.served_model_name, state.token_text,
                                  body.logprobs, echo_lp, state.fingerprint)
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


async def _chat(state: ServerState, body: ChatCompletionRequest, request: Request, large: bool) -> Response:
    _check_common(state, body)
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
    plan = plan_tools(body.tools, body.tool_choice, body.functions, body.function_call,
                      parser_for(getattr(tok, "chat_template", None), state.tool_call_parser))
    grammar: Dict[str, Any] = {}
    if plan.json_schema is not None:  # tool_choice required or a named function: the call is a grammar
        if body.response_format is not None and body.response_format.get("type", "text") != "text" \
                or body.regex is not None or body.ebnf is not None:
            raise APIError(400, "tool_choice required or a named function cannot be combined with a "
                                "response_format, regex or ebnf", param="tool_choice")
        grammar["json_schema"] = plan.json_schema
    with _fields_named(names):
        params = _sampling_params(body, max_tokens=max_tokens, logprobs=top_n if want_lp else None, **grammar)
    tools_kw = {"tools": plan.template_tools} if plan.template_tools is not None else {}

    def template() -> str:
        try:
            return tok.apply_chat_template(template_messages_with_tool_calls(_template_messages(body)),
                                           add_generation_prompt=True, tokenize=False, **tools_kw)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors (jinja raise_exception, bad roles) are the client's
            raise APIError(400, f"chat template failed: {e}", param="messages") from None

    def prepare(text: str) -> List[int]:
        ids = _encode(state, text, False, "messages")
        with _fields_named(names):
            check_request(ids, params, state.info.limits, "messages")
        check_grammar(params)
        return ids

    text = await _off_loop(large, template)
    ids = await _off_loop(large or len(text) > ASYNC_ENCODE_CHARS, lambda: prepare(text))
    renderer = ChatRenderer(f"chatcmpl-{uuid.uuid4().hex}", state.served_model_name, state.token_text, want_lp,
                            top_n, plan, state.fingerprint)
    return await serve(state, request, Generation([ids], params, body.n or 1), renderer, bool(body.stream),
                       _stream_usage(body))
