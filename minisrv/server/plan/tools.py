"""Tool calling: OpenAI `tools` / `tool_choice` in, the model's tool-call text out as OpenAI `tool_calls`.

The tools reach the chat template as `apply_chat_template(tools=...)` takes them; the model's calls are parsed in the
format its template teaches (`--tool-call-parser`, or `auto` from the template): hermes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes) or llama3_json, a bare
`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>` (Llama 3.x). `tool_choice` "required" and a
named function are enforced with a JSON-schema grammar (as vLLM does): a named function's output is its arguments
object; "required" makes a JSON array of {"name", "parameters"} objects (exactly one with `parallel_tool_calls:
false`, which also keeps only the first call of any answer). A call list cut off by max_tokens keeps its complete
calls."""
from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from minisrv.engine.grammar_check import grammar_error
from minisrv.engine.request import RequestError

PARSERS = ("auto", "hermes", "llama3_json")
HERMES_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON string, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: Optional[int] = None) -> Dict[str, Any]:
        """The call as an entry of OpenAI's tool_calls (a streamed one carries its index first)."""
        return {**({} if index is None else {"index": index}), "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolPlan:
    """How one chat request uses tools: what the template gets, which grammar constrains the output (if any), and
    how the output is read back."""

    template_tools: Optional[List[Dict[str, Any]]]  # None: the template sees no tools (none, or none given)
    mode: str  # "off" (no tools or tool_choice none) | "auto" | "required" | "named"
    names: List[str]
    json_schema: Optional[str] = None  # the grammar for required / named
    named: Optional[str] = None
    parser: str = "hermes"
    legacy: bool = False  # asked with the legacy functions: the call is answered as message.function_call
    parallel: bool = True  # False: at most one call (parallel_tool_calls false)


def _function_of(tool: Any, i: int) -> Dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
            not isinstance(tool.get("function"), dict):
        raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise RequestError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -", "tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    # checked whatever tool_choice is: with "auto" the schema only reaches the template, but a client whose schema
    # is broken wants to hear it from the request that sent it, not from a later one that forces the call
    why = grammar_error("json_schema", json.dumps(params))
    if why is not None:
        raise RequestError(f"tools[{i}].function.parameters is not a valid JSON schema: {why}", "tools")
    return {"name": name, "description": fn.get("description", ""), "parameters": params}


def plan_tools(tools: Optional[List[Any]], tool_choice: Any, functions: Optional[List[Any]] = None,
               function_call: Any = None, parser: str = "hermes", parallel: Optional[bool] = None) -> ToolPlan:
    """Validate tools and tool_choice (legacy functions / function_call map onto them); raises RequestError.
    `parallel`: the request's parallel_tool_calls (None: not given, calls may be parallel)."""
    if parallel is not None and not tools and not functions:
        raise RequestError("parallel_tool_calls is only allowed when tools are given", "parallel_tool_calls")
    if functions is not None:
        if tools is not None:
            raise RequestError("give tools or the legacy functions, not both", "functions")
        tools = [{"type": "function", "function": f} for f in functions]
        if function_call is not None:
            tool_choice = function_call if isinstance(function_call, str) else \
                {"type": "function", "function": {"name": (function_call or {}).get("name")}}
    elif function_call is not None:
        raise RequestError("function_call needs functions", "function_call")
    plan = functools.partial(ToolPlan, parser=parser, legacy=functions is not None, parallel=parallel is not False)
    if not tools:
        if tool_choice is not None:  # as OpenAI answers, "none" and "auto" included
            raise RequestError("tool_choice is only allowed when tools are given", "tool_choice")
        return plan(None, "off", [])
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", "tools")
    fns = [_function_of(t, i) for i, t in enumerate(tools)]
    names = [f["name"] for f in fns]
    if len(set(names)) != len(names):
        raise RequestError("tool names must be unique", "tools")
    template_tools = [{"type": "function", "function": f} for f in fns]
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto"):
        return plan(None if choice == "none" else template_tools, "off" if choice == "none" else "auto", names)
    if choice == "required":
        any_call = [{"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": f["parameters"]},
                     "required": ["name", "parameters"]} for f in fns]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": any_call}}
        if parallel is False:
            schema["maxItems"] = 1
        return plan(template_tools, "required", names, json.dumps(schema))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise RequestError(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
        return plan(template_tools, "named", names, json.dumps(fns[names.index(name)]["parameters"]), named=name)
    raise RequestError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", "tool_choice")


def parser_for(chat_template: Optional[str], wanted: str) -> str:
    if wanted != "auto":
        return wanted
    t = chat_template or ""
    return "llama3_json" if HERMES_OPEN not in t and (PYTHON_TAG in t or "ipython" in t) else "hermes"


def _call_from_obj(obj: Any) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _call_from_json(text: str) -> Optional[ToolCall]:
    try:
        return _call_from_obj(json.loads(text))
    except ValueError:
        return None


def _array_items(text: str) -> Optional[List[Any]]:
    """The complete items of a JSON array, also of one cut off after them (None: not an array)."""
    body = text.lstrip()
    if not body.startswith("["):
        return None
    decoder, items, at = json.JSONDecoder(), [], 1
    while True:
        while at < len(body) and body[at] in " \t\r\n,":
            at += 1
        if at >= len(body) or body[at] == "]":
            return items
        try:
            item, at = decoder.raw_decode(body, at)
        except ValueError:
            return items
        items.append(item)


def parse_tool_calls(text: str, plan: ToolPlan) -> Tuple[Optional[str], List[ToolCall]]:
    """The model's output -> (content left, tool calls). Text that is not a well-formed call stays content. (Without
    parallel calls, answer.py keeps the first.)"""
    if plan.mode == "named":
        return None, [ToolCall(plan.named, text.strip())]
    if plan.mode == "required":
        items = _array_items(text)
        calls = [c for c in (_call_from_obj(i) for i in items or []) if c]
        return (None, calls) if calls else (text, [])
    if plan.parser == "hermes":
        found = (_call_from_json(m.group(1)) for m in _HERMES_CALL.finditer(text))
        calls = [c for c in found if c is not None and c.name in plan.names]
        if not calls:
            return text, []
        content = text[:text.find(HERMES_OPEN)].strip()
        return content or None, calls
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    calls = [_call_from_json(part) for part in body.split(";") if part.strip()]
    if not calls or any(c is None or c.name not in plan.names for c in calls):
        return text, []  # all of it is calls, or none of it is
    return None, calls


def content_prefix_len(text: str, plan: ToolPlan) -> int:
    """While streaming with tool_choice auto: how much of the text is surely content (it is shown at once); the
    rest may be, or become, a tool call and is held until the end."""
    if plan.parser == "hermes":
        at = text.find(HERMES_OPEN)
        if at >= 0:
            return at
        for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
            if text.endswith(HERMES_OPEN[:k]):
                return len(text) - k
        return len(text)
    stripped = text.lstrip()
    if not stripped or stripped[0] == "{" or PYTHON_TAG.startswith(stripped[:len(PYTHON_TAG)]):
        return 0  # a llama3_json call is the whole output: hold it while it may be one
    return len(text)
