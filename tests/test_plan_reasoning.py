"""Thinking models, the pure parts: the reasoning split (server/plan/reasoning.py), the engine's thinking rule
(engine/thinking.py: the budget, where the answer starts), the parser's choice and a request's plan
(the same module). The splitter is checked against hand-written splits and, on every way of cutting a
text into deltas, against the split of the whole text. Through the chat endpoint: test_reasoning_chat.py.
"""
from __future__ import annotations

import random
from typing import Any, List, Optional, Tuple

import pytest

from minisrv.engine.request import RequestError, SamplingParams
from minisrv.engine.thinking import ThinkingRule, ThinkingState
from minisrv.server.plan.reasoning import (INSIDE, NONE, OPTIONAL, ReasoningStream, plan_reasoning, resolve_reasoning,
                                          thinking_budget)

THINK, END = 49152, 49153  # the ids helpers/tiny_qwen3_thinking.py's tokenizer gives <think> and </think>


# ---------------------------------------------------------------------------------------------- the splitter
@pytest.mark.parametrize("mode,text,reasoning,answer", [
    (INSIDE, "  I think.\n</think>\n\nParis", "I think.", "Paris"),
    (INSIDE, "<think>\nhm</think>Paris", "hm", "Paris"),  # an older R1 template: the model opens it itself
    (INSIDE, "cut off while thi", "cut off while thi", ""),  # max_tokens ended the thinking
    (INSIDE, "</think>Paris", "", "Paris"),
    (OPTIONAL, "<think>\nhm\n</think>\n\nParis </think>", "hm", "Paris </think>"),
    (OPTIONAL, "\n<think>cut", "cut", ""),
    (OPTIONAL, "Paris <think>x</think>", None, "Paris <think>x</think>"),  # no thinking at the start: all answer
    (OPTIONAL, "", None, ""),
    (NONE, "<think>x</think>y", None, "<think>x</think>y"),  # the prompt closed the thinking
])
def test_split_whole_texts(mode: str, text: str, reasoning: Optional[str], answer: str) -> None:
    for split in (split_reasoning(text, mode), _streamed(mode, [text])):  # the reference, and one final delta
        assert (split[0] if split[3] else None, split[1]) == (reasoning, answer)
        assert split[2] + split[1] == text  # separate_reasoning false shows this


def split_reasoning(text: str, mode: str) -> Tuple[str, str, str, bool]:
    """The reference split of a whole text: (reasoning, answer, the text before the answer, whether it thought)."""
    if mode == NONE:
        return "", text, "", False
    body = text.lstrip()
    if body.startswith("<think>"):
        body = body[len("<think>"):]
    elif mode == OPTIONAL:
        return "", text, "", False
    at = body.find("</think>")
    if at < 0:  # cut off inside the thinking: all of it is reasoning
        return body.strip(), "", text, True
    answer = body[at + len("</think>"):].lstrip()
    return body[:at].strip(), answer, text[:len(text) - len(answer)], True


TEXTS = ["<think>abc</think>ans", "  <think>\n a b \n</think>\n\n answer x ", "<think>abc", "abc</think>x", "<thi",
         "", "hello <think>x</think>", "<think></think>", "\n\n<think>\n\n", "<think>a</thi", "   ", "<<think>>",
         "<think><think>x</think></think>y", "a</think>b</think>c", "<think> a <\n</think\n> b </think> c"]


def _streamed(mode: str, parts: List[str]) -> Tuple[str, str, str, bool]:
    stream = ReasoningStream(mode)
    got = ["", "", ""]
    for i, part in enumerate(parts):
        piece = stream.feed(part, final=i == len(parts) - 1)
        got = [got[0] + piece.reasoning, got[1] + piece.answer, got[2] + piece.raw]
    return got[0], got[1], got[2], stream.thought


@pytest.mark.parametrize("mode", [INSIDE, OPTIONAL, NONE])
def test_stream_equals_whole_however_cut(mode: str) -> None:
    """Every text, one character a delta and in random cuts: the pieces join to the whole text's split."""
    rng = random.Random(7)
    for text in TEXTS:
        expect = split_reasoning(text, mode)
        cuts = [list(text) or [""]] + [_random_cut(rng, text) for _ in range(60)]
        for parts in cuts:
            assert _streamed(mode, parts) == expect, (text, parts)


def _random_cut(rng: random.Random, text: str) -> List[str]:
    at = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
    return [text[a:b] for a, b in zip([0] + at, at + [len(text)])] + [""]


