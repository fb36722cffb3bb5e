"""`POST /v1/responses`, OpenAI's Responses API, on the way in: its request schema, and the request turned into the
request plan's inputs (plan/chat.py) and served as a chat completion is (its shapes: render.py).

Stateless: `store: true` is accepted but nothing is stored, so what needs a stored response or conversation
(`previous_response_id`, `conversation`, `background`) is a 400. The conversion:
  instructions                       a system message, first
  input: a string                    one user message
  input: message items               messages (user, system, developer or assistant; text content)
  function_call items                an assistant message's tool_calls (joined to the assistant message before them)
  function_call_output items         tool messages (tool_call_id: the call_id)
  reasoning items                    dropped (earlier thinking is not templated back, as chat does)
  function tools, tool_choice        chat's function tools and tool_choice
  a namespace tool group             its function tools (Codex CLI groups its tools so); a call to one is answered
                                     with the namespace named (render.py)
  hosted tools (web_search, ...)     left out, with a log line: this server cannot run them
  text.format, max_output_tokens     the output constraint, max_tokens
Anything else in `input` is a 400 naming the item; a 400's `param` names the Responses field."""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Union

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, StrictBool

from ..errors import APIError
from ..generation import Generation, serve
from ..http.json_body import parse_body
from ..plan.chat import ChatInputs, plan_chat
from ..plan.sampling import output_format
from ..state import ServerState
from .render import ResponseRenderer

logger = logging.getLogger("minisrv.server")

# a plan's field, as the Responses request names it (in a 400's param)
PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "json_schema": "text", "json_object": "text",
               "reasoning_effort": "reasoning", "response_format": "text"}
TEXT_PARTS = ("input_text", "output_text", "text")
MESSAGE_ROLES = ("user", "system", "developer", "assistant")


class ResponsesRequest(BaseModel):
    """The fields minisrv reads; others are ignored, as its chat endpoint ignores unknown ones."""

    model: Optional[str] = None
    input: Union[str, List[Any]]
    instructions: Optional[str] = None
    tools: Optional[List[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: Optional[Dict[str, Any]] = None
    stream: Optional[StrictBool] = False
    store: Optional[bool] = None
    reasoning: Optional[Dict[str, Any]] = None  # {effort, summary}: effort is the harmony format's, summary unused
    metadata: Optional[Dict[str, Any]] = None
    user: Optional[str] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Any] = None
    background: Optional[bool] = None


def chat_inputs(req: ResponsesRequest) -> ChatInputs:
    """The plan's inputs for a Responses request; raises a 400 (APIError) for what cannot be served."""
    for param, why in (("previous_response_id", "needs a stored response"), ("conversation",
                       "needs stored conversations"), ("background", "responses need stored responses")):
        if getattr(req, param) not in (None, False):
            hint = "" if param == "background" else ": send the whole conversation in input"
            raise APIError(400, f"{param} {why}, and this server stores none{hint}", param=param)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = system + input_messages(req.input)
    if not any(m["role"] != "system" for m in messages):
        raise APIError(400, "input must hold at least one message or item", param="input")
    fmt = (req.text or {}).get("format")
    fmt = {"type": "text"} if fmt is None else fmt if isinstance(fmt, dict) else {}
    sampling = {"max_tokens": req.max_output_tokens,
                **output_format(fmt.get("type"), fmt.get("schema"), "text.format", "a schema object")}
    sampling.update({k: getattr(req, k) for k in ("temperature", "top_p") if getattr(req, k) is not None})
    tools = chat_tools(req.tools)
    choice = None if req.tool_choice is None else chat_tool_choice(req.tool_choice)
    parallel = req.parallel_tool_calls
    if req.tools and not tools:  # only hosted tools, all left out: nothing to choose among
        choice = parallel = None
    return ChatInputs(messages, tools or None, choice, parallel, reasoning_effort=(req.reasoning or {}).get("effort"),
                      sampling=sampling, param_names=PARAM_NAMES)


def input_messages(items: Union[str, List[Any]]) -> List[Dict[str, Any]]:
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: List[Dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, i))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)  # the calls of one assistant turn stay together
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, i) if isinstance(output, list) else None
            if text is None:
                raise APIError(400, f"input[{i}].output must be a string or a list of text parts", param="input")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"input[{i}]: item type {kind!r} is not supported (message, function_call, "
                                f"function_call_output and reasoning are)", param="input")
    return out


def _string(item: Dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"input[{i}].{key} must be a string", param="input")
    return value


def _message(item: Dict[str, Any], i: int) -> Dict[str, Any]:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise APIError(400, f"input[{i}].role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", param="input")
    content = item.get("content")
    if isinstance(content, list):
        content = _text_of(content, i)
    if not isinstance(content, str):
        raise APIError(400, f"input[{i}].content must be a string or a list of text parts", param="input")
    return {"role": "system" if role == "developer" else role, "content": content}


def _text_of(parts: List[Any], i: int) -> str:
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"input[{i}]: only text content parts ({', '.join(TEXT_PARTS[:2])}) are supported, "
                                f"got {kind!r}", param="input")
        texts.append(part["text"])
    return "".join(texts)


def chat_tools(tools: Optional[List[Any]]) -> List[Dict[str, Any]]:
    """The function tools (a namespace's among them) in chat's shape; hosted tools are left out."""
    out: List[Dict[str, Any]] = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            out += chat_tools(tool["tools"])
        elif kind == "function" and isinstance(tool.get("function"), dict):  # chat's shape, sent here anyway
            out.append({"type": "function", "function": tool["function"]})
        elif kind == "function":  # {type, name, description, parameters, strict}
            if not isinstance(tool.get("name"), str):
                raise APIError(400, f"tools[{i}]: a function tool needs a string name", param="tools")
            fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            out.append({"type": "function", "function": fn})
        else:
            logger.info("tools[%d]: the hosted %s tool is left out: this server cannot run it", i, kind)
    return out


def tool_namespaces(tools: Optional[List[Any]]) -> Dict[str, str]:
    return {fn["name"]: tool["name"] for tool in tools or [] if isinstance(tool, dict)
            and tool.get("type") == "namespace" and isinstance(tool.get("name"), str)
            and isinstance(tool.get("tools"), list)
            for fn in tool["tools"] if isinstance(fn, dict) and isinstance(fn.get("name"), str)}


def chat_tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": "
                        "...}", param="tool_choice")


def echo_fields(req: ResponsesRequest) -> Dict[str, Any]:
    return {"instructions": req.instructions, "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "text": req.text or {"format": {"type": "text"}},
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "store": False, "metadata": req.metadata, "user": req.user, "reasoning": req.reasoning,
            "previous_response_id": None, "truncation": "disabled"}


async def respond(state: ServerState, request: Request) -> Response:
    req, large = await parse_body(request, ResponsesRequest)
    state.check_generation_model(req.model)
    plan = await plan_chat(state.prompts, chat_inputs(req), state.info.limits, large)
    renderer = ResponseRenderer(state.served_model_name, echo_fields(req),
                                lambda text: len(state.tokenizer(text, add_special_tokens=False).input_ids),
                                plan.tools, plan.reasoning, tool_namespaces(req.tools))
    return await serve(state, request, Generation([plan.prompt_ids], plan.params), renderer, bool(req.stream))
