"""/v1/completions' and /v1/chat/completions' renderers (generation.Renderer), in OpenAI's shapes. A completion
chunk carries a text delta (an echoed prompt first); a chat stream opens each choice with an assistant role delta,
then content deltas, then a delta-less chunk with the finish reason."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

from pydantic_core import to_json

from ..errors import APIError
from ..generation import Choice
from ..plan.answer import AnswerStream, read_answer
from ..plan.reasoning import ReasoningPlan
from ..plan.tools import ToolPlan
from ..streaming import SSE_DONE, sse
from .logprobs import PositionedLogprob, TokenText, chat_logprobs, completion_logprobs
from .protocol import Envelope, UsageInfo, chat_message, now

TEXT_SLOT = "\x00text\x00"  # where a chunk's text goes in its template (see OpenAIStream.text_event)


@dataclass
class OpenAIStream:
    """What OpenAI's two streams share: `data: <chunk>` events, the usage chunk when asked for, an error event
    (OpenAI's error body) when a request fails after its stream began, and `data: [DONE]` last."""

    id: str
    model: str
    fingerprint: Optional[str] = None
    include_usage: bool = False  # stream_options.include_usage
    created: int = field(default_factory=now)
    # a chunk's JSON before and after its choices (see event), and per choice index before and after its text
    _around: Optional[Tuple[str, str]] = field(default=None, init=False, repr=False)
    _around_text: Dict[int, Tuple[str, str]] = field(default_factory=dict, init=False, repr=False)

    chunk: ClassVar[str] = "text_completion"  # a stream chunk's object; the last one carries the usage

    def frame(self, obj: str, choices: List[Any], usage: Optional[UsageInfo] = None) -> Envelope:
        """A response or chunk (`obj`: its object) around `choices`."""
        return Envelope(id=self.id, object=obj, created=self.created, model=self.model, choices=choices, usage=usage,
                        system_fingerprint=self.fingerprint)

    def event(self, choice: Dict[str, Any]) -> str:
        """A stream chunk around one choice, as sse(self.frame(self.chunk, [choice])) writes it: the envelope's JSON
        is made once, and each chunk only serializes its choice (as pydantic serializes it inside the envelope)."""
        if self._around is None:
            head, _, tail = self.frame(self.chunk, []).model_dump_json().partition(',"choices":[]')
            self._around = (f'data: {head},"choices":[', f"]{tail}\n\n")
        return to_json(choice).decode().join(self._around)

    def text_event(self, index: int, text: str) -> str:
        """event(self.text_choice(index, text)), the usual chunk (a piece of text, no logprobs, no end): made once
        with a placeholder for the text, after which each chunk only serializes its text."""
        around = self._around_text.get(index)
        if around is None:
            event = self.event(self.text_choice(index, TEXT_SLOT))
            head, _, tail = event.rpartition(to_json(TEXT_SLOT).decode())  # the last: id and model come before
            around = self._around_text[index] = (head, tail)
        return to_json(text).decode().join(around)

    def text_choice(self, index: int, text: str) -> Dict[str, Any]:
        raise NotImplementedError

    def closing(self, usage: UsageInfo) -> List[str]:
        return ([sse(self.frame(self.chunk, [], usage))] if self.include_usage else []) + [SSE_DONE]

    def failed(self, error: APIError) -> List[str]:
        return [sse(error.body()), SSE_DONE]


@dataclass
class CompletionRenderer(OpenAIStream):
    token_text: Optional[TokenText] = None
    logprobs: Optional[int] = None  # the request's `logprobs` (None: none)
    echo_logprobs: bool = False  # echo with logprobs: the prompt's tokens come first, with their logprobs

    def _logprobs(self, lps: Sequence[PositionedLogprob], echoed: Optional[Choice] = None) -> Optional[Dict[str, Any]]:
        """The logprobs of `lps`, after those of the prompt's tokens when `echoed` (echo with logprobs)."""
        if self.logprobs is None:
            return None
        tokens, offset = [], 0
        if echoed is not None:
            scored = echoed.prompt_logprobs or [None] * len(echoed.prompt_ids)
            for tid, lp in zip(echoed.prompt_ids, scored):
                tokens.append((tid, lp, offset))
                offset += len(self.token_text.string(tid))
        tokens += [(lp.token_id, lp, at) for lp, at in lps]
        return completion_logprobs(self.token_text, tokens, self.logprobs)

    def _chunk(self, index: int, text: str, logprobs: Optional[Dict[str, Any]], finish: Optional[str]) -> str:
        return self.event(_choice(index, "text", text, logprobs, finish))

    def text_choice(self, index: int, text: str) -> Dict[str, Any]:
        return _choice(index, "text", text, None, None)

    def opening(self, choice: Choice) -> List[str]:
        if self.echo_logprobs or not choice.prefix:
            return []  # with prompt logprobs the echo waits for them (they come with the first output)
        return [self._chunk(choice.index, choice.prefix, None, None)]

    def chunks(self, choice: Choice, text: str, logprobs: List[PositionedLogprob],
               finish_reason: Optional[str]) -> List[str]:
        if self.logprobs is None and not logprobs and not finish_reason:
            return [self.text_event(choice.index, text)] if text else []
        out = []
        if self.echo_logprobs and not choice.opened:
            choice.opened = True
            out.append(self._chunk(choice.index, choice.prefix, self._logprobs([], choice), None))
        if text or logprobs or finish_reason:
            out.append(self._chunk(choice.index, text, self._logprobs(logprobs), finish_reason))
        return out

    def response(self, choices: Sequence[Choice], usage: UsageInfo) -> Any:
        return self.frame("text_completion", [
            _choice(ch.index, "text", ch.prefix + ch.text,
                    self._logprobs(ch.logprobs, ch if self.echo_logprobs else None), ch.finish_reason)
            for ch in choices], usage)


@dataclass
class ChatRenderer(OpenAIStream):
    """Streamed, each tool call is sent as OpenAI streams it: a delta with its id and name, then one with its
    arguments."""

    chunk: ClassVar[str] = "chat.completion.chunk"
    token_text: Optional[TokenText] = None
    logprobs: bool = False  # the request's `logprobs`
    top_logprobs: int = 0
    tools: Optional[ToolPlan] = None
    reasoning: Optional[ReasoningPlan] = None
    _streams: Dict[int, AnswerStream] = field(default_factory=dict)  # per choice, while streaming

    def _chunk(self, index: int, delta: Dict[str, Any], lps: Sequence[PositionedLogprob], finish: Optional[str]) -> str:
        logprobs = chat_logprobs(self.token_text, lps, self.top_logprobs) if self.logprobs and lps else None
        return self.event(_choice(index, "delta", delta, logprobs, finish))

    def text_choice(self, index: int, text: str) -> Dict[str, Any]:
        return _choice(index, "delta", chat_message(None, text), None, None)

    def opening(self, choice: Choice) -> List[str]:
        self._streams[choice.index] = AnswerStream(self.tools, self.reasoning)
        return [self._chunk(choice.index, chat_message("assistant", ""), [], None)]

    def chunks(self, choice: Choice, text: str, logprobs: List[PositionedLogprob],
               finish_reason: Optional[str]) -> List[str]:
        stream = self._streams[choice.index]
        if stream.plain and not logprobs and not finish_reason:
            return [self.text_event(choice.index, text)] if text else []
        d = stream.feed(text, finish_reason is not None, choice.token_ids)
        out, index = [], choice.index
        if d.reasoning:
            delta = chat_message(None, reasoning_content=d.reasoning, reasoning=d.reasoning)
            out.append(self._chunk(index, delta, logprobs, None))
            logprobs = []
        if d.content or logprobs:
            out.append(self._chunk(index, chat_message(None, d.content), logprobs, None))
        if not finish_reason:
            return out
        legacy = bool(d.calls) and self.tools.legacy
        for i, call in enumerate(d.calls[:1] if legacy else d.calls):  # its id and name, then its arguments
            if legacy:  # one call, as message.function_call
                opening = {"function_call": {"name": call.name, "arguments": ""}}
                rest = {"function_call": {"arguments": call.arguments}}
            else:
                opening = {"tool_calls": [{**call.to_openai(i), "function": {"name": call.name, "arguments": ""}}]}
                rest = {"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]}
            out += [self._chunk(index, chat_message(None, **opening), [], None),
                    self._chunk(index, chat_message(None, **rest), [], None)]
        return out + [self._chunk(index, chat_message(None), [], _finish(finish_reason, d.calls, legacy))]

    def response(self, choices: Sequence[Choice], usage: UsageInfo) -> Any:
        out = []
        for ch in choices:
            a = read_answer(ch.text, self.tools, self.reasoning, ch.token_ids)
            legacy = bool(a.calls) and self.tools.legacy
            message = chat_message(
                "assistant", a.content, None if legacy else [c.to_openai() for c in a.calls] or None,
                function_call={"name": a.calls[0].name, "arguments": a.calls[0].arguments} if legacy else None,
                reasoning_content=a.reasoning or None, reasoning=a.reasoning or None)
            lps = chat_logprobs(self.token_text, ch.logprobs, self.top_logprobs) if self.logprobs else None
            out.append(_choice(ch.index, "message", message, lps, _finish(ch.finish_reason, a.calls, legacy)))
        return self.frame("chat.completion", out, usage)


def _finish(engine_reason: Optional[str], calls: Sequence[Any], legacy: bool) -> Optional[str]:
    """A choice's finish_reason. One that made tool calls: "tool_calls" ("function_call" for a legacy functions
    request) when the model ended its output, but "length" (or whatever else ended it) when it was cut off, since
    then the last call's arguments may be cut off too and the client must be able to tell."""
    if not calls or engine_reason != "stop":
        return engine_reason
    return "function_call" if legacy else "tool_calls"


def _choice(index: int, key: str, value: Any, logprobs: Optional[Dict[str, Any]], finish: Optional[str]
            ) -> Dict[str, Any]:
    """One choice of an answer or chunk; `key`: text (completions), message (a chat answer) or delta (a chat chunk)."""
    return {"index": index, key: value, "logprobs": logprobs, "finish_reason": finish}
