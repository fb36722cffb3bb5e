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

A request may ask for at most MAX_CHOICES choices (prompts x n). How bodies become prompts without holding the event
loop is prompts.py's; what the routes share, state.py's.
"""
from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any, Dict, Iterator, List, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minisrv.engine.grammar_check import check_grammar, constraint_of
from minisrv.engine.request import RequestError, SamplingParams, check_request

from .anthropic_routes import add_anthropic_routes
from .embedding_routes import add_embedding_routes, refuse_generation
from .errors import ENGINE_UNAVAILABLE, SERVER, APIError, error_response, install_error_handlers
from .generation import Generation, serve
from .http.gate import Gate
from .prompts import ASYNC_ENCODE_CHARS, encode, off_loop, parse_body, template_kwargs, template_messages
from .protocol import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from .reasoning_plan import plan_reasoning, thinking_budget
from .responses_routes import add_responses_routes
from .render import ChatRenderer, CompletionRenderer
from .state import ServerState
from .tokenizer_routes import add_tokenizer_routes
from .tool_prompt import with_tool_prompt
from .tools import parser_for, plan_tools, template_messages_with_tool_calls


# request fields passed to SamplingParams as they are; one left out (None) gets SamplingParams' default, so
# /v1/completions without max_tokens gets its 16 (OpenAI's default too)
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
                   "skip_special_tokens")


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
        body, large = await parse_body(request, CompletionRequest)
        return await _completions(state, body, request, large)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body, large = await parse_body(request, ChatCompletionRequest)
        return await _chat(state, body, request, large)

    add_tokenizer_routes(app, state)
    add_embedding_routes(app, state)
    add_anthropic_routes(app, state)  # /v1/messages (Anthropic's API), served by the chat path
    add_responses_routes(app, state, _chat)  # /v1/responses, served by the chat path
    return app


def _check_common(state: ServerState, body: Any) -> None:
    state.check_model(body.model)
    refuse_generation(state)
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
    guided_choice = body.guided_choice
    if body.structured_outputs is not None:
        guided_choice = _vllm_structured_outputs(body.structured_outputs, kw, guided_choice)
    choice = choice_grammar(guided_choice, body.choices)
    if choice is not None:
        if "ebnf" in kw:
            raise RequestError("give choices or ebnf, not both", "ebnf")
        kw["ebnf"] = choice
    return kw


def _vllm_structured_outputs(spec: Dict[str, Any], kw: Dict[str, Any], guided_choice: Any) -> Any:
    """vLLM's `structured_outputs` ({"choice": [...]} or "regex", "json", "grammar") into kw as the fields above
    would set it; returns the choice list. One constraint in all, whichever way it is given (a 400 otherwise)."""
    known = {"choice", "regex", "json", "grammar"}
    given = [k for k in spec if spec[k] is not None]
    if len(given) != 1 or given[0] not in known:
        raise RequestError(f"structured_outputs takes one of {', '.join(sorted(known))}", "structured_outputs")
    key, value = given[0], spec[given[0]]
    if kw or guided_choice is not None:
        raise RequestError("give structured_outputs or another constraint, not both", "structured_outputs")
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError("structured_outputs.choice must be a non-empty list of non-empty strings",
                               "structured_outputs")
        return value
    if key == "json":
        if not isinstance(value, (dict, str)):
            raise RequestError("structured_outputs.json must be a JSON schema", "structured_outputs")
        kw["json_schema"] = value if isinstance(value, str) else json.dumps(value)
    else:
        kw["regex" if key == "regex" else "ebnf"] = value
    return guided_choice


def choice_grammar(guided_choice: Any, choices: Any) -> Any:
    """vLLM's guided_choice / SGLang's choices as an EBNF grammar whose only sentences are the given strings (each
    a JSON-escaped literal, which xgrammar's EBNF reads), or None when neither is given."""
    if guided_choice is not None and choices is not None:
        raise RequestError("give guided_choice or choices, not both", "choices")
    given, name = (guided_choice, "guided_choice") if guided_choice is not None else (choices, "choices")
    if given is None:
        return None
    if not given or not all(isinstance(c, str) and c for c in given):
        raise RequestError(f"{name} must be a non-empty list of non-empty strings", name)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(given))


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
            ids = encode(state, p, True, "prompt") if isinstance(p, str) else list(p)
            check_request(ids, params, state.info.limits, "prompt")
            prompts.append(ids)
            if body.echo:
                echoed.append(p if isinstance(p, str) else state.tokenizer.decode(ids))
        check_grammar(params)  # one constraint for every prompt: parsed once
        return prompts, echoed

    size = sum(len(p) for p in raw)  # characters or token ids
    prompts, echoed = await off_loop(large or size > ASYNC_ENCODE_CHARS or constraint_of(params) is not None, prepare)
    renderer = CompletionRenderer(f"cmpl-{uuid.uuid4().hex}", state.served_model_name, state.token_text,
                                  body.logprobs, echo_lp, state.fingerprint)
    return await serve(state, request, Generation(prompts, params, body.n or 1, echoed), renderer,
                       bool(body.stream), _stream_usage(body))


