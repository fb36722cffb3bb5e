"""A thinking model's rule on CUDA (engine/thinking.py), where overlap scheduling launches a step before the last
one's tokens reach the host: the thinking budget's forced end lands exactly after `budget` thinking tokens, the
grammar starts only after it, and overlap on or off gives the same tokens. Tiny random models with the word-level
tokenizer of the CPU suite ("t12" is token 12; here t5 plays `<think>` and t6 `</think>`): they need CUDA and
xgrammar, no checkpoint.

    python3 -m pytest -q tests/gpu/test_thinking.py
"""
import importlib.util

import pytest
import torch

from minisrv import SamplingParams
from minisrv.engine.thinking import ThinkingRule

from ..helpers import EOS_ID, build_tiny_model, make_llm, make_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("xgrammar") is None,
                                reason="needs CUDA and xgrammar")

START, END = 5, 6
TENS = r"(t1[0-9])+"


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3", seed=3)


def _items(prompts):
    """Per prompt: (params, where the forced END must be, or None)."""
    out = []
    for i, p in enumerate(prompts):
        budget = 2 + i % 4
        if i % 3 == 0:  # the prompt opened the thinking; a regex answer after it
            sp = SamplingParams(temperature=0.0, max_tokens=16, regex=TENS, thinking=ThinkingRule(END, START, True,
                                                                                                    budget))
            out.append((p, sp, budget))
        elif i % 3 == 1:  # the model opens it (made to by logit_bias), no grammar: sampled, seeded
            sp = SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True, logit_bias={START: 100.0},
                                thinking=ThinkingRule(END, START, False, budget))
            out.append((p, sp, budget + 1))
        else:  # an ordinary request beside them
            out.append((p, SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True), None))
    return out


def test_budget_and_grammar_after_thinking_with_overlap(qwen3):
    items = _items(make_prompts(448, [5, 9, 13, 4, 7, 11, 6, 8, 10], seed=5))
    outs = {}
    for overlap in (True, False):
        llm = make_llm(qwen3, dtype="bfloat16", disable_overlap_schedule=not overlap)
        assert llm.engine.overlap == overlap
        outs[overlap] = [o.token_ids for o in llm.generate([p for p, _, _ in items], [sp for _, sp, _ in items],
                                                         use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
    for (_, sp, at), toks in zip(items, outs[True]):
        if at is None:
            continue
        assert toks[at] == END and END not in toks[:at], (at, toks)
        if sp.regex:
            assert EOS_ID not in toks[:at] and all(10 <= t <= 19 for t in toks[at + 1:] if t != EOS_ID), toks
