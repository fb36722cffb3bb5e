"""/v1/completions and /v1/chat/completions: each request checked in full before anything reaches the engine
(pydantic's types, SamplingParams and check_request's values, a constraint's grammar: a 400 naming the field), then
handed to generation.py's path with its renderer (render.py). A chat request is planned as every chat-shaped API's
is (plan/chat.py); a completion's prompts are tokenized as they are. A request may ask for at most MAX_CHOICES
choices (prompts x n)."""
from __future__ import annotations

import uuid
from typing import Any, Dict, List, Tuple

from fastapi import Request
from fastapi.responses import Response

from minisrv.engine.grammar_check import check_grammar, constraint_of
from minisrv.engine.request import SamplingParams, check_request

from ..http.json_body import parse_body
from ..errors import APIError
from ..generation import Generation, serve
from ..plan.chat import ChatInputs, plan_chat
from ..plan.prompt import ASYNC_ENCODE_CHARS, off_loop
from ..plan.reasoning import thinking_budget
from ..plan.sampling import OPENAI_NAMES, fields_named, sampling_fields
from ..state import ServerState
from .protocol import MAX_CHOICES, ChatCompletionRequest, ChatMessage, CompletionRequest
from .render import ChatRenderer, CompletionRenderer


def _checked(state: ServerState, body: Any) -> bool:
    """The model, and what both routes refuse beyond the schema; returns whether the stream ends with the usage."""
    state.check_generation_model(body.model)
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options can only be set when stream is true", param="stream_options")
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


async def completions(state: ServerState, request: Request) -> Response:
    body, large = await parse_body(request, CompletionRequest)
    stream_usage = _checked(state, body)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    echo_lp = bool(body.echo) and body.logprobs is not None  # the prompt's tokens are scored too
    with fields_named(OPENAI_NAMES):
        params = SamplingParams(**sampling_fields(body), logprobs=body.logprobs,
                                prompt_logprobs=body.logprobs if echo_lp else None)
    raw, n = body.prompt, body.n or 1
    if len(raw) * n > MAX_CHOICES:
        raise APIError(400, f"a request may ask for at most {MAX_CHOICES} choices in all (prompts x n); this one "
                            f"asks for {len(raw)} x {n} = {len(raw) * n}",
                       param="prompt" if len(raw) > MAX_CHOICES else "n")
    maker, limits = state.prompts, state.info.limits

    def prepare() -> Tuple[List[List[int]], List[str]]:
        prompts: List[List[int]] = []
        echoed: List[str] = []
        for p in raw:
            ids = maker.encode(p, True, "prompt", limits.max_request_len) if isinstance(p, str) else list(p)
            check_request(ids, params, limits, "prompt")
            prompts.append(ids)
            if body.echo:
                echoed.append(p if isinstance(p, str) else maker.tokenizer.decode(ids))
        check_grammar(params)  # one constraint for every prompt: parsed once
        return prompts, echoed

    size = sum(len(p) for p in raw)  # characters or token ids
    prompts, echoed = await off_loop(large or size > ASYNC_ENCODE_CHARS or constraint_of(params) is not None, prepare)
    renderer = CompletionRenderer(f"cmpl-{uuid.uuid4().hex}", state.served_model_name, state.fingerprint,
                                  stream_usage, token_text=state.token_text, logprobs=body.logprobs,
                                  echo_logprobs=echo_lp)
    return await serve(state, request, Generation(prompts, params, n, echoed), renderer, bool(body.stream))


def chat_messages(messages: List[ChatMessage]) -> List[Dict[str, Any]]:
    """The request's messages as the plan takes them: text parts joined, the developer role as system."""
    msgs = []
    for i, msg in enumerate(messages):
        d = msg.model_dump(exclude_none=True)
        if isinstance(msg.content, list):
            other = next((part.type for part in msg.content if part.type != "text" or part.text is None), None)
            if other is not None:
                raise APIError(400, f"messages[{i}]: only text content parts are supported, got {other!r}",
                               param="messages")
            d["content"] = "".join(part.text for part in msg.content)
        d["content"] = d.get("content") or ""
        d["role"] = "system" if d["role"] == "developer" else d["role"]
        msgs.append(d)
    return msgs


def chat_inputs(body: ChatCompletionRequest) -> ChatInputs:
    """A chat completion request in the plan's terms. Without max_tokens a chat answer may use the rest of the
    context; max_completion_tokens (OpenAI's newer name) wins over max_tokens."""
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    names = {**OPENAI_NAMES, "logprobs": "top_logprobs"}
    if body.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    with fields_named(names):
        sampling = {**sampling_fields(body), "max_tokens": max_tokens,
                    "logprobs": (body.top_logprobs or 0) if body.logprobs else None}
        budget = thinking_budget(body.thinking_budget, body.custom_params)
    return ChatInputs(chat_messages(body.messages), body.tools, body.tool_choice, body.parallel_tool_calls,
                      body.functions, body.function_call, body.chat_template_kwargs, budget,
                      body.separate_reasoning, body.reasoning_effort, sampling, param_names=names)


async def chat(state: ServerState, request: Request) -> Response:
    body, large = await parse_body(request, ChatCompletionRequest)
    stream_usage = _checked(state, body)
    plan = await plan_chat(state.prompts, chat_inputs(body), state.info.limits, large)
    renderer = ChatRenderer(f"chatcmpl-{uuid.uuid4().hex}", state.served_model_name, state.fingerprint,
                            stream_usage, token_text=state.token_text, logprobs=bool(body.logprobs),
                            top_logprobs=body.top_logprobs or 0, tools=plan.tools, reasoning=plan.reasoning)
    return await serve(state, request, Generation([plan.prompt_ids], plan.params, body.n or 1), renderer,
                       bool(body.stream))

