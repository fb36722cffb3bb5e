"""A thinking model's output text split into its reasoning and its answer, whole or as it streams.

Qwen3 and DeepSeek-R1 think between `<think>` and `</think>` before they answer; OpenAI-style clients expect the
thinking apart, as `reasoning_content` (vLLM's newer name: `reasoning`). Where the thinking starts depends on the
prompt (`plan_reasoning` decides, below):
  INSIDE    the prompt opened it (DeepSeek-R1): all before `</think>` is reasoning, all of it when `</think>` never
            comes (cut off by max_tokens); a `<think>` the model writes anyway at the start is dropped.
  OPTIONAL  the model decides (Qwen3): it thinks only if its output starts with `<think>`.
  NONE      the prompt closed it (Qwen3 with enable_thinking false): all answer.

The reasoning is stripped of the whitespace around it, the answer of that after `</think>`, as SGLang does; `raw`
keeps the text before the answer as written (for `separate_reasoning: false`). `ReasoningStream` splits a text as it
arrives, and gives the same split however the text is cut into deltas (a whole text is one final delta): a tail that
could be a tag's start is held back until the next delta settles it, and the reasoning's trailing whitespace until
more reasoning follows.

Which parser the server uses (`--reasoning-parser`), and what it means for one chat request: at startup,
`resolve_reasoning` turns the flag into a `ReasoningFormat` (qwen3 or deepseek_r1, and the token ids of `<think>` and
`</think>`). `auto` reads the chat template: a generation prompt that already ends with `<think>` means the model
starts inside its thinking (deepseek_r1: DeepSeek-R1 and its distills, Qwen3-Thinking-2507); one that otherwise
mentions the tags or `enable_thinking` lets the model open it (qwen3); any other means a model that does not think.
The tags must be single tokens whose text survives decoding: the engine finds the end of the thinking by id, to force
it (a thinking budget) and to start a grammar after it. An explicit parser whose tokenizer lacks them fails the
startup; `auto` then falls back to none, with a warning.

Per request, `plan_reasoning` reads the templated prompt: one that ends with `</think>` closed the thinking (the
output is all answer, the engine gets no rule), one that ends with `<think>` opened it, otherwise the style decides.
The engine's part is a ThinkingRule (engine/thinking.py); the text's part is the renderer's `ReasoningPlan`."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from minisrv.engine.request import RequestError
from minisrv.engine.thinking import ThinkingRule

logger = logging.getLogger("minisrv.server")

PARSERS = ("qwen3", "deepseek_r1", "auto")
STARTS_INSIDE = {"qwen3": False, "deepseek_r1": True}  # a style's default, when the prompt says nothing
START, END = "<think>", "</think>"
INSIDE, OPTIONAL, NONE = "inside", "optional", "none"  # where the output's thinking starts (see above)
HARMONY = "harmony"  # gpt-oss: the reasoning is a channel of its own, read by id (harmony.py)
_BEFORE, _THINKING, _ANSWER = 0, 1, 2  # ReasoningStream's phases


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
    However the text is cut, the pieces of each part join to the same split (a whole text: one final feed)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.phase = _ANSWER if mode == NONE else _BEFORE
        self.thought = False  # whether the output has a thinking part
        self.answer = ""  # the answer so far
        self._buf = ""  # text not settled yet (a tag's possible start)
        self._ws = ""  # the reasoning's trailing whitespace, held until more reasoning follows
        self._lead = True  # the reasoning has not shown a non-whitespace character yet
        self._answer_lead = False  # whitespace at the answer's start is dropped (after `</think>`)

    def feed(self, text: str, final: bool = False) -> Piece:
        if not self._buf and not final and self.phase != _BEFORE and END[0] not in text:
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
                if body.startswith(START):
                    cut = len(buf) - len(body) + len(START)
                    raw.append(buf[:cut])
                    self._buf, self.phase, self.thought = buf[cut:], _THINKING, True
                    continue
                if not final and START.startswith(body):  # nothing yet, or a `<think>` arriving
                    break
                self.phase = _THINKING if self.mode == INSIDE else _ANSWER
                self.thought = self.mode == INSIDE
                continue
            if self.phase == _THINKING:
                at = buf.find(END)
                if at >= 0:
                    self._think(buf[:at], reasoning, closing=True)
                    raw.append(buf[:at + len(END)])
                    self._buf, self.phase, self._answer_lead = buf[at + len(END):], _ANSWER, True
                    continue
                take = buf[:len(buf) - (0 if final else _partial(buf, END))]
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


@dataclass(frozen=True)
class ReasoningFormat:
    """The server's reasoning parser, resolved against its tokenizer."""

    name: str  # qwen3 | deepseek_r1
    start_id: int
    end_id: int


