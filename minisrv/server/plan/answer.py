"""One output text read as the plan asked: the thinking split off (reasoning.py), then the answer read for tool calls
(tools.py), whole (`read_answer`) or as it streams (`AnswerStream`, which holds back what may still become a call)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from .reasoning import ReasoningStream
from .reasoning_plan import ReasoningPlan
from .tools import ToolCall, ToolPlan, content_prefix_len, parse_tool_calls


@dataclass
class Answer:

    reasoning: Optional[str]  # the thinking, stripped (None: it did not think, or no parser)
    raw: str  # the text before the answer as written (the thinking with its tags)
    content: Optional[str]  # the answer less its tool calls (None: nothing but calls)
    calls: List[ToolCall]


def tools_on(tools: Optional[ToolPlan]) -> bool:
    return tools is not None and tools.active


def read_answer(text: str, tools: Optional[ToolPlan], reasoning: Optional[ReasoningPlan]) -> Answer:
    thought, raw, answer = None, "", text
    if reasoning is not None:
        split = reasoning.split(text)
        thought, raw, answer = split.reasoning, split.raw, split.answer
    content: Optional[str] = answer
    calls: List[ToolCall] = []
    if tools_on(tools):
        content, calls = parse_tool_calls(answer, tools)
    return Answer(thought, raw, content, calls)


@dataclass
class Delta:
    """What one piece of output text adds (empty where it adds nothing); `calls` only with the last piece."""

    reasoning: str = ""
    raw: str = ""  # text before the answer, as written
    content: str = ""
    calls: List[ToolCall] = field(default_factory=list)


class AnswerStream:
    """One output read as it arrives: `feed` each text delta, final=True with the last."""

    def __init__(self, tools: Optional[ToolPlan], reasoning: Optional[ReasoningPlan]) -> None:
        self.tools = tools if tools_on(tools) else None
        self.split: Optional[ReasoningStream] = reasoning.stream() if reasoning is not None else None
        self.answer = ""  # the answer so far (after the thinking)
        self.sent = 0  # characters of the answer given out as content

    def feed(self, text: str, final: bool) -> Delta:
        out = Delta()
        if self.split is not None:
            piece = self.split.feed(text, final=final)
            out.reasoning, out.raw, text = piece.reasoning, piece.raw, piece.answer
        self.answer += text
        plan = self.tools
        if plan is None:
            out.content = text
        elif not final:
            sure = content_prefix_len(self.answer, plan) if plan.mode == "auto" else 0
            if sure > self.sent:
                out.content = self.answer[self.sent:sure]
        else:
            content, out.calls = parse_tool_calls(self.answer, plan)
            out.content = (content or "")[self.sent:] if out.calls else self.answer[self.sent:]
        self.sent += len(out.content)
        return out
