"""How each endpoint shows its choices: the streamed chunks and the whole response, in OpenAI's shapes.

These are the only places where /v1/completions and /v1/chat/completions differ once their prompts are built;
the request path that feeds them is generation.py. A streamed completion chunk is a `text_completion` object
carrying the text delta (an echoed prompt first); a chat stream opens each choice with an assistant role delta,
then content deltas, then a delta-less chunk with the finish reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .generation import Choice
from .logprobs import PositionedLogprob, TokenText, chat_logprobs, completion_logprobs
from .reasoning import ReasoningStream
from .reasoning_plan import ReasoningPlan
from .tools import ToolPlan, content_prefix_len, parse_tool_calls
from .protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatResponseMessage,
                       ChatStreamChoice, CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse,
                       DeltaMessage, UsageInfo, now)


@dataclass
class CompletionRenderer:
    id: str
    model: str
    token_text: TokenText
    logprobs: Optional[int]  # the request's `logprobs` (None: none)
    echo_logprobs: bool = False  # echo with logprobs: the prompt's tokens come first, with their logprobs
    fingerprint: Optional[str] = None
    created: int = field(default_factory=now)

    def _logprobs(self, lps: Sequence[PositionedLogprob]) -> Optional[CompletionLogprobs]:
        if self.logprobs is None:
            return None
        return completion_logprobs(self.token_text, lps, self.logprobs)

    def _prompt_part(self, choice: Choice) -> CompletionLogprobs:
        """The echoed prompt's tokens: the first has no logprob (null, as OpenAI and vLLM answer)."""
        out = CompletionLogprobs()
        offset = 0
        scored = choice.prompt_logprobs or [None] * len(choice.prompt_ids)
        for tid, lp in zip(choice.prompt_ids, scored):
            s = self.token_text.string(tid)
            out.tokens.append(s)
            out.text_offset.append(offset)
            offset += len(s)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                top = {self.token_text.string(t): v for t, v in list(lp.top.items())[:self.logprobs]}
                top.setdefault(s, lp.logprob)
                out.token_logprobs.append(lp.logprob)
                out.top_logprobs.append(top)
        return out

    def _with_prompt(self, choice: Choice, lps: Sequence[PositionedLogprob]) -> CompletionLogprobs:
        head, tail = self._prompt_part(choice), self._logprobs(lps)
        return CompletionLogprobs(tokens=head.tokens + tail.tokens,
                                  token_logprobs=head.token_logprobs + tail.token_logprobs,
                                  top_logprobs=head.top_logprobs + tail.top_logprobs,
                                  text_offset=head.text_offset + tail.text_offset)

    def _chunk(self, index: int, text: str, logprobs: Optional[CompletionLogprobs], finish: Optional[str]) -> Any:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, system_fingerprint=self.fingerprint,
                               choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                         finish_reason=finish)])

    def opening(self, choice: Choice) -> List[Any]:
        if self.echo_logprobs or not choice.prefix:
            return []  # with prompt logprobs the echo waits for them (they come with the first output)
        choice.opened = True
        return [self._chunk(choice.index, choice.prefix, None, None)]

    def chunks(self, choice: Choice, text: str, logprobs: List[PositionedLogprob],
               finish_reason: Optional[str]) -> List[Any]:
        out = []
        if self.echo_logprobs and not choice.opened:
            choice.opened = True
            out.append(self._chunk(choice.index, choice.prefix, self._prompt_part(choice), None))
        if text or logprobs or finish_reason:
            out.append(self._chunk(choice.index, text, self._logprobs(logprobs), finish_reason))
        return out

    def usage_chunk(self, usage: UsageInfo) -> Any:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage,
                               system_fingerprint=self.fingerprint)

    def response(self, choices: Sequence[Choice], usage: UsageInfo) -> Any:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, usage=usage, system_fingerprint=self.fingerprint,
            choices=[CompletionChoice(index=ch.index, text=ch.full_text, finish_reason=ch.finish_reason,
                                      logprobs=(self._with_prompt(ch, ch.logprobs) if self.echo_logprobs
                                                else self._logprobs(ch.logprobs)))
                     for ch in choices])


