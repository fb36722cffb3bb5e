"""A thinking model's output text split into its reasoning and its answer, whole or as it streams.

Qwen3 and DeepSeek-R1 think between `<think>` and `</think>` before they answer; OpenAI-style clients expect the
thinking apart, as `reasoning_content` (vLLM's newer name: `reasoning`). Where the thinking starts depends on the
prompt (reasoning_plan.py decides):
  INSIDE    the prompt opened it (DeepSeek-R1): all before `</think>` is reasoning, all of it when `</think>` never
            comes (cut off by max_tokens); a `<think>` the model writes anyway at the start is dropped.
  OPTIONAL  the model decides (Qwen3): it thinks only if its output starts with `<think>`.
  NONE      the prompt closed it (Qwen3 with enable_thinking false): all answer.

The reasoning is stripped of the whitespace around it, the answer of that after `</think>`, as SGLang does;
`Split.raw` keeps the text before the answer as written (for `separate_reasoning: false`). `ReasoningStream` gives
exactly the split of the whole text, however it is cut into deltas: a tail that could be a tag's start is held back
until the next delta settles it, and the reasoning's trailing whitespace until more reasoning follows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

START, END = "<think>", "</think>"
INSIDE, OPTIONAL, NONE = "inside", "optional", "none"  # where the output's thinking starts (see above)
_BEFORE, _THINKING, _ANSWER = 0, 1, 2  # ReasoningStream's phases


@dataclass
class Split:

    reasoning: Optional[str]  # the thinking, stripped; None when the output did not think
    answer: str  # what follows it (all of the text when it did not think)
    raw: str = ""  # the text before the answer as written (tags, whitespace): text == raw + answer


def split_reasoning(text: str, mode: str, start: str = START, end: str = END) -> Split:
    if mode == NONE:
        return Split(None, text)
    body = text.lstrip()
    if body.startswith(start):
        body = body[len(start):]
    elif mode == OPTIONAL:
        return Split(None, text)
    at = body.find(end)
    if at < 0:  # cut off inside the thinking: all of it is reasoning
        return Split(body.strip(), "", text)
    answer = body[at + len(end):].lstrip()
    return Split(body[:at].strip(), answer, text[:len(text) - len(answer)])


@dataclass
class Piece:
    """What one delta of output text adds to each part (empty strings where it adds nothing)."""

    reasoning: str = ""
    answer: str = ""
    raw: str = ""  # text before the answer, as written (for separate_reasoning false)


def _partial(text: str, tag: str) -> int:
    """The length of the longest proper prefix of `tag` that `text` ends with (a tag that may be arriving)."""
    at = text.find(tag[0], max(0, len(text) - len(tag) + 1))  # per streamed piece: one scan, no tag usually
    while at >= 0:
        if tag.startswith(text[at:]):
            return len(text) - at
        at = text.find(tag[0], at + 1)
    return 0


class ReasoningStream:
    """Splits one output as its text arrives: `feed` each delta (final=True with the last), collect the pieces.
    The pieces of each part, joined, are that part of `split_reasoning` of the whole text."""

    def __init__(self, mode: str, start: str = START, end: str = END) -> None:
        self.mode, self.start, self.end = mode, start, end
        self.phase = _ANSWER if mode == NONE else _BEFORE
        self.thought = False  # whether the output has a thinking part
        self.answer = ""  # the answer so far
        self._buf = ""  # text not settled yet (a tag's possible start)
        self._ws = ""  # the reasoning's trailing whitespace, held until more reasoning follows
        self._lead = True  # the reasoning has not shown a non-whitespace character yet
        self._answer_lead = False  # whitespace at the answer's start is dropped (after `</think>`)

    def feed(self, text: str, final: bool = False) -> Piece:
        if not self._buf and not final and self.phase != _BEFORE and self.end[0] not in text:
            # the usual piece: nothing held back, and no tag can start in it (the general loop below gives the same)
            if self.phase == _THINKING:
                reasoning: List[str] = []
                self._think(text, reasoning, closing=False)
                return Piece(reasoning="".join(reasoning), raw=text)
            if not self._answer_lead:
                self.answer += text
                return Piece(answer=text)
        self._buf += text
        out = Piece()
        reasoning = []
        raw: List[str] = []
        while True:
            buf = self._buf
            if self.phase == _BEFORE:
                body = buf.lstrip()
                if body.startswith(self.start):
                    cut = len(buf) - len(body) + len(self.start)
                    raw.append(buf[:cut])
                    self._buf, self.phase, self.thought = buf[cut:], _THINKING, True
                    continue
                if not final and self.start.startswith(body):  # nothing yet, or a `<think>` arriving
                    break
                self.phase = _THINKING if self.mode == INSIDE else _ANSWER
                self.thought = self.mode == INSIDE
                continue
            if self.phase == _THINKING:
                at = buf.find(self.end)
                if at >= 0:
                    self._think(buf[:at], reasoning, closing=True)
                    raw.append(buf[:at + len(self.end)])
                    self._buf, self.phase, self._answer_lead = buf[at + len(self.end):], _ANSWER, True
                    continue
                take = buf[:len(buf) - (0 if final else _partial(buf, self.end))]
                self._think(take, reasoning, closing=final)
                raw.append(take)
                self._buf = buf[len(take):]
                break
            if self._answer_lead:
                body = buf.lstrip()
                raw.append(buf[:len(buf) - len(body)])
                self._buf = body
                if not body:
                    break
                self._answer_lead = False
            out.answer, self._buf = self._buf, ""
            self.answer += out.answer
            break
        out.reasoning, out.raw = "".join(reasoning), "".join(raw)
        return out

    def _think(self, piece: str, out: List[str], closing: bool) -> None:
        """Reasoning text, whitespace at its start dropped and at its end held (dropped when `closing`)."""
        if self._lead:
            piece = piece.lstrip()
            self._lead = not piece
        text = self._ws + piece
        body = text.rstrip()
        self._ws = "" if closing else text[len(body):]
        if body:
            out.append(body)
