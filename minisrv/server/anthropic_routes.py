"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the chat path.

A request is turned into chat's terms (anthropic_protocol.py) and from there goes chat's way: the same model
check, tool planning (a forced call is a JSON-schema grammar), chat template, reasoning plan and thinking rule,
tokenizing, the same validation (SamplingParams, check_request, check_grammar) and the same engine path
(generation.run_jobs: metrics, aborts when the client leaves, the engine's refusals and failures as APIErrors).
Only the answer's shape is its own (anthropic_render.py), and so is the stream's framing: named events, an error
event (Anthropic's shape) where a request fails after its stream began, and no [DONE]. Every error under
/v1/messages, the gate's included, has Anthropic's shape (errors.py chooses it by path).

count_tokens answers `{"input_tokens": N}`: the length of the prompt the same request would be templated into.
"""
from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minisrv.engine.grammar_check import check_grammar, constraint_of
from minisrv.engine.request import SamplingParams, check_request

from .anthropic_protocol import CountTokensRequest, MessagesRequest, to_chat
from .anthropic_render import MessageRenderer, new_message_id, sse_event
from .embedding_routes import refuse_generation
from .errors import APIError, server_shutdown
from .generation import Choice, Generation, make_jobs, run_jobs
from .prompts import ASYNC_ENCODE_CHARS, encode, off_loop, parse_body
from .reasoning_plan import ReasoningPlan, plan_reasoning
from .state import ServerState
from .streaming import EventStream, unless_disconnected
from .tools import ToolPlan, parser_for, plan_tools, template_messages_with_tool_calls

Prompt = Tuple[List[int], ToolPlan, Optional[ReasoningPlan]]


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        body, large = await parse_body(request, MessagesRequest)
        return await _messages(state, body, request, large)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        body, large = await parse_body(request, CountTokensRequest)
        ids, _, _ = await _prompt(state, body, large, None)
        return JSONResponse({"input_tokens": len(ids)})


async def _prompt(state: ServerState, body: CountTokensRequest, large: bool,
                  params: Optional[SamplingParams]) -> Prompt:
    """The request's prompt token ids, tool plan and reasoning plan, as chat makes them. With `params` (a
    generation, not a count), its grammar and thinking rule are set and the whole is validated as chat's is."""
    state.check_model(body.model)
    refuse_generation(state)
    tok = state.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template", param="messages")
    chat = to_chat(body, state.reasoning is not None)
    parser = parser_for(tok.chat_template, state.tool_call_parser)
    plan = await off_loop(large or bool(chat.tools), lambda: plan_tools(chat.tools, chat.tool_choice, parser=parser))
    tools_kw: dict = {"tools": plan.template_tools} if plan.template_tools is not None else {}
    tools_kw.update(chat.template_kwargs)

    def template() -> str:
        try:
            return tok.apply_chat_template(template_messages_with_tool_calls(chat.messages),
                                           add_generation_prompt=True, tokenize=False, **tools_kw)
        except Exception as e:  # noqa: BLE001 - template errors (jinja raise_exception, bad roles) are the client's
            raise APIError(400, f"chat template failed: {e}", param="messages") from None

    text = await off_loop(large, template)
    reasoning, rule = plan_reasoning(state.reasoning, text, True, chat.thinking_budget)
    if params is not None:
        params.json_schema = plan.json_schema  # tool_choice any or a named tool: the call is a grammar
        params.thinking = rule

    def prepare() -> List[int]:
        ids = encode(state, text, False, "messages")
        if params is not None:
            check_request(ids, params, state.info.limits, "messages")
            check_grammar(params)
        return ids

    ids = await off_loop(large or len(text) > ASYNC_ENCODE_CHARS or params is not None and
                         constraint_of(params) is not None, prepare)
    return ids, plan, reasoning


async def _messages(state: ServerState, body: MessagesRequest, request: Request, large: bool) -> Response:
    sampling = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k") if getattr(body, k) is not None}
    params = SamplingParams(max_tokens=body.max_tokens, stop=body.stop_sequences or None, **sampling)
    ids, plan, reasoning = await _prompt(state, body, large, params)
    renderer = MessageRenderer(new_message_id(), state.served_model_name, len(ids), plan, reasoning)
    if state.stopping:
        raise server_shutdown()
    jobs = make_jobs(renderer.id, Generation([ids], params))
    choice = Choice(0, prompt_ids=ids)
    if body.stream:
        return EventStream(_events(state, renderer, jobs, choice))
    stop_str: List[Optional[str]] = [None]

    async def collect() -> None:
        async with contextlib.aclosing(run_jobs(state, jobs)) as steps:
            async for step in steps:
                for _, out in step:
                    choice.feed(out)
                    if out.finished:
                        stop_str[0] = out.stop_str

    await unless_disconnected(request, collect())
    return JSONResponse(renderer.whole(choice.text, choice.finish_reason, stop_str[0], choice.num_output_tokens))


async def _events(state: ServerState, renderer: MessageRenderer, jobs: Any, choice: Choice) -> AsyncIterator[str]:
    """The stream's events; a failure on the way ends it with an error event. Closing this closes run_jobs (which
    aborts the engine request)."""
    stream = renderer.stream()
    for name, data in stream.opening():
        yield sse_event(name, data)
    try:
        async with contextlib.aclosing(run_jobs(state, jobs)) as steps:
            async for step in steps:
                for _, out in step:
                    text, _ = choice.feed(out)
                    finish = out.finish_reason if out.finished else None
                    if text or finish:
                        for name, data in stream.feed(text, finish, out.stop_str, choice.num_output_tokens):
                            yield sse_event(name, data)
    except APIError as err:
        yield sse_event("error", err.anthropic_body())
