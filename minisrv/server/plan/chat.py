"""The request plan: one chat request, whichever API it came by, into what the engine takes and its renderer needs.

Each chat-shaped API converts its request into `ChatInputs`; `plan_chat` makes the rest the same way for all: the
tool plan (tools.py), the prompt (prompt.py), the reasoning plan (reasoning.py), the prompt ids and the
SamplingParams, checked against the model. A failure is a RequestError (a 400) naming the field as the request
names it. Without sampling fields (counting a prompt) it stops after the prompt ids. A gpt-oss model's prompt is
rendered by harmony (harmony.py) straight into ids, with the request's reasoning effort; its output is read by
channel, so a grammar (which would constrain the whole output, channels and all) and a thinking budget are refused."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from minisrv.engine.grammar_check import check_grammar
from minisrv.engine.request import RequestError, RequestLimits, SamplingParams, check_request

from .prompt import ASYNC_ENCODE_CHARS, PromptMaker, off_loop
from .reasoning import HARMONY, ReasoningPlan, plan_reasoning
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
    reasoning_effort: Optional[str] = None  # low | medium | high: read by the harmony format only
    sampling: Optional[Dict[str, Any]] = None  # SamplingParams fields; None: only the prompt is made
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes the special tokens itself
    param_names: Mapping[str, str] = field(default_factory=dict)  # a field's name in the request, for a 400


@dataclass(frozen=True)
class ChatPlan:
    """What plan_chat makes of a chat request: for the engine, and for its renderer (tools, reasoning)."""
    prompt_ids: List[int]
    params: Optional[SamplingParams]  # None when no sampling fields were given
    tools: ToolPlan
    reasoning: Optional[ReasoningPlan]  # how the output text is split (None: no reasoning parser)


def prompt_text(maker: PromptMaker, inputs: ChatInputs) -> Tuple[Union[str, List[int]], ToolPlan]:
    """The prompt (a chat template's text; harmony's ids) and the tool plan."""
    tools = plan_tools(inputs.tools, inputs.tool_choice, inputs.functions, inputs.function_call,
                       maker.tool_parser, inputs.parallel_tool_calls)
    constrained = any(inputs.sampling and inputs.sampling.get(k) for k in CONSTRAINTS)
    if tools.json_schema is not None and constrained:
        raise RequestError("tool_choice required or a named function cannot be combined with a response_format, "
                           "regex or ebnf", "tool_choice")
    if maker.harmony is not None:
        from .harmony import check_effort, render_prompt
        if tools.json_schema is not None or constrained:
            raise RequestError("this model's chat format (harmony) cannot be constrained by a grammar: "
                               "tool_choice required or a named function, response_format, regex and ebnf are "
                               "not served", "tool_choice" if tools.json_schema is not None else "response_format")
        if inputs.continue_final_message:
            raise RequestError("continue_final_message is not served in the harmony format", "messages")
        return render_prompt(maker.harmony, inputs.messages, tools.template_tools,
                             check_effort(inputs.reasoning_effort, "reasoning_effort"),
                             inputs.add_generation_prompt), tools
    kwargs = maker.check_template_kwargs(inputs.template_kwargs)
    text = maker.template(inputs.messages, tools.template_tools, kwargs, inputs.add_generation_prompt,
                          inputs.continue_final_message)
    return text, tools


def finish_plan(maker: PromptMaker, inputs: ChatInputs, prompt: Union[str, List[int]], tools: ToolPlan,
                limits: Optional[RequestLimits]) -> ChatPlan:
    sampling = dict(inputs.sampling or {})
    if maker.harmony is not None:
        from .harmony import stop_ids
        if inputs.thinking_budget is not None:
            raise RequestError("thinking_budget is not served in the harmony format", "thinking_budget")
        reasoning, rule, ids = ReasoningPlan(HARMONY, inputs.separate_reasoning, maker.harmony), None, prompt
        sampling["stop_token_ids"] = tuple(sampling.get("stop_token_ids") or ()) + stop_ids(maker.harmony)
    else:
        reasoning, rule = plan_reasoning(maker.reasoning, prompt, inputs.separate_reasoning, inputs.thinking_budget)
        ids = maker.encode(prompt, inputs.add_special_tokens, "messages", limits.max_request_len if limits else None)
    params = None
    if inputs.sampling is not None:
        params = SamplingParams(**{**sampling, "json_schema": tools.json_schema or sampling.get("json_schema"),
                                   "thinking": rule})
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
        prompt, tools = await off_loop(large or bool(inputs.tools or inputs.functions),
                                       lambda: prompt_text(maker, inputs))
        constrained = tools.json_schema is not None or any((inputs.sampling or {}).get(k) for k in CONSTRAINTS)
        return await off_loop(large or len(prompt) > ASYNC_ENCODE_CHARS or constrained,
                              lambda: finish_plan(maker, inputs, prompt, tools, limits))
