"""OpenAI's Responses API on the way out, whole or streamed.

A response's `output` is, in order: a reasoning item (its text as reasoning_text content, `summary` empty), a message
item (one output_text part), and a function_call item per tool call (a namespace's function names its namespace,
as Codex CLI requires). One cut off by max_output_tokens is `status: "incomplete"`.

Streamed: response.created and response.in_progress; per item output_item.added, then for text content_part.added,
the deltas and their .done, content_part.done, or for a call function_call_arguments.delta and .done;
output_item.done; at the end response.completed with the whole response (an incomplete one too: the openai client's
stream helper expects it). Each event carries `type` and a `sequence_number`; a failure after the stream began is an
`error` event, and the stream ends."""
from __future__ import annotations

import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import APIError
from ..generation import Choice
from ..openai.logprobs import PositionedLogprob
from ..openai.protocol import UsageInfo, now
from ..plan.answer import AnswerStream, read_answer
from ..plan.reasoning import ReasoningPlan
from ..plan.tools import ToolCall, ToolPlan
from ..streaming import sse


ID_PREFIX = {"reasoning": "rs", "message": "msg", "call": "fc"}  # an output item's kind -> its id's prefix
EVENTS = {"reasoning": "response.reasoning_text", "message": "response.output_text",  # its text's events
          "call": "response.function_call_arguments"}
TEXT_EXTRA = {"reasoning": {"content_index": 0}, "message": {"content_index": 0, "logprobs": []}, "call": {}}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def framed(events: List[Dict[str, Any]]) -> List[str]:
    return [sse(e, e["type"]) for e in events]


def usage_of(u: UsageInfo, reasoning_tokens: int) -> Dict[str, Any]:
    """The usage in the Responses shape. reasoning_tokens: the reasoning text's tokens counted anew (the engine
    counts no split), at most the output's."""
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, u.completion_tokens)}}