@dataclass(frozen=True)
class ReasoningPlan:
    """How one chat request's output text is split (the renderer's part)."""

    mode: str  # reasoning.INSIDE | OPTIONAL | NONE | HARMONY
    separate: bool = True  # separate_reasoning: false leaves the thinking in content
    encoding: Any = None  # HARMONY's: the harmony encoding its reader parses the output ids with


def chat_template_text(tokenizer: Any) -> Optional[str]:
    """The tokenizer's chat template as one string (of several named ones, the default), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def detect_parser(tokenizer: Any) -> Optional[str]:
    """The parser a chat template calls for (see the module docstring), or None for a model that does not think."""
    template = chat_template_text(tokenizer)
    if template is None:
        return None
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                               tokenize=False)
    except Exception:  # noqa: BLE001 - a template that needs more (a system turn, tools): judged by its text alone
        prompt = ""
    if isinstance(prompt, str) and prompt.rstrip().endswith(START):
        return "deepseek_r1"
    if START in template or END in template or "enable_thinking" in template:
        return "qwen3"
    return None


def _single_token(tokenizer: Any, tag: str) -> Optional[int]:
    """The id of the one token that is `tag` and decodes back to it (skipping special tokens), else None."""
    with contextlib.suppress(Exception):  # a tokenizer that cannot say: no such token
        ids = tokenizer(tag, add_special_tokens=False).input_ids
        if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == tag:
            return ids[0]
    return None


def resolve_reasoning(setting: Optional[str], tokenizer: Any) -> Optional[ReasoningFormat]:
    """The flag, against the tokenizer; None: no parser. Raises ValueError for a parser this tokenizer cannot
    serve (an explicit one; `auto` falls back to none)."""
    if setting is None:
        return None
    if setting not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(PARSERS)}, got {setting!r}")
    name = detect_parser(tokenizer) if setting == "auto" else setting
    if name is None:
        logger.info("--reasoning-parser auto: the chat template does not think; no reasoning parser")
        return None
    start_id, end_id = _single_token(tokenizer, START), _single_token(tokenizer, END)
    if start_id is None or end_id is None:
        why = (f"--reasoning-parser {name}: the tokenizer has no single, non-special token for "
               f"{START if start_id is None else END}")
        if setting == "auto":
            logger.warning("%s; no reasoning parser", why)
            return None
        raise ValueError(why)
    logger.info("reasoning parser: %s", name)
    return ReasoningFormat(name, start_id, end_id)


def thinking_budget(budget: Any, custom_params: Any) -> Optional[int]:
    """The request's thinking budget: `thinking_budget`, or SGLang's `custom_params: {"thinking_budget": N}`
    (its custom logit processor itself is never run: the budget is built in). Raises RequestError."""
    alt = custom_params.get("thinking_budget") if isinstance(custom_params, dict) else None
    for value, param in ((budget, "thinking_budget"), (alt, "custom_params")):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise RequestError(f"thinking_budget must be a non-negative integer, got {value!r}", param)
    if budget is not None and alt is not None and budget != alt:
        raise RequestError("thinking_budget and custom_params.thinking_budget differ", "thinking_budget")
    return budget if budget is not None else alt


def plan_reasoning(fmt: Optional[ReasoningFormat], prompt: str, separate: bool,
                   budget: Optional[int]) -> Tuple[Optional[ReasoningPlan], Optional[ThinkingRule]]:
    """A chat request's split (None: no parser) and its engine rule (None: no thinking to follow)."""
    if fmt is None:
        if budget is not None:
            raise RequestError("thinking_budget needs a server started with --reasoning-parser", "thinking_budget")
        return None, None
    tail = prompt.rstrip()
    if tail.endswith(END):
        mode = NONE
    elif tail.endswith(START) or STARTS_INSIDE[fmt.name]:
        mode = INSIDE
    else:
        mode = OPTIONAL
    rule = None if mode == NONE else ThinkingRule(fmt.end_id, fmt.start_id, mode == INSIDE, budget)
    return ReasoningPlan(mode, separate), rule
