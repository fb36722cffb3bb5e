"""/v1/completions' and /v1/chat/completions' renderers (generation.Renderer), in OpenAI's shapes. A completion
chunk carries a text delta (an echoed prompt first); a chat stream opens each choice with an assistant role delta,
then content deltas, then a delta-less chunk with the finish reason."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

from ..errors import APIError
from ..generation import Choice
from ..plan.answer import AnswerStream, read_answer
from ..plan.reasoning_plan import ReasoningPlan
from ..plan.tools import ToolPlan
from ..streaming import SSE_DONE, sse
from .logprobs import PositionedLogprob, TokenText, chat_logprobs, completion_logprobs
from .protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatResponseMessage,
                       ChatStreamChoice, CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse,
                       DeltaMessage, UsageInfo, now)


@dataclass
class OpenAIStream:
    """What OpenAI's two streams share: `data: <chunk>` events, the usage chunk when asked for, an error event
    (OpenAI's error body) when a request fails after its stream began, and `data: [DONE]` last."""

    id: str
    model: str
    fingerprint: Optional[str] = None
    include_usage: bool = False  # stream_options.include_usage
    created: int = field(default_factory=now)

    chunk_type: ClassVar[type] = CompletionChunk  # a stream chunk's class; its last one carries the usage

    def closing(self, usage: UsageInfo) -> List[str]:
        last = self.chunk_type(id=self.id, created=self.created, model=self.model, choices=[], usage=usage,
                               system_fingerprint=self.fingerprint)
        return ([sse(last)] if self.include_usage else []) + [SSE_DONE]

    def failed(self, error: APIError) -> List[str]:
        return [sse(error.body()), SSE_DONE]


@dataclass
class CompletionRenderer(OpenAIStream):
    token_text: Optional[TokenText] = None
    logprobs: Optional[int] = None  # the request's `logprobs` (None: none)
    echo_logprobs: bool = False  # echo with logprobs: the prompt's tokens come first, with their logprobs

    def _logprobs(self, lps: Sequence[PositionedLogprob], echoed: Optional[Choice] = None
                  ) -> Optional[CompletionLogprobs]:
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

    def _chunk(self, index: int, text: str, logprobs: Optional[CompletionLogprobs], finish: Optional[str]) -> str:
        return sse(CompletionChunk(id=self.id, created=self.created, model=self.model,
                                   system_fingerprint=self.fingerprint,
                                   choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                             finish_reason=finish)]))

    def opening(self, choice: Choice) -> List[str]:
        if self.echo_logprobs or not choice.prefix:
            return []  # with prompt logprobs the echo waits for them (they come with the first output)
        choice.opened = True
        return [self._chunk(choice.index, choice.prefix, None, None)]

    def chunks(self, choice: Choice, text: str, logprobs: List[PositionedLogprob],
               finish_reason: Optional[str]) -> List[str]:
        out = []
        if self.echo_logprobs and not choice.opened:
            choice.opened = True
            out.append(self._chunk(choice.index, choice.prefix, self._logprobs([], choice), None))
        if text or logprobs or finish_reason:
            out.append(self._chunk(choice.index, text, self._logprobs(logprobs), finish_reason))
        return out

    def response(self, choices: Sequence[Choice], usage: UsageInfo) -> Any:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage, system_fingerprint=self.fingerprint,
            choices=[CompletionChoice(index=ch.index, text=ch.full_text, finish_reason=ch.finish_reason,
                                      logprobs=self._logprobs(ch.logprobs, ch if self.echo_logprobs else None))
                     for ch in choices])