def status_of(finish_reason: Optional[str]) -> Tuple[str, Optional[Dict[str, Any]]]:
    """A response's (and its items') status, and its incomplete_details."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def content_part(kind: str, text: str) -> Dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_item(kind: str, item_id: str, text: str, status: str, call: Optional[ToolCall] = None,
                namespaces: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """An output item of `kind` (reasoning, message or call) holding `text` (a call's arguments); one in progress
    has no content yet."""
    content = [content_part(kind, text)] if status != "in_progress" else []
    if kind == "reasoning":
        return {"type": "reasoning", "id": item_id, "summary": [], "status": status, "content": content}
    if kind == "message":
        return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}
    item = {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name, "arguments": text,
            "status": status}
    if call.name in (namespaces or {}):
        item["namespace"] = namespaces[call.name]
    return item


class ResponseRenderer:
    """generation.serve's renderer for /v1/responses (one choice): the whole response, or the stream's events."""

    def __init__(self, model: str, echo: Dict[str, Any], count_tokens: Callable[[str], int],
                 tools: Optional[ToolPlan], reasoning: Optional[ReasoningPlan],
                 namespaces: Optional[Dict[str, str]] = None) -> None:
        self.id = new_id("resp")
        self.created_at = now()
        self.model, self.echo, self.count_tokens = model, echo, count_tokens
        self.tools, self.reasoning = tools, reasoning
        self.namespaces = namespaces or {}  # a namespace's function name -> the namespace's name
        self.answer = AnswerStream(tools, reasoning)
        self.seq = 0
        self.output: List[Dict[str, Any]] = []  # finished items
        self.open: Optional[Dict[str, Any]] = None  # the item being streamed: its kind, id, call and text so far
        self.finish: Optional[str] = None
        self.thought = ""

    def frame(self, output: List[Dict[str, Any]], status: str, incomplete: Optional[Dict[str, Any]] = None,
              usage: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": status, "incomplete_details": incomplete, "error": None, "output": output,
                "usage": usage, **self.echo}

    def response(self, choices: Sequence[Choice], usage: UsageInfo) -> Dict[str, Any]:
        ch = choices[0]
        a = read_answer(ch.text, self.tools, self.reasoning, ch.token_ids)
        status, incomplete = status_of(ch.finish_reason)
        items = [("reasoning", a.reasoning, None)] if a.reasoning else []
        if a.content or not (a.reasoning or a.calls):
            items.append(("message", a.content or "", None))
        items += [("call", c.arguments, c) for c in a.calls]
        output = [output_item(kind, new_id(ID_PREFIX[kind]), text, status, call, self.namespaces)
                  for kind, text, call in items]
        used = usage_of(usage, self.count_tokens(a.reasoning) if a.reasoning else 0)
        return self.frame(output, status, incomplete, used)

    def _event(self, kind: str, **fields: Any) -> Dict[str, Any]:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def opening(self, choice: Choice) -> List[str]:
        r = self.frame([], "in_progress")
        return framed([self._event("response.created", response=r), self._event("response.in_progress", response=r)])

    def _item(self, status: str) -> Dict[str, Any]:
        o = self.open
        return output_item(o["kind"], o["id"], o["text"], status, o["call"], self.namespaces)

    def _open(self, kind: str, call: Optional[ToolCall] = None) -> List[Dict[str, Any]]:
        out = self._close()
        item_id = new_id(ID_PREFIX[kind])
        self.open = {"kind": kind, "id": item_id, "text": "", "call": call}
        out.append(self._event("response.output_item.added", output_index=len(self.output),
                               item=self._item("in_progress")))
        if kind != "call":
            out.append(self._event("response.content_part.added", output_index=len(self.output), item_id=item_id,
                                   content_index=0, part=content_part(kind, "")))
        return out

    def _add(self, kind: str, delta: str, call: Optional[ToolCall] = None) -> List[Dict[str, Any]]:
        """`delta` added to the open item of `kind` (a new one, where another is open or this is a new call)."""
        out = self._open(kind, call) if self.open is None or self.open["kind"] != kind or call is not None else []
        self.open["text"] += delta
        return out + [self._event(EVENTS[kind] + ".delta", output_index=len(self.output), item_id=self.open["id"],
                                  delta=delta, **TEXT_EXTRA[kind])]

    def _close(self, status: str = "completed") -> List[Dict[str, Any]]:
        o = self.open
        if o is None:
            return []
        kind, text, at = o["kind"], o["text"], dict(output_index=len(self.output), item_id=o["id"])
        if kind == "call":
            out = [self._event(EVENTS[kind] + ".done", arguments=text, **at)]
        else:
            out = [self._event(EVENTS[kind] + ".done", text=text, **TEXT_EXTRA[kind], **at),
                   self._event("response.content_part.done", content_index=0, part=content_part(kind, text), **at)]
        item = self._item(status)
        out.append(self._event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.open = None
        return out

    def chunks(self, choice: Choice, text: str, logprobs: List[PositionedLogprob],
               finish_reason: Optional[str]) -> List[str]:
        d = self.answer.feed(text, finish_reason is not None, choice.token_ids)
        self.thought += d.reasoning or ""
        out = self._add("reasoning", d.reasoning) if d.reasoning else []
        if d.content:
            out += self._add("message", d.content)
        for call in d.calls:  # a call opens with its id and name, then its arguments
            out += self._add("call", call.arguments, call)
        if finish_reason:
            self.finish = finish_reason
        return framed(out)

    def closing(self, usage: UsageInfo) -> List[str]:
        """The stream's end: what is open closed, then response.completed with the whole response."""
        status, incomplete = status_of(self.finish)
        out = self._close(status)
        if not self.output:  # nothing was said at all: an empty message, as the whole response has (its status)
            out += self._open("message") + self._close(status)
        count = self.count_tokens(self.thought) if self.thought else 0
        r = self.frame(self.output, status, incomplete, usage_of(usage, count))
        return framed(out + [self._event("response.completed", response=r)])

    def failed(self, error: APIError) -> List[str]:
        """A failure after the stream began (OpenAI's error body as an `error` event)."""
        err = error.body()["error"]
        return framed([self._event("error", code=err["code"], message=err["message"], param=err["param"], error=err)])
