"""One output text read as the plan asked: the thinking split off (reasoning.py), then the answer read for tool calls
(tools.py), whole (`read_answer`) or as it streams (`AnswerStream`, which holds back what may still become a call).
With `separate_reasoning: false` the thinking is not split off: it stays in the content, as written, before the
answer. A harmony output (gpt-oss) is read from its token ids instead, by harmony.py's reader, which splits the
reasoning and the calls off by channel."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from .reasoning import HARMONY, ReasoningPlan, ReasoningStream
from .tools import ToolCall, ToolPlan, content_prefix_len, parse_tool_calls


@dataclass
class Answer:
    """A whole output, or what one piece of a streamed one adds (`calls` only with the last piece)."""

    reasoning: str = ""  # the thinking, stripped (none where it is not split off)
    content: Optional[str] = ""  # the answer less its tool calls (None: it only thought, or nothing but calls)
    calls: List[ToolCall] = field(default_factory=list)


def read_answer(text: str, tools: Optional[ToolPlan], reasoning: Optional[ReasoningPlan],
                ids: Sequence[int] = ()) -> Answer:
    """A whole output (its text, and its ids for a harmony one): read as a stream of one piece."""
    a = AnswerStream(tools, reasoning).feed(text, True, ids)
    if not a.content and (a.reasoning or a.calls):
        a.content = None
    return a


class AnswerStream:
    """One output read as it arrives: `feed` each text delta, final=True with the last, and the output's ids so
    far (read only for a harmony output)."""

    def __init__(self, tools: Optional[ToolPlan], reasoning: Optional[ReasoningPlan]) -> None:
        self.tools = tools if tools is not None and tools.mode != "off" else None
        self.separate = reasoning is None or reasoning.separate
        self.harmony = None
        if reasoning is not None and reasoning.mode == HARMONY:
            from .harmony import HarmonyStream  # openai-harmony is imported where a harmony model is served
            self.harmony = HarmonyStream(reasoning.encoding, self.tools.names if self.tools else ())
        self.split = ReasoningStream(reasoning.mode) if reasoning is not None and self.harmony is None else None
        self.answer = ""  # the answer so far (after the thinking)
        self.sent = 0  # characters of the answer given out as content
        self.seen = 0  # ids read (harmony)
        # each piece is content as it is, nothing split off or held back: feed need not be called
        self.plain = self.tools is None and self.split is None and self.harmony is None

    def feed(self, text: str, final: bool, ids: Sequence[int] = ()) -> Answer:
        if self.harmony is not None:
            reasoning, content, calls = self.harmony.feed(ids[self.seen:], final)
            self.seen = len(ids)
            if not self.separate:
                reasoning, content = "", reasoning + content
            return Answer(reasoning, content, calls if not calls or self.tools.parallel else calls[:1])
        out, head = Answer(), ""
        if self.split is not None:
            piece = self.split.feed(text, final=final)
            text = piece.answer
            if self.separate:
                out.reasoning = piece.reasoning
            else:
                head = piece.raw
        self.answer += text
        plan = self.tools
        if plan is None:
            out.content = text
        elif not final:
            sure = content_prefix_len(self.answer, plan) if plan.mode == "auto" else 0
            if sure > self.sent:
                out.content = self.answer[self.sent:sure]
        else:
            content, calls = parse_tool_calls(self.answer, plan)
            out.calls = calls if plan.parallel else calls[:1]
            out.content = (content or "")[self.sent:] if out.calls else self.answer[self.sent:]
        self.sent += len(out.content)
        out.content = head + out.content
        return out
