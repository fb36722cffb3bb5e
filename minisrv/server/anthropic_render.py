"""One Messages API answer in Anthropic's shapes: the whole message, and the stream's events.

The output text is read as chat reads it: the thinking split off first (server/reasoning.py, where the server has a
reasoning parser), then the answer read for tool calls (server/tools.py). A message's content is, in order, a
thinking block (`signature` empty: nothing here signs it), a text block, and a tool_use block per call (its
`input` the parsed arguments); with none of those, one empty text block. A stream carries exactly those blocks:
message_start (the message, content empty), per block content_block_start / content_block_delta (thinking_delta,
text_delta, input_json_delta) / content_block_stop, then message_delta (stop_reason, stop_sequence, output_tokens)
and message_stop. As in chat's stream, text that may be a tool call is held back until the output ends.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .anthropic_protocol import stop_reason
from .reasoning import ReasoningStream
from .reasoning_plan import ReasoningPlan
from .tools import ToolCall, ToolPlan, content_prefix_len, parse_tool_calls

Event = Tuple[str, Dict[str, Any]]  # (event name, data)


def sse_event(name: str, data: Dict[str, Any]) -> str:
    """One server-sent event as Anthropic sends it: named, its data JSON."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def tool_use_block(call: ToolCall) -> Dict[str, Any]:
    try:
        args = json.loads(call.arguments)
    except ValueError:
        args = None
    # arguments that are not a JSON object (cut off by max_tokens): an empty input; stop_reason says max_tokens
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": args if isinstance(args, dict) else {}}


@dataclass
class MessageRenderer:
    id: str
    model: str
    input_tokens: int
    tools: Optional[ToolPlan] = None
    reasoning: Optional[ReasoningPlan] = None

    def tools_on(self) -> bool:
        return self.tools is not None and self.tools.active

    def message(self, content: List[Dict[str, Any]], reason: Optional[str], stop_sequence: Optional[str],
                output_tokens: int) -> Dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop_sequence,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens}}

    def whole(self, text: str, finish_reason: Optional[str], stop_str: Optional[str],
              output_tokens: int) -> Dict[str, Any]:
        """The response of a request that did not stream."""
        blocks: List[Dict[str, Any]] = []
        answer = text
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            answer = split.answer
            if split.reasoning:
                blocks.append({"type": "thinking", "thinking": split.reasoning, "signature": ""})
        content: Optional[str] = answer
        calls: List[ToolCall] = []
        if self.tools_on():
            content, calls = parse_tool_calls(answer, self.tools)
        if content:
            blocks.append({"type": "text", "text": content})
        blocks += [tool_use_block(c) for c in calls]
        if not blocks:
            blocks.append({"type": "text", "text": ""})
        reason = stop_reason(finish_reason, stop_str, bool(calls))
        return self.message(blocks, reason, stop_str if reason == "stop_sequence" else None, output_tokens)

    def stream(self) -> "MessageStream":
        return MessageStream(self)


@dataclass
class MessageStream:
    """One streamed answer: `opening()` first, then `feed` each text delta (with the finish, at the end)."""

    r: MessageRenderer
    index: int = -1  # the open block's index (-1: none yet)
    open: Optional[str] = None  # the open block's type
    answer: str = ""  # the answer so far (after the thinking)
    sent: int = 0  # characters of the answer shown
    split: Optional[ReasoningStream] = None
    _events: List[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.r.reasoning is not None:
            self.split = self.r.reasoning.stream()

    def opening(self) -> List[Event]:
        return [("message_start", {"type": "message_start", "message": self.r.message([], None, None, 0)}),
                ("ping", {"type": "ping"})]

    def _close(self) -> None:
        if self.open is not None:
            self._events.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
            self.open = None

    def _start(self, block: Dict[str, Any]) -> None:
        self._close()
        self.index += 1
        self.open = block["type"]
        self._events.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block}))

    def _delta(self, kind: str, delta: Dict[str, Any]) -> None:
        if self.open != kind:
            self._start({"type": kind, "thinking": "", "signature": ""} if kind == "thinking"
                        else {"type": "text", "text": ""})
        self._events.append(("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                     "delta": delta}))

    def _text(self, text: str) -> None:
        if text:
            self._delta("text", {"type": "text_delta", "text": text})
            self.sent += len(text)

    def feed(self, text: str, finish_reason: Optional[str], stop_str: Optional[str] = None,
             output_tokens: int = 0) -> List[Event]:
        final = finish_reason is not None
        if self.split is not None:
            piece = self.split.feed(text, final=final)
            if piece.reasoning:
                self._delta("thinking", {"type": "thinking_delta", "thinking": piece.reasoning})
            text = piece.answer
        self.answer += text
        calls: List[ToolCall] = []
        if not self.r.tools_on():
            self._text(text)
        elif not final:
            sure = content_prefix_len(self.answer, self.r.tools) if self.r.tools.mode == "auto" else 0
            if sure > self.sent:
                self._text(self.answer[self.sent:sure])
        else:
            content, calls = parse_tool_calls(self.answer, self.r.tools)
            self._text((content or "")[self.sent:] if calls else self.answer[self.sent:])
            for call in calls:
                block = tool_use_block(call)
                self._start({**block, "input": {}})
                self._events.append(("content_block_delta", {
                    "type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
        if final:
            if self.index < 0:  # nothing was said: one empty text block, as the whole message has
                self._start({"type": "text", "text": ""})
            self._close()
            reason = stop_reason(finish_reason, stop_str, bool(calls))
            self._events.append(("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": stop_str if reason == "stop_sequence" else None},
                "usage": {"output_tokens": output_tokens}}))
            self._events.append(("message_stop", {"type": "message_stop"}))
        out, self._events = self._events, []
        return out


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"