def test_stream_holds_back_a_tag_arriving_in_pieces() -> None:
    """What each delta shows: nothing of a possible tag until it is settled, nor the reasoning's trailing space."""
    stream = ReasoningStream(OPTIONAL)
    shown = [(p.reasoning, p.answer) for p in map(stream.feed, ["\n<th", "ink>\nI", " think ", "</th", "in", "k>\n",
                                                                 "\nParis", "</thi"])]
    assert shown == [("", ""), ("I", ""), (" think", ""), ("", ""), ("", ""), ("", ""), ("", "Paris"),
                     ("", "</thi")]  # the answer is shown as it comes: a `</think>` there is text like any other
    assert stream.answer == "Paris</thi" and stream.thought


# ---------------------------------------------------------------------------------------------- the engine's rule
def test_thinking_state_counts_the_budget_and_finds_the_answer() -> None:
    inside = ThinkingState(ThinkingRule(END, THINK, starts_inside=True, budget=2))
    assert [inside.advance(t) for t in (THINK, 7)] == [False, False] and inside.forced() is None  # <think> is free
    assert inside.advance(8) is False and inside.forced() == END
    assert [inside.advance(t) for t in (END, 9, THINK)] == [False, True, True] and inside.forced() is None
    optional = ThinkingState(ThinkingRule(END, THINK, starts_inside=False, budget=0))
    assert optional.forced() is None and optional.advance(THINK) is False and optional.forced() == END
    plain = ThinkingState(ThinkingRule(END, THINK, starts_inside=False, budget=0))
    assert plain.advance(5) is True and plain.answering and plain.forced() is None  # it did not think
    with pytest.raises(RequestError, match="budget") as e:
        SamplingParams(thinking=ThinkingRule(END, THINK, budget=-1))
    assert e.value.param == "thinking_budget"


# ---------------------------------------------------------------------------------------------- the plan
class _Tok:
    """A tokenizer with a chat template, and with or without the think tags as single tokens."""

    def __init__(self, template: str, tags: bool = True, special: bool = False) -> None:
        self.chat_template, self.tags, self.special = template, tags, special

    def __call__(self, text: str, add_special_tokens: bool = False) -> Any:
        ids = {"<think>": [THINK], "</think>": [END]}.get(text) if self.tags else None
        return type("E", (), {"input_ids": ids or [ord(c) for c in text]})()

    def decode(self, ids: List[int], skip_special_tokens: bool = False) -> str:
        return "" if self.special and skip_special_tokens else {THINK: "<think>", END: "</think>"}[ids[0]]

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool, tokenize: bool) -> str:
        return "user: Hi\nassistant:" + (" <think>\n" if "R1" in self.chat_template else "")


def test_parser_choice_from_the_template_and_the_tokenizer() -> None:
    assert resolve_reasoning(None, _Tok("{{ enable_thinking }}")) is None
    assert resolve_reasoning("auto", _Tok("{{ enable_thinking }}")).name == "qwen3"
    assert resolve_reasoning("auto", _Tok("R1")).name == "deepseek_r1"  # the generation prompt opens the thinking
    assert resolve_reasoning("auto", _Tok("{{ messages }}")) is None  # a model that does not think
    assert resolve_reasoning("auto", _Tok("<think>", tags=False)) is None  # falls back, with a warning
    for bad in (_Tok("<think>", tags=False), _Tok("<think>", special=True)):
        with pytest.raises(ValueError, match="no single, non-special token for <think>"):
            resolve_reasoning("qwen3", bad)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_reasoning("r1", _Tok(""))


def test_a_requests_plan_follows_its_prompt() -> None:
    qwen3 = resolve_reasoning("qwen3", _Tok(""))
    r1 = resolve_reasoning("deepseek_r1", _Tok(""))
    for fmt, prompt, mode in [(qwen3, "assistant\n", OPTIONAL), (qwen3, "assistant\n<think>\n", INSIDE),
                              (qwen3, "assistant\n<think>\n\n</think>\n\n", NONE), (r1, "assistant\n", INSIDE),
                              (r1, "assistant<think>\n\n</think>", NONE)]:
        plan, rule = plan_reasoning(fmt, prompt, True, 5)
        assert plan.mode == mode
        assert rule == (None if mode == NONE else ThinkingRule(END, THINK, mode == INSIDE, 5))
    assert plan_reasoning(None, "x", True, None) == (None, None)
    with pytest.raises(RequestError, match="--reasoning-parser"):
        plan_reasoning(None, "x", True, 3)
    assert thinking_budget(None, {"thinking_budget": 7}) == 7 and thinking_budget(4, None) == 4
    for budget, custom in [(-1, None), (True, None), (None, {"thinking_budget": -2}), (None, {"thinking_budget": "8"}),
                           (3, {"thinking_budget": 4})]:
        with pytest.raises(RequestError, match="thinking_budget"):
            thinking_budget(budget, custom)


