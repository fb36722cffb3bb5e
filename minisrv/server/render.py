"""How each endpoint shows its choices: the streamed chunks and the whole response, in OpenAI's shapes.

These are the only places where /v1/completions and /v1/chat/completions differ once their prompts are built;
the request path that feeds them is generation.py. A streamed completion chunk is a `text_completion` object
carrying the text delta (an echoed prompt first); a chat stream opens each choice with an assistant role delta,
then content deltas, then a delta-less chunk with the finish reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from .generation import Choice
from .logprobs import PositionedLogprob, TokenText, chat_logprobs, completion_logprobs
from .protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatResponseMessage,
                       ChatStreamChoice, CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse,
                       DeltaMessage, UsageInfo, now)


@dataclass
class CompletionRenderer:
    id: str
    model: str
    token_text: TokenText
    logprobs: Optional[int]  # the request's `logprobs` (None: none)
    created: int = field(default_factory=now)

    def _logprobs(self, lps: Sequence[PositionedLogprob]) -> Optional[CompletionLogprobs]:
        if self.logprobs is None:
            return None
        return completion_logprobs(self.token_text, lps, self.logprobs)

    def _chunk(self, index: int, text: str, lps: Sequence[PositionedLogprob], finish: Optional[str]) -> Any:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[
            CompletionChoice(index=index, text=text, logprobs=self._logprobs(lps), finish_reason=finish)])

    def opening(self, choice: Choice) -> List[Any]:
        return [self._chunk(choice.index, choice.prefix, [], None)] if choice.prefix else []

    def chunks(self, choice: Choice, text: str, logprobs: List[PositionedLogprob],
               finish_reason: Optional[str]) -> List[Any]:
        return [self._chunk(choice.index, text, logprobs, finish_reason)]

    def usage_chunk(self, usage: UsageInfo) -> Any:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, choices: Sequence[Choice], usage: UsageInfo) -> Any:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
            CompletionChoice(index=ch.index, text=ch.full_text, finish_reason=ch.finish_reason,
                             logprobs=self._logprobs(ch.logprobs))
            for ch in choices])


@dataclass
class ChatRenderer:
    id: str
    model: str
    token_text: TokenText
    logprobs: bool  # the request's `logprobs`
    top_logprobs: int = 0
    created: int = field(default_factory=now)

    def _chunk(self, index: int, delta: DeltaMessage, lps: Sequence[PositionedLogprob],
               finish: Optional[str]) -> Any:
        logprobs = chat_logprobs(self.token_text, lps, self.top_logprobs) if self.logprobs and lps else None
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[
            ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)])

    def opening(self, choice: Choice) -> List[Any]:
        return [self._chunk(choice.index, DeltaMessage(role="assistant", content=""), [], None)]

    def chunks(self, choice: Choice, text: str, logprobs: List[PositionedLogprob],
               finish_reason: Optional[str]) -> List[Any]:
        out = []
        if text or logprobs:
            out.append(self._chunk(choice.index, DeltaMessage(content=text), logprobs, None))
        if finish_reason:
            out.append(self._chunk(choice.index, DeltaMessage(), [], finish_reason))
        return out

    def usage_chunk(self, usage: UsageInfo) -> Any:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage)

    def response(self, choices: Sequence[Choice], usage: UsageInfo) -> Any:
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, usage=usage, choices=[
            ChatChoice(index=ch.index, message=ChatResponseMessage(content=ch.text), finish_reason=ch.finish_reason,
                       logprobs=(chat_logprobs(self.token_text, ch.logprobs, self.top_logprobs)
                                 if self.logprobs else None))
            for ch in choices])
