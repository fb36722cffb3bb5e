"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the way in: its request schema,
and a request turned into the request plan's inputs (plan/chat.py), so that all that follows is chat's
(generation.serve; its shapes: render.py). count_tokens answers `{"input_tokens": N}`, the length of the prompt the
same request would be planned into. The conversion, as SGLang's and vLLM's Anthropic endpoints do it:
  system (a string or text blocks)     -> a first system message
  a system message inside messages     -> a system message in its place (Claude Code's mid-conversation reminders)
  user text blocks                     -> a user message (consecutive text blocks joined)
  user tool_result blocks              -> tool messages {tool_call_id, content}, in their place; is_error
                                          prefixes the content with "Error: "
  assistant text / tool_use blocks     -> one assistant message: content, and tool_calls with JSON arguments
  assistant thinking blocks            -> its reasoning_content (redacted_thinking is dropped)
  tools [{name, description, input_schema}] -> function tools; server tools (a `type` such as
                                          web_search_20250305) are left out, with a log line
  tool_choice auto | any | tool | none -> "auto" | "required" | {"type": "function", ...} | "none";
                                          disable_parallel_tool_use -> parallel_tool_calls false
  thinking enabled {budget_tokens}     -> the thinking budget and enable_thinking true (adaptive: no budget);
                                          disabled -> enable_thinking false; both only with a reasoning parser
  output_config.effort                 -> the reasoning effort (read by the harmony format only)
Any other block type, another role, or a block in the wrong role is a 400."""
from __future__ import annotations

import json
import logging
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StrictInt

from ..errors import APIError
from ..generation import Generation, serve
from ..http.json_body import parse_body
from ..plan.chat import ChatInputs, plan_chat
from ..state import ServerState
from .render import MessageRenderer

logger = logging.getLogger("minisrv.server")

USER_BLOCKS = ("text", "tool_result")  # the content blocks each role may send
ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


class AnthropicMessage(BaseModel):
    role: Literal["user", "assistant", "system"]
    content: Union[str, List[Dict[str, Any]]]


class CountTokensRequest(BaseModel):
    """The fields of a request that shape its prompt (all that count_tokens reads)."""

    model: Optional[str] = None  # Anthropic requires it; minisrv serves one model and accepts its absence
    messages: List[AnthropicMessage] = Field(..., min_length=1)
    system: Optional[Union[str, List[Dict[str, Any]]]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    thinking: Optional[Dict[str, Any]] = None
    output_config: Optional[Dict[str, Any]] = None  # only its effort is read (the harmony format's)


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt
    stop_sequences: Optional[List[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stream: Optional[bool] = False
    metadata: Optional[Dict[str, Any]] = None  # ignored


def _bad(message: str, param: str = "messages") -> APIError:
    return APIError(400, message, param=param)


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _bad(f"{where}: a content block must be an object with a type")
    return block["type"]


def _text_of(block: Dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}: a text block needs a string text")
    return text


def text_blocks(content: Any, where: str) -> str:
    """A string, or a list of text blocks joined (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of text blocks")
    parts = []
    for j, block in enumerate(content):
        kind = _block_type(block, f"{where}[{j}]")
        if kind != "text":
            raise _bad(f"{where}[{j}]: only text blocks are supported here, got {kind!r}")
        parts.append(_text_of(block, f"{where}[{j}]"))
    return "\n".join(parts)


def _chat_messages(role: str, content: Any, where: str) -> List[Dict[str, Any]]:
    """One user or assistant message as chat messages: a user's text blocks (consecutive ones joined) and tool
    results in their order; an assistant's text, tool calls and thinking as one message."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    own = USER_BLOCKS if role == "user" else ASSISTANT_BLOCKS
    out: List[Dict[str, Any]] = []
    texts: List[str] = []
    thinking: List[str] = []
    calls: List[Dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind not in own:
            if kind in USER_BLOCKS + ASSISTANT_BLOCKS:
                raise _bad(f"{at}: a {kind} block belongs in {'an assistant' if role == 'user' else 'a user'} message")
            raise _bad(f"{at}: unsupported content block type {kind!r}")
        if kind == "text":
            texts.append(_text_of(block, at))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise _bad(f"{at}: a tool_result block needs a string tool_use_id")
            result = text_blocks(block.get("content", ""), f"{at}.content")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": "Error: " + result if block.get("is_error") else result})
        elif kind == "tool_use":
            name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, dict):
                raise _bad(f"{at}: a tool_use block needs a string id and name and an object input")
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}})
        elif kind == "thinking" and isinstance(block.get("thinking"), str):  # redacted_thinking is dropped
            thinking.append(block["thinking"])
    if role == "user":
        return out + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])
    msg: Dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    return [msg]


def _tools(tools: Optional[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools or []):
        if tool.get("type", "custom") not in ("custom", None):
            logger.info("tools[%d]: the server tool %r (%s) is left out: this server cannot run it", i,
                        tool.get("name"), tool.get("type"))
            continue
        if not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{i}]: a tool needs a string name", "tools")
        fn = {"name": tool["name"], "description": tool.get("description") or "",
              "parameters": tool.get("input_schema", {"type": "object", "properties": {}})}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Optional[Dict[str, Any]]) -> Tuple[Any, Optional[bool]]:
    """tool_choice in chat's terms, and parallel_tool_calls (False with disable_parallel_tool_use)."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind in ("auto", "any", "none"):
        return {"any": "required"}.get(kind, kind), parallel
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice of type tool needs a name", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad(f"tool_choice type must be auto, any, tool or none, got {kind!r}", "tool_choice")


def _thinking(thinking: Optional[Dict[str, Any]], reasoning_parser: bool) -> Tuple[Dict[str, Any], Optional[int]]:
    """The template variables and the thinking budget of `thinking`."""
    if thinking is None:
        return {}, None
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise _bad(f"thinking type must be enabled, adaptive or disabled, got {kind!r}", "thinking")
    budget = thinking.get("budget_tokens") if kind == "enabled" else None  # adaptive: the model decides how long
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise _bad("thinking.budget_tokens must be a non-negative integer", "thinking")
    if not reasoning_parser:
        return {}, None  # a model that does not think: nothing to switch
    return {"enable_thinking": kind != "disabled"}, budget


def chat_inputs(body: CountTokensRequest, reasoning_parser: bool,
                sampling: Optional[Dict[str, Any]] = None) -> ChatInputs:
    """The request in the plan's terms; raises APIError (a 400) for what it cannot say there."""
    system = "" if body.system is None else text_blocks(body.system, "system")
    messages: List[Dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, msg in enumerate(body.messages):
        where = f"messages[{i}]"
        if msg.role == "system":
            messages.append({"role": "system", "content": text_blocks(msg.content, f"{where}.content")})
        else:
            messages += _chat_messages(msg.role, msg.content, where)
    tools = _tools(body.tools)
    choice, parallel = _tool_choice(body.tool_choice)
    if body.tools and not tools:  # all of them left out: nothing to choose among
        tools, choice, parallel = None, None, None
    kwargs, budget = _thinking(body.thinking, reasoning_parser)
    effort = (body.output_config or {}).get("effort")
    return ChatInputs(messages, tools, choice, parallel, template_kwargs=kwargs, thinking_budget=budget,
                      reasoning_effort=effort, sampling=sampling,
                      param_names={"reasoning_effort": "output_config"})


async def count_tokens(state: ServerState, request: Request) -> Response:
    body, large = await parse_body(request, CountTokensRequest)
    state.check_generation_model(body.model)
    plan = await plan_chat(state.prompts, chat_inputs(body, state.prompts.reasoning is not None), state.info.limits,
                           large)
    return JSONResponse({"input_tokens": len(plan.prompt_ids)})


async def messages(state: ServerState, request: Request) -> Response:
    body, large = await parse_body(request, MessagesRequest)
    state.check_generation_model(body.model)
    sampling = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k") if getattr(body, k) is not None}
    sampling.update(max_tokens=body.max_tokens, stop=body.stop_sequences or None)
    inputs = chat_inputs(body, state.prompts.reasoning is not None, sampling)
    plan = await plan_chat(state.prompts, inputs, state.info.limits, large)
    renderer = MessageRenderer(state.served_model_name, len(plan.prompt_ids), plan.tools, plan.reasoning)
    return await serve(state, request, Generation([plan.prompt_ids], plan.params), renderer, bool(body.stream))
