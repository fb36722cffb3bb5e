"""The request plan: one chat request, whichever API it came by, into what the engine takes and its renderer needs.

Each chat-shaped API converts its request into `ChatInputs`; `plan_chat` makes the rest the same way for all: the
tool plan (tools.py), the prompt (prompt.py), the reasoning plan (reasoning.py), the prompt ids and the
SamplingParams, checked against the model. A failure is a RequestError (a 400) naming the field as the request
names it. Without sampling fields (counting a prompt) it stops after the prompt ids."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from minisrv.engine.grammar_check import check_grammar
from minisrv.engine.request import RequestError, RequestLimits, SamplingParams, check_request

from .prompt import ASYNC_ENCODE_CHARS, PromptMaker, off_loop
from .reasoning import ReasoningPlan, plan_reasoning
from .sampling import CONSTRAINTS, fields_named
from .tools import ToolPlan, plan_tools


@dataclass(frozen=True)
class ChatInputs:
    """A chat request in the plan's terms (what each API's converter makes of its request)."""

    messages: List[Dict[str, Any]]
    tools: Optional[List[Any]] = None  # [{"type": "function", "function": {...}}]
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[List[Any]] = None  # chat's legacy form of tools / tool_choice
    function_call: Any = None
    template_kwargs: Optional[Dict[str, Any]] = None
    thinking_budget: Optional[int] = None
    separate_reasoning: bool = True
    sampling: Optional[Dict[str, Any]] = None  # SamplingParams fields; None: only the prompt is made
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes the special tokens itself
    param_names: Mapping[str, str] = field(default_factory=dict)  # a field's name in the request, for a 400


@dataclass(frozen=True)
class ChatPlan:

    prompt_ids: List[int]
    params: Optional[SamplingParams]  # None when no sampling fields were given
    tools: ToolPlan
    reasoning: Optional[ReasoningPlan]  # how the output text is split (None: no reasoning parser)


def prompt_text(maker: PromptMaker, inputs: ChatInputs) -> Tuple[str, ToolPlan]:
    tools = plan_tools(inputs.tools, inputs.tool_choice, inputs.functions, inputs.function_call,
                       maker.tool_parser, inputs.parallel_tool_calls)
    if tools.json_schema is not None and any(inputs.sampling and inputs.sampling.get(k) for k in CONSTRAINTS):
        raise RequestError("tool_choice required or a named function cannot be combined with a response_format, "
                           "regex or ebnf", "tool_choice")
    kwargs = maker.check_template_kwargs(inputs.template_kwargs)
    text = maker.template(inputs.messages, tools.template_tools, kwargs, inputs.add_generation_prompt,
                          inputs.continue_final_message)
    return text, tools


def finish_plan(maker: PromptMaker, inputs: ChatInputs, text: str, tools: ToolPlan,
                limits: Optional[RequestLimits]) -> ChatPlan:
    reasoning, rule = plan_reasoning(maker.reasoning, text, inputs.separate_reasoning, inputs.thinking_budget)
    ids = maker.encode(text, inputs.add_special_tokens, "messages", limits.max_request_len if limits else None)
    params = None
    if inputs.sampling is not None:
        params = SamplingParams(**{**inputs.sampling, "json_schema": tools.json_schema or
                                   inputs.sampling.get("json_schema"), "thinking": rule})
        if limits is not None:
            check_request(ids, params, limits, "messages")
        check_grammar(params)
    return ChatPlan(ids, params, tools, reasoning)


async def plan_chat(maker: PromptMaker, inputs: ChatInputs, limits: Optional[RequestLimits],
                    large: bool = False) -> ChatPlan:
    """The plan, made off the event loop where it may take long: templating for a large body, tokenizing and
    checking for a large body or a long prompt text. (The offline API calls prompt_text and finish_plan.)"""
    with fields_named(inputs.param_names):
        # tools' schemas and a grammar are checked off the loop too: their first check imports the grammar engine
        text, tools = await off_loop(large or bool(inputs.tools or inputs.functions),
                                     lambda: prompt_text(maker, inputs))
        constrained = tools.json_schema is not None or any((inputs.sampling or {}).get(k) for k in CONSTRAINTS)
        return await off_loop(large or len(text) > ASYNC_ENCODE_CHARS or constrained,
                              lambda: finish_plan(maker, inputs, text, tools, limits))