@dataclass
class ChatRenderer:
    """With tools, a choice's text is read back into tool_calls (server/tools.py). Streamed, the text that may be a
    tool call is held back; at the end each call is sent as OpenAI streams it: a delta with its id and name, then
    one with its arguments. With a reasoning parser, the thinking is split off first (server/reasoning.py): it
    goes to reasoning_content (or stays in content, with separate_reasoning false), and only the answer after it
    is content and read for tool calls."""

    id: str
    model: str
    token_text: TokenText
    logprobs: bool  # the request's `logprobs`
    top_logprobs: int = 0
    tools: Optional[ToolPlan] = None
    fingerprint: Optional[str] = None
    created: int = field(default_factory=now)
    reasoning: Optional[ReasoningPlan] = None
    _streams: Dict[int, ReasoningStream] = field(default_factory=dict)  # per choice, while streaming

    def _chunk(self, index: int, delta: DeltaMessage, lps: Sequence[PositionedLogprob],
               finish: Optional[str]) -> Any:
        logprobs = chat_logprobs(self.token_text, lps, self.top_logprobs) if self.logprobs and lps else None
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                   system_fingerprint=self.fingerprint, choices=[
                                       ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                        finish_reason=finish)])

    def opening(self, choice: Choice) -> List[Any]:
        return [self._chunk(choice.index, DeltaMessage(role="assistant", content=""), [], None)]

    def _tools_on(self) -> bool:
        return self.tools is not None and self.tools.active

    def chunks(self, choice: Choice, text: str, logprobs: List[PositionedLogprob],
               finish_reason: Optional[str]) -> List[Any]:
        out, answer = [], choice.text
        if self.reasoning is not None:  # the thinking first; `text` and `answer` become the answer's
            split = self._streams.get(choice.index)
            if split is None:
                split = self._streams[choice.index] = self.reasoning.stream()
            piece = split.feed(text, final=finish_reason is not None)
            if self.reasoning.separate and piece.reasoning:
                delta = DeltaMessage(reasoning_content=piece.reasoning, reasoning=piece.reasoning)
            elif not self.reasoning.separate and piece.raw:
                delta = DeltaMessage(content=piece.raw)
            else:
                delta = None
            if delta is not None:
                out.append(self._chunk(choice.index, delta, logprobs, None))
                logprobs = []
            text, answer = piece.answer, split.answer
        if self._tools_on():
            return out + self._tool_chunks(choice, answer, logprobs, finish_reason)
        if text or logprobs:
            out.append(self._chunk(choice.index, DeltaMessage(content=text), logprobs, None))
        if finish_reason:
            out.append(self._chunk(choice.index, DeltaMessage(), [], finish_reason))
        return out

    def _tool_chunks(self, choice: Choice, answer: str, logprobs: List[PositionedLogprob],
                     finish_reason: Optional[str]) -> List[Any]:
        """`answer`: the choice's text so far, after any thinking; choice.sent counts what of it was shown."""
        plan, out = self.tools, []
        if not finish_reason:
            sure = content_prefix_len(answer, plan) if plan.mode == "auto" else 0
            if sure > choice.sent or logprobs:
                out.append(self._chunk(choice.index, DeltaMessage(content=answer[choice.sent:sure]), logprobs,
                                       None))
                choice.sent = max(choice.sent, sure)
            return out
        content, calls = parse_tool_calls(answer, plan)
        if not calls:
            rest = answer[choice.sent:]
            if rest or logprobs:
                out.append(self._chunk(choice.index, DeltaMessage(content=rest), logprobs, None))
            out.append(self._chunk(choice.index, DeltaMessage(), [], finish_reason))
            return out
        head = (content or "")[choice.sent:]
        if head or logprobs:
            out.append(self._chunk(choice.index, DeltaMessage(content=head), logprobs, None))
        if plan.legacy:  # one call, as message.function_call: its name, then its arguments
            call = calls[0]
            out.append(self._chunk(choice.index, DeltaMessage(function_call={"name": call.name, "arguments": ""}),
                                   [], None))
            out.append(self._chunk(choice.index, DeltaMessage(function_call={"arguments": call.arguments}), [], None))
            out.append(self._chunk(choice.index, DeltaMessage(), [], _call_finish(finish_reason, legacy=True)))
            return out
        for i, call in enumerate(calls):
            opening = call.to_openai(i)
            opening["function"] = {"name": call.name, "arguments": ""}
            out.append(self._chunk(choice.index, DeltaMessage(tool_calls=[opening]), [], None))
            out.append(self._chunk(choice.index, DeltaMessage(tool_calls=[
                {"index": i, "function": {"arguments": call.arguments}}]), [], None))
        out.append(self._chunk(choice.index, DeltaMessage(), [], _call_finish(finish_reason)))
        return out

    def usage_chunk(self, usage: UsageInfo) -> Any:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage,
                                   system_fingerprint=self.fingerprint)

    def _message(self, ch: Choice) -> Tuple[Any, Optional[str]]:
        answer, head, reasoning = ch.text, "", None
        if self.reasoning is not None:
            split = self.reasoning.split(ch.text)
            answer = split.answer
            if self.reasoning.separate:
                reasoning = split.reasoning or None
            else:
                head = split.raw  # the thinking stays in content, before the answer
        content: Optional[str] = answer
        calls: list = []
        if self._tools_on():
            content, calls = parse_tool_calls(answer, self.tools)
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