@dataclass
class ChatRenderer(OpenAIStream):
    """Streamed, each tool call is sent as OpenAI streams it: a delta with its id and name, then one with its
    arguments."""

    chunk_type: ClassVar[type] = ChatCompletionChunk
    token_text: Optional[TokenText] = None
    logprobs: bool = False  # the request's `logprobs`
    top_logprobs: int = 0
    tools: Optional[ToolPlan] = None
    reasoning: Optional[ReasoningPlan] = None
    _streams: Dict[int, AnswerStream] = field(default_factory=dict)  # per choice, while streaming

    def _chunk(self, index: int, delta: DeltaMessage, lps: Sequence[PositionedLogprob],
               finish: Optional[str]) -> str:
        logprobs = chat_logprobs(self.token_text, lps, self.top_logprobs) if self.logprobs and lps else None
        return sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                       system_fingerprint=self.fingerprint, choices=[
                                           ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                            finish_reason=finish)]))

    def opening(self, choice: Choice) -> List[str]:
        return [self._chunk(choice.index, DeltaMessage(role="assistant", content=""), [], None)]

    def chunks(self, choice: Choice, text: str, logprobs: List[PositionedLogprob],
               finish_reason: Optional[str]) -> List[str]:
        stream = self._streams.get(choice.index)
        if stream is None:
            stream = self._streams[choice.index] = AnswerStream(self.tools, self.reasoning)
        d = stream.feed(text, finish_reason is not None)
        out, index = [], choice.index
        thought = None
        if self.reasoning is not None and self.reasoning.separate and d.reasoning:
            thought = DeltaMessage(reasoning_content=d.reasoning, reasoning=d.reasoning)
        elif self.reasoning is not None and not self.reasoning.separate and d.raw:
            thought = DeltaMessage(content=d.raw)  # the thinking stays in content, before the answer
        if thought is not None:
            out.append(self._chunk(index, thought, logprobs, None))
            logprobs = []
        if d.content or logprobs:
            out.append(self._chunk(index, DeltaMessage(content=d.content), logprobs, None))
        if not finish_reason:
            return out
        if not d.calls:
            return out + [self._chunk(index, DeltaMessage(), [], finish_reason)]
        if self.tools.legacy:  # one call, as message.function_call: its name, then its arguments
            call = d.calls[0]
            return out + [self._chunk(index, DeltaMessage(function_call={"name": call.name, "arguments": ""}), [],
                                      None),
                          self._chunk(index, DeltaMessage(function_call={"arguments": call.arguments}), [], None),
                          self._chunk(index, DeltaMessage(), [], _call_finish(finish_reason, legacy=True))]
        for i, call in enumerate(d.calls):
            opening = call.to_openai(i)
            opening["function"] = {"name": call.name, "arguments": ""}
            out.append(self._chunk(index, DeltaMessage(tool_calls=[opening]), [], None))
            out.append(self._chunk(index, DeltaMessage(tool_calls=[
                {"index": i, "function": {"arguments": call.arguments}}]), [], None))
        return out + [self._chunk(index, DeltaMessage(), [], _call_finish(finish_reason))]

    def _message(self, ch: Choice) -> Tuple[Any, Optional[str]]:
        a = read_answer(ch.text, self.tools, self.reasoning)
        head, reasoning, content, calls = "", None, a.content, a.calls
        if self.reasoning is not None:
            if self.reasoning.separate:
                reasoning = a.reasoning or None
            else:
                head = a.raw  # the thinking stays in content, before the answer
        if head:
            content = head + (content or "")
        elif reasoning is not None and not content:
            content = None  # it only thought (cut off by max_tokens, or an answer of tool calls)
        legacy = bool(calls) and self.tools.legacy
        message = ChatResponseMessage(content=content, tool_calls=None if legacy else
                                      [c.to_openai() for c in calls] or None,
                                      function_call={"name": calls[0].name, "arguments": calls[0].arguments}
                                      if legacy else None, reasoning_content=reasoning, reasoning=reasoning)
        return message, _call_finish(ch.finish_reason, legacy) if calls else ch.finish_reason

    def response(self, choices: Sequence[Choice], usage: UsageInfo) -> Any:
        out = []
        for ch in choices:
            message, finish = self._message(ch)
            out.append(ChatChoice(index=ch.index, message=message, finish_reason=finish,
                                  logprobs=(chat_logprobs(self.token_text, ch.logprobs, self.top_logprobs)
                                            if self.logprobs else None)))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, usage=usage,
                                      system_fingerprint=self.fingerprint, choices=out)


def _call_finish(engine_reason: Optional[str], legacy: bool = False) -> Optional[str]:
    """The finish_reason of a choice that made tool calls: "tool_calls" ("function_call" for a legacy functions
    request) when the model ended its output, but "length" (or whatever else ended it) when it was cut off, since
    then the last call's arguments may be cut off too and the client must be able to tell."""
    if engine_reason != "stop":
        return engine_reason
    return "function_call" if legacy else "tool_calls"