# ---------------------------------------------------------------------------------------------- /v1/chat/completions
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
    if body.parallel_tool_calls is not None and not body.tools and not body.functions:
        raise RequestError("parallel_tool_calls is only allowed when tools are given", "parallel_tool_calls")
    parser = parser_for(getattr(tok, "chat_template", None), state.tool_call_parser)
    plan = await off_loop(large or bool(body.tools or body.functions),  # (their schemas are parsed: prompts.py)
                          lambda: plan_tools(body.tools, body.tool_choice, body.functions, body.function_call, parser))
    grammar: Dict[str, Any] = {}
    if plan.json_schema is not None:  # tool_choice required or a named function: the call is a grammar
        if body.response_format is not None and body.response_format.get("type", "text") != "text" \
                or body.regex is not None or body.ebnf is not None:
            raise APIError(400, "tool_choice required or a named function cannot be combined with a "
                                "response_format, regex or ebnf", param="tool_choice")
        grammar["json_schema"] = plan.json_schema
    with _fields_named(names):
        params = _sampling_params(body, max_tokens=max_tokens, logprobs=top_n if want_lp else None, **grammar)
    prompt_tools = plan.template_tools is not None and not state.tools_in_template  # (tool_prompt.py)
    tools_kw = {"tools": plan.template_tools} if plan.template_tools is not None and not prompt_tools else {}
    tools_kw.update(template_kwargs(tok, body.chat_template_kwargs))
    budget = thinking_budget(body.thinking_budget, body.custom_params)

    def template() -> str:
        try:
            messages = template_messages_with_tool_calls(template_messages(body))
            if prompt_tools:
                messages = with_tool_prompt(messages, plan.template_tools)
            return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **tools_kw)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - template errors (jinja raise_exception, bad roles) are the client's
            raise APIError(400, f"chat template failed: {e}", param="messages") from None

    text = await off_loop(large, template)
    # a thinking model: the text's split, and the engine's rule (the budget; a grammar only after the thinking)
    reasoning, params.thinking = plan_reasoning(state.reasoning, text, body.separate_reasoning, budget)

    def prepare(text: str) -> List[int]:
        ids = encode(state, text, False, "messages")
        with _fields_named(names):
            check_request(ids, params, state.info.limits, "messages")
        check_grammar(params)
        return ids

    ids = await off_loop(large or len(text) > ASYNC_ENCODE_CHARS or constraint_of(params) is not None,
                         lambda: prepare(text))
    renderer = ChatRenderer(f"chatcmpl-{uuid.uuid4().hex}", state.served_model_name, state.token_text, want_lp,
                            top_n, plan, state.fingerprint, reasoning=reasoning)
    return await serve(state, request, Generation([ids], params, body.n or 1), renderer, bool(body.stream),
                       _stream_usage(body))
