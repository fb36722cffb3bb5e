"""One Messages API answer in Anthropic's shapes. A message's content is a thinking block (`signature` empty),
a text block and a tool_use block per call, in that order (none of those: one empty text block). A stream carries
those blocks: message_start, per block content_block_start / _delta / _stop, then message_delta and message_stop;
a failure after it began is an `error` event, and there is no [DONE]."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import APIError
from ..generation import Choice
from ..openai.logprobs import PositionedLogprob
from ..openai.protocol import UsageInfo
from ..plan.answer import AnswerStream, read_answer
from ..plan.reasoning import ReasoningPlan
from ..plan.tools import ToolCall, ToolPlan
from ..streaming import sse

# the stop_reason of an engine finish_reason (a "stop" that matched a stop string is "stop_sequence")
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


def stop_reason(finish_reason: Optional[str], stop_str: Optional[str], tool_calls: bool) -> Tuple[str, Optional[str]]:
    """A message's stop_reason and stop_sequence."""
    if finish_reason == "stop" and tool_calls:
        return "tool_use", None
    if finish_reason == "stop" and stop_str is not None:
        return "stop_sequence", stop_str
    return STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


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
    """generation.serve's renderer for /v1/messages (one choice): the whole message, or the stream's blocks."""

    model: str
    input_tokens: int
    tools: Optional[ToolPlan] = None
    reasoning: Optional[ReasoningPlan] = None
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    # while streaming: the output's reader, the open block (its index, -1: none yet; its type), events to send
    _answer: Optional[AnswerStream] = None
    _index: int = -1
    _open: Optional[str] = None
    _events: List[Dict[str, Any]] = field(default_factory=list)

    def message(self, content: List[Dict[str, Any]], stop: Tuple[Optional[str], Optional[str]],
                output_tokens: int) -> Dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens}}

    def response(self, choices: Sequence[Choice], usage: UsageInfo) -> Dict[str, Any]:
        ch = choices[0]
        a = read_answer(ch.text, self.tools, self.reasoning, ch.token_ids)
        blocks = [{"type": "thinking", "thinking": a.reasoning, "signature": ""}] if a.reasoning else []
        blocks += [{"type": "text", "text": a.content}] if a.content else []
        blocks += [tool_use_block(c) for c in a.calls]
        return self.message(blocks or [{"type": "text", "text": ""}],
                            stop_reason(ch.finish_reason, ch.stop_str, bool(a.calls)), ch.num_output_tokens)

    def opening(self, choice: Choice) -> List[str]:
        self._answer = AnswerStream(self.tools, self.reasoning)
        return [sse({"type": "message_start", "message": self.message([], (None, None), 0)}, "message_start"),
                sse({"type": "ping"}, "ping")]

    def closing(self, usage: UsageInfo) -> List[str]:
        return []

    def failed(self, error: APIError) -> List[str]:
        return [sse(error.anthropic_body(), "error")]

    def _block(self, block: Dict[str, Any], delta: Optional[Dict[str, Any]] = None) -> None:
        """`delta` added to the open block; a new `block` first where the type changes (a tool_use: always)."""
        if self._open != block["type"] or block["type"] == "tool_use":
            if self._open is not None:
                self._events.append({"type": "content_block_stop", "index": self._index})
            self._index, self._open = self._index + 1, block["type"]
            self._events.append({"type": "content_block_start", "index": self._index, "content_block": block})
        if delta is not None:
            self._events.append({"type": "content_block_delta", "index": self._index, "delta": delta})

    def chunks(self, choice: Choice, text: str, logprobs: List[PositionedLogprob],
               finish_reason: Optional[str]) -> List[str]:
        """The stream's blocks for one text delta (with the finish, at the end)."""
        final = finish_reason is not None
        d = self._answer.feed(text, final, choice.token_ids)
        if d.reasoning:
            self._block({"type": "thinking", "thinking": "", "signature": ""},
                        {"type": "thinking_delta", "thinking": d.reasoning})
        if d.content:
            self._block({"type": "text", "text": ""}, {"type": "text_delta", "text": d.content})
        for call in d.calls:
            block = tool_use_block(call)
            self._block({**block, "input": {}},
                        {"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        if final:
            if self._index < 0:  # nothing was said: one empty text block, as the whole message has
                self._block({"type": "text", "text": ""})
            reason, sequence = stop_reason(finish_reason, choice.stop_str, bool(d.calls))
            self._events += [{"type": "content_block_stop", "index": self._index},
                             {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                              "usage": {"output_tokens": choice.num_output_tokens}}, {"type": "message_stop"}]
        out, self._events = self._events, []
        return [sse(data, data["type"]) for data in out]
